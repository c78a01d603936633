"""The generation defaults of transformers' automatic-speech-recognition pipeline."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BEAMS = 5  # the pipeline's num_beams (its _default_generation_config), as openai-whisper's
MAX_NEW_TOKENS = 256  # its max_new_tokens, where generation_config.json sets no max_length
GLOBAL_MAX_LENGTH = 20  # GenerationConfig's own max_length: not a length the model sets


def pipeline_defaults(generation_config: Mapping[str, Any], options: Mapping[str, Any]) -> dict:
    """The options that transformers 4.57's ASR pipeline adds to the caller's ``options``.

    num_beams 5 unless the caller gives num_beams; the pipeline's value wins over a num_beams of
    generation_config.json, as in transformers (its config is not at the global default, so the
    model's does not replace it). max_new_tokens 256 unless the caller gives a length or
    generation_config.json sets a max_length other than 20 (Whisper's 448 wins).
    """
    out: dict[str, Any] = {}
    if "num_beams" not in options:
        out["num_beams"] = BEAMS
    if "max_new_tokens" not in options and "max_length" not in options:
        length = generation_config.get("max_length")
        if length is None or length == GLOBAL_MAX_LENGTH:
            out["max_new_tokens"] = MAX_NEW_TOKENS
    return out
