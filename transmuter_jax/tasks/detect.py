"""Which task a model folder is for, decided once from its files, and the wrong-task errors.

- an encoder whose inputs hold ``pixel_values``: image to text (VisionEncoderDecoder);
- an encoder of ``input_features`` or ``audio_features``: speech to text (Whisper);
- another encoder: text to text (Marian, T5, BART);
- no encoder, a vision encoder beside the decoder (onnx-community) or a ``model.vision`` graph in
  genai_config.json: image and text to text (SmolVLM, Qwen2-VL);
- else: text generation (a decoder-only model).

Reading an encoder's inputs loads its graph without its weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import hub
from ..runtime.errors import ModelFileError, TransmuterError


@dataclass(frozen=True)
class Task:
    """A task of the library.

    Attributes:
        name: the Hugging Face pipeline name ("text-generation", ...).
        key: the name of its pipeline function ("generation", "text_to_text", ...).
        api: the pipeline function to call, as the library's path.
        command: the command line that runs it.
    """

    name: str
    key: str
    api: str
    command: str


TEXT_GENERATION = Task(
    "text-generation", "generation", "transmuter_jax.text.generation",
    "transmuter-jax generate MODEL PROMPT",
)  # fmt: skip
TEXT_TO_TEXT = Task(
    "text-to-text", "text_to_text", "transmuter_jax.text.text_to_text",
    "transmuter-jax translate MODEL TEXT",
)  # fmt: skip
SPEECH_TO_TEXT = Task(
    "speech-to-text", "speech_to_text", "transmuter_jax.audio.speech_to_text",
    "transmuter-jax transcribe MODEL AUDIO",
)  # fmt: skip
IMAGE_TO_TEXT = Task(
    "image-to-text", "image_to_text", "transmuter_jax.vision.image_to_text",
    "transmuter-jax caption MODEL IMAGE",
)  # fmt: skip
IMAGE_TEXT_TO_TEXT = Task(
    "image-text-to-text", "image_text_to_text", "transmuter_jax.vision.image_text_to_text",
    "transmuter-jax generate MODEL --image IMAGE PROMPT",
)  # fmt: skip
TASKS = (TEXT_GENERATION, TEXT_TO_TEXT, SPEECH_TO_TEXT, IMAGE_TO_TEXT, IMAGE_TEXT_TO_TEXT)
AUDIO_INPUTS = ("input_features", "audio_features")


class WrongTask(TransmuterError, ValueError):
    """The model belongs to another task than the pipeline it was given to.

    Attributes:
        task: the :attr:`Task.key` of the task that runs it ("generation", "text_to_text",
            "speech_to_text", "image_to_text" or "image_text_to_text").
    """

    def __init__(self, message: str, task: str):
        super().__init__(message)
        self.task = task


def vision_encoder_path(decoder: str) -> str:
    """The onnx-community vision encoder beside ``decoder``: ``vision_encoder{_dtype}.onnx`` for
    ``decoder_model_merged{_dtype}.onnx`` (or ``model{_dtype}.onnx``)."""
    folder, base = os.path.split(decoder)
    for stem in ("decoder_model_merged", "model"):
        if base.startswith(stem):
            return os.path.join(folder, "vision_encoder" + base[len(stem) :])
    return os.path.join(folder, "vision_encoder.onnx")


def encoder_inputs(files: hub.Files) -> set[str]:
    """The input names of the encoder of ``files`` (none without one)."""
    if files.encoder is None:
        return set()
    import onnx

    return {i.name for i in onnx.load(files.encoder, load_external_data=False).graph.input}


def _genai_vision(files: hub.Files) -> bool:
    for folder in (os.path.dirname(files.decoder), files.folder):
        if os.path.isfile(os.path.join(folder, "genai_config.json")):
            config = hub.read_json(folder, "genai_config.json")
            return "vision" in (config.get("model") or {})
    return False


def detect_files(files: hub.Files) -> Task:
    """The task of a model of resolved ``files``."""
    names = encoder_inputs(files)
    if files.encoder is not None:
        if "pixel_values" in names:
            return IMAGE_TO_TEXT
        if names & set(AUDIO_INPUTS):
            return SPEECH_TO_TEXT
        return TEXT_TO_TEXT
    if os.path.exists(vision_encoder_path(files.decoder)) or _genai_vision(files):
        return IMAGE_TEXT_TO_TEXT
    return TEXT_GENERATION


def detect(repo: str | os.PathLike | None, dtype: str | None = None, file: str | None = None):
    """The :class:`Task` that a model is for.

    Args:
        repo: a local folder, a hub id, or None / a default-model alias (the default model).
        dtype: which variant of the ONNX files; file: the decoder file (as the pipelines take).

    Raises:
        ModelFileError: ``repo`` holds no model the library reads.
    """
    from .runner import resolve

    return detect_files(resolve(repo, dtype, file))


def _short(task: Task) -> str:
    return task.api.removeprefix("transmuter_jax.")


def _encoder_name(files: hub.Files) -> str:
    return os.path.basename(files.encoder or "")


def check(wanted: Task, repo: Any, files: hub.Files, also: tuple[Task, ...] = ()) -> Task:
    """The task of ``files``, when it is ``wanted`` (or one of ``also``); else raises
    :class:`WrongTask` naming the task and the pipeline that run it (:class:`ModelFileError`
    for an onnxruntime-genai folder whose genai_config.json names no vision graph, given to
    image and text to text)."""
    found = detect_files(files)
    if found in (wanted, *also):
        return found
    name = repr(os.fspath(repo)) if repo is not None else "the default model"
    if found is IMAGE_TO_TEXT and wanted in (TEXT_GENERATION, TEXT_TO_TEXT):
        message = (
            f"{name} is an image-to-text model (its encoder {_encoder_name(files)} takes "
            "pixel_values): use transmuter_jax.vision.image_to_text"
        )
    elif found is SPEECH_TO_TEXT and wanted is not SPEECH_TO_TEXT:
        message = (
            f"{name} is a speech-to-text model (its encoder {_encoder_name(files)} takes audio "
            "features): use transmuter_jax.audio.speech_to_text"
        )
    elif wanted is TEXT_GENERATION:
        message = f"{name} is an encoder-decoder model: use transmuter_jax.text.text_to_text"
    elif wanted is TEXT_TO_TEXT:
        message = f"{name} has no encoder: use transmuter_jax.text.generation"
    elif wanted is SPEECH_TO_TEXT:
        message = (
            f"{name} has no encoder: a Whisper export has encoder_model.onnx (or the "
            "encoder.onnx that genai_config.json names)"
            if files.encoder is None
            else f"{name} is for {found.name}: use {found.api}"
        )
    elif wanted is IMAGE_TO_TEXT:
        if files.encoder is None:
            hint = (
                " (it has vision_encoder.onnx: use vision.image_text_to_text)"
                if found is IMAGE_TEXT_TO_TEXT
                else f" (a decoder-only model: use {_short(found)})"
            )
            message = (
                f"{name} has no image encoder (encoder_model.onnx): it is not an image-to-text "
                f"model{hint}"
            )
        else:
            message = (
                f"the encoder {files.encoder!r} takes no pixel_values: it is not an image "
                f"encoder (use {_short(found)} for a text encoder-decoder model)"
            )
    elif files.family == "genai" and files.encoder is None:  # image and text to text
        config = os.path.join(os.path.dirname(files.decoder), "genai_config.json")
        raise ModelFileError(  # the layout's file lacks what the task needs
            f"{config!r} has no model.vision.filename: an image-text-to-text folder in the "
            "onnxruntime-genai layout names its vision graph there (see docs/vision.md); "
            f"without one it is a decoder-only model: use {_short(found)}"
        )
    else:  # image and text to text
        hint = (
            f" (a decoder-only model: use {_short(found)})"
            if files.encoder is None
            else f" (its encoder {_encoder_name(files)}: use {_short(found)})"
        )
        message = (
            f"{name} has no vision encoder ({vision_encoder_path(files.decoder)}): it is not an "
            f"image-text-to-text model{hint}"
        )
    raise WrongTask(message, found.key)
