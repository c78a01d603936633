"""``detect`` on every fixture folder gives its task, and the wrong-task error of each pipeline
names the task and the pipeline that run the model."""

from __future__ import annotations

import os
import pathlib

import pytest

from transmuter_jax import audio, text, vision
from transmuter_jax.runtime.errors import ModelFileError
from transmuter_jax.tasks import detect

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
NOT_MODELS = {"processors", "smolvlm-processor", "text", "vision-processors"}  # no decoder
EXPECTED = {
    "gemma3-genai-fp32": "text-generation",
    "gemma3-genai-int4": "text-generation",
    "gemma3-optimum": "text-generation",
    "gpt2-optimum": "text-generation",
    "llama-genai-fp32": "text-generation",
    "llama-genai-int4": "text-generation",
    "llama-optimum": "text-generation",
    "qwen2-genai-fp32": "text-generation",
    "qwen2-genai-int4": "text-generation",
    "qwen2-optimum": "text-generation",
    # the architectures of issue 29 (tests/fixtures/make_archs.py)
    "bloom-optimum": "text-generation",
    "cohere-optimum": "text-generation",
    "falcon-optimum": "text-generation",
    "gemma2-optimum": "text-generation",
    "gpt-neox-optimum": "text-generation",
    "granite-genai-fp32": "text-generation",
    "granite-optimum": "text-generation",
    "mistral-genai-fp32": "text-generation",
    "mistral-optimum": "text-generation",
    "mistral-window-genai-fp32": "text-generation",
    "mistral-window-optimum": "text-generation",
    "olmo2-optimum": "text-generation",
    "opt-optimum": "text-generation",
    "phi3-genai-fp32": "text-generation",
    "phi3-optimum": "text-generation",
    "qwen3-genai-fp32": "text-generation",
    "qwen3-optimum": "text-generation",
    "smollm3-optimum": "text-generation",
    "stablelm-optimum": "text-generation",
    # decoders of embeddings without a vision graph: text generation alone
    "qwen25vl-genai-fp32": "text-generation",
    "qwen25vl-genai-int4": "text-generation",
    "smolvlm-torch": "text-generation",
    "marian-optimum": "text-to-text",
    "qwen25vl-community": "image-text-to-text",
    "qwen25vl-genai-vlm": "image-text-to-text",
    "qwen2vl-community": "image-text-to-text",
    "smolvlm-community": "image-text-to-text",
    "smolvlm-features": "image-text-to-text",
    "trocr-community": "image-to-text",
    "vitgpt2-optimum": "image-to-text",
    "whisper-genai-fp32": "speech-to-text",
    "whisper-optimum": "speech-to-text",
    "whisper-speech-community": "speech-to-text",
    "whisper-speech-genai": "speech-to-text",
    "whisper-speech-optimum": "speech-to-text",
}
FOLDERS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__")


def test_every_fixture_folder_is_listed():
    assert set(FOLDERS) == set(EXPECTED) | NOT_MODELS


@pytest.mark.parametrize("name", FOLDERS)
def test_detect_gives_the_task_of_each_fixture(name):
    if name in NOT_MODELS:
        with pytest.raises(ModelFileError, match="has no decoder"):
            detect.detect(FIXTURES / name)
        return
    task = detect.detect(FIXTURES / name)
    assert task.name == EXPECTED[name]
    assert task in detect.TASKS


def test_each_task_names_its_pipeline_and_command():
    keys = {t.key for t in detect.TASKS}
    assert keys == {"generation", "text_to_text", "speech_to_text", "image_to_text",
                    "image_text_to_text"}  # fmt: skip
    for task in detect.TASKS:
        module, _, function = task.api.rpartition(".")
        assert function == task.key and module.startswith("transmuter_jax.")
        assert task.command.startswith("transmuter-jax ")


# (pipeline, fixture of another task, the task that runs it, what the message says)
WRONG = [
    (text.generation, "marian-optimum", "text_to_text", "use transmuter_jax.text.text_to_text"),
    (text.generation, "vitgpt2-optimum", "image_to_text", "use transmuter_jax.vision.image_to"),
    (text.generation, "whisper-optimum", "speech_to_text", "use transmuter_jax.audio.speech_to"),
    (text.text_to_text, "llama-optimum", "generation", "use transmuter_jax.text.generation"),
    (text.text_to_text, "trocr-community", "image_to_text", "use transmuter_jax.vision.image_to"),
    (text.text_to_text, "whisper-optimum", "speech_to_text", "use transmuter_jax.audio.speech"),
    (audio.speech_to_text, "llama-optimum", "generation", "has no encoder: a Whisper export"),
    (audio.speech_to_text, "marian-optimum", "text_to_text", "use transmuter_jax.text.text_to"),
    (audio.speech_to_text, "vitgpt2-optimum", "image_to_text", "use transmuter_jax.vision.image"),
    (vision.image_to_text, "smolvlm-community", "image_text_to_text", "use vision.image_text_to"),
    (vision.image_to_text, "llama-optimum", "generation", "use text.generation"),
    (vision.image_to_text, "marian-optimum", "text_to_text", "use text.text_to_text"),
    (vision.image_to_text, "whisper-optimum", "speech_to_text", "use transmuter_jax.audio.spee"),
    (vision.image_text_to_text, "vitgpt2-optimum", "image_to_text", "use vision.image_to_text"),
    (vision.image_text_to_text, "llama-optimum", "generation", "use text.generation"),
    (vision.image_text_to_text, "marian-optimum", "text_to_text", "use text.text_to_text"),
    (vision.image_text_to_text, "whisper-optimum", "speech_to_text", "use transmuter_jax.audio"),
]


@pytest.mark.parametrize(("pipeline", "name", "task", "says"), WRONG)
def test_the_wrong_task_error_names_the_right_one(pipeline, name, task, says):
    assert detect.detect(FIXTURES / name).key == task
    with pytest.raises(detect.WrongTask) as error:
        pipeline(FIXTURES / name)
    assert error.value.task == task
    assert says in str(error.value)
    assert os.fspath(FIXTURES / name) in str(error.value) or "encoder" in str(error.value)


def test_a_vision_language_model_runs_text_generation_on_its_decoder():
    """text.generation takes the text decoder of an image-text-to-text model (text prompts)."""
    assert detect.detect(FIXTURES / "smolvlm-community") is detect.IMAGE_TEXT_TO_TEXT
    pipe = text.generation(FIXTURES / "smolvlm-community")
    assert pipe.files.embed is not None
