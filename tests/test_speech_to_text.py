"""The speech-to-text pipeline against transformers' WhisperForConditionalGeneration.generate
(references of tests/fixtures/make_speech.py on a tiny random multilingual Whisper)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from transmuter_jax.audio import AudioError, SpeechToText, speech_to_text
from transmuter_jax.audio.prompt import forced_prompt, language_id

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "whisper-speech-optimum"
# the same model in the three exporters' layouts (tests/fixtures/make_speech_layouts.py)
LAYOUTS = {
    "optimum": FIXTURE,
    "genai": FIXTURES / "whisper-speech-genai",
    "community": FIXTURES / "whisper-speech-community",
}
REF = json.loads((FIXTURE / "speech.json").read_text())
CASES = REF["cases"]
QUANTIZED = json.loads((LAYOUTS["community"] / "speech-quantized.json").read_text())["cases"]
RATE = 16000
# float32 log-probabilities of a random model with weights of std 0.5 over a 1500-frame encoder:
# onnx/JAX and torch sum in other orders (differences up to 3.5e-4 after 20 steps)
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def clips():
    with np.load(FIXTURE / "speech.npz") as data:
        return {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith("clip/")}


@pytest.fixture(scope="module")
def pipe() -> SpeechToText:
    return speech_to_text(FIXTURE, num_beams=1)  # the references are greedy generate()


@pytest.fixture(scope="module")
def pipes(pipe):
    """The pipeline of a layout, made on first use: pipes("genai")."""
    made = {"optimum": pipe}

    def of(layout: str) -> SpeechToText:
        if layout not in made:
            made[layout] = speech_to_text(LAYOUTS[layout], num_beams=1)
        return made[layout]

    return of


# each case in each layout; the other layouts run a representative few unless -m slow (the genai
# decoder's cache grows by its exact length: each length compiles a step)
FEW = {"optimum": set(CASES), "genai": {"en", "batch_es"}, "community": {"en", "timestamps"}}
LAYOUT_CASES = [
    pytest.param(layout, name, marks=() if name in FEW[layout] else pytest.mark.slow)
    for layout in LAYOUTS
    for name in sorted(CASES)
]


def _options(case):
    return dict(case["options"])


STAMPED = sorted(n for n, c in CASES.items() if c["options"].get("return_timestamps"))


@pytest.mark.parametrize(("layout", "name"), LAYOUT_CASES)
def test_generate_matches_transformers(pipes, clips, layout, name):
    pipe = pipes(layout)
    assert pipe.files.family == {"community": "transformers.js"}.get(layout, layout)
    case = CASES[name]
    audio = [clips[c] for c in case["clips"]]
    results = pipe.generate(audio, sampling_rate=RATE, token_logprobs=True, **_options(case))
    assert len(results) == len(case["rows"])
    for got, want in zip(results, case["rows"], strict=True):
        assert got.token_ids == want["tokens"]
        assert got.finish_reason == want["finish_reason"]
        assert got.text == want["text"]
        if want["logprobs"] is not None:  # transformers gives no scores with timestamps
            np.testing.assert_allclose(got.logprobs, want["logprobs"], atol=LOGPROB_ATOL, rtol=0)
        if name in STAMPED:  # the chunks of transformers' ASR pipeline on the clip alone
            assert [c["text"] for c in got.chunks] == [c["text"] for c in want["chunks"]]
            for chunk, ref in zip(got.chunks, want["chunks"], strict=True):
                assert len(chunk["timestamp"]) == 2
                for time, expected in zip(chunk["timestamp"], ref["timestamp"], strict=True):
                    assert time == (None if expected is None else pytest.approx(expected))
        else:
            assert got.chunks is None


def test_timestamp_cases_have_timestamps():
    """The timestamp references hold pairs of timestamps and text, and chunks the pipeline
    leaves open (end None), so the chunks are tested."""
    begin = REF["timestamp_begin"]
    rows = [row for name in STAMPED for row in CASES[name]["rows"]]
    assert len(rows) >= 3
    assert all(row["tokens"][0] >= begin for row in rows)  # the first token is a timestamp
    chunks = [c for row in rows for c in row["chunks"]]
    assert sum(None not in c["timestamp"] for c in chunks) >= 3
    assert any(c["timestamp"][1] is None and c["text"] for c in chunks)
    assert any(t < begin for row in rows for t in row["tokens"])


@pytest.mark.parametrize(("layout", "name"), LAYOUT_CASES)
def test_forced_prompt_matches_transformers(pipes, clips, layout, name):
    """The prompt generate used, with the language it detected."""
    pipe = pipes(layout)
    case = CASES[name]
    features = pipe.input_features([clips[c] for c in case["clips"]], RATE)
    options = _options(case)
    prompts = pipe.prompts(
        pipe.encode(features), options.get("language"), options.get("task"),
        bool(options.get("return_timestamps")),
    )  # fmt: skip
    assert prompts == [row["prompt"] for row in case["rows"]]


def test_detection_differs_between_clips():
    """The fixture's clips detect to different languages, so the test above can fail."""
    langs = {row["prompt"][1] for row in CASES["batch_detect"]["rows"]}
    assert len(langs) == len(CASES["batch_detect"]["rows"])


def test_call_gives_texts(pipe, clips):
    case = CASES["batch_es"]
    audio = [clips[c] for c in case["clips"]]
    texts = [row["text"] for row in case["rows"]]
    assert pipe(audio, sampling_rate=RATE, **_options(case)) == texts
    assert pipe(audio[0], sampling_rate=RATE, **_options(case)) == texts[0]


def test_pipeline_default_options(clips):
    case = CASES["en"]
    pipe = speech_to_text(FIXTURE, language="en", max_new_tokens=8, num_beams=1)
    assert pipe(clips["noise"], sampling_rate=RATE) == case["rows"][0]["text"]
    # a call's options override the pipeline's
    other = CASES["translate"]
    assert pipe(clips["noise"], sampling_rate=RATE, **_options(other)) == other["rows"][0]["text"]


def test_stream_joins_to_the_text(pipe, clips):
    case = CASES["detect"]
    pieces = list(pipe.stream(clips["tone"], sampling_rate=RATE, **_options(case)))
    assert len(pieces) > 1
    assert "".join(pieces) == case["rows"][0]["text"]


def test_file_input(pipe):
    path = FIXTURE / "stereo-44k.wav"
    by_path = pipe.generate([path], language="en", max_new_tokens=4)[0]
    by_bytes = pipe.generate([path.read_bytes()], language="en", max_new_tokens=4)[0]
    assert by_path.token_ids == by_bytes.token_ids and len(by_path.token_ids) == 4


def test_prompt_rules():
    config = json.loads((FIXTURE / "generation_config.json").read_text())
    sot, en, de = 5, config["lang_to_id"]["<|en|>"], config["lang_to_id"]["<|de|>"]
    transcribe, translate = config["task_to_id"]["transcribe"], config["task_to_id"]["translate"]
    stamps = config["no_timestamps_token_id"]
    assert forced_prompt(config, language="en") == [sot, en, transcribe, stamps]
    german = forced_prompt(config, language="German", task="translate")
    assert german == [sot, de, translate, stamps]
    assert forced_prompt(config, detected=de) == [sot, de, transcribe, stamps]
    assert forced_prompt(config, language="<|de|>", timestamps=True) == [sot, de, transcribe]
    assert language_id("english", config["lang_to_id"]) == en
    with pytest.raises(ValueError, match="unknown language"):
        language_id("klingon", config["lang_to_id"])
    with pytest.raises(ValueError, match="no language <|ja|>"):
        language_id("ja", config["lang_to_id"])


def test_bad_options_and_inputs(pipe, clips):
    with pytest.raises(ValueError, match="task is one of"):
        pipe.generate([clips["noise"]], sampling_rate=RATE, task="summarize")
    with pytest.raises(AudioError, match="sampling_rate"):
        pipe.generate([clips["noise"]])
    with pytest.raises(AudioError, match="NaN"):
        pipe(np.full(100, np.nan, np.float32), sampling_rate=RATE)
    with pytest.raises(TypeError, match="non-empty list"):
        pipe.generate([])


def test_stream_with_timestamps_joins_to_the_text(pipe, clips):
    """The prompt without <|notimestamps|> and the task's processor run in a stream too."""
    case = CASES["timestamps"]
    pieces = list(pipe.stream(clips["noise"], sampling_rate=RATE, **_options(case)))
    assert "".join(pieces) == case["rows"][0]["text"]


@pytest.fixture(scope="module")
def quantized() -> SpeechToText:
    # q8: transformers.js's _quantized; onnxruntime's greedy tokens
    return speech_to_text(LAYOUTS["community"], dtype="q8", num_beams=1)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n == "en" else pytest.mark.slow) for n in sorted(QUANTIZED)],
)
def test_quantized_variant_matches_onnxruntime(quantized, clips, name):
    """dtype="q8" runs onnx/*_quantized.onnx (uint8 weights), whose tokens are those of
    onnxruntime on the same files (speech-quantized.json), not transformers'."""
    pipe = quantized
    assert pipe.files.decoder.endswith("onnx/decoder_model_merged_quantized.onnx")
    assert pipe.files.encoder.endswith("onnx/encoder_model_quantized.onnx")
    case = QUANTIZED[name]
    # each input alone: DynamicQuantizeLinear scales a whole tensor, so the rows of a batch
    # change each other's tokens (in onnxruntime too)
    results = [
        pipe.generate([clips[c]], sampling_rate=RATE, **_options(case))[0] for c in case["clips"]
    ]
    assert [r.token_ids for r in results] == [row["tokens"] for row in case["rows"]]
    assert [r.finish_reason for r in results] == [row["finish_reason"] for row in case["rows"]]


def test_quantized_tokens_differ_from_fp32():
    """The quantized references are not the fp32 ones, so the test above tells them apart."""
    differ = [
        row["tokens"] != want["tokens"]
        for name, case in QUANTIZED.items()
        for row, want in zip(case["rows"], CASES[name]["rows"], strict=True)
    ]
    assert any(differ)


def test_community_graphs_are_pruned_to_what_is_read(pipes):
    """The transformers.js export returns attention weights (encoder_attentions.N,
    decoder_attentions.N, cross_attentions.N): the pipeline does not compute them."""
    from transmuter_jax.tasks.runner import output_names

    community = pipes("community")
    files = community.files
    assert any(n.startswith("cross_attentions.") for n in output_names(files.decoder))
    assert any(n.startswith("encoder_attentions.") for n in output_names(files.encoder))
    decoder = [o.name for o in community.decoder.outputs]
    assert "logits" in decoder and not [n for n in decoder if "attentions" in n]
    assert [o.name for o in community.encoder.model.outputs] == ["last_hidden_state"]


def test_genai_encoder_gives_the_cross_cache(pipes):
    """The genai decoder takes the encoder's cross-attention cache at every step."""
    genai = pipes("genai")
    given = genai.encoder.given
    assert genai.encoder.features == "audio_features"
    assert given["past_key_cross_0"] == "present_key_cross_0"
    assert "encoder_hidden_states" not in given
    assert {i.name: i.dtype for i in genai.decoder.inputs}["input_ids"] == "int32"


@pytest.mark.parametrize("layout", ["optimum", "genai"])
def test_encoder_batches_give_each_input_its_own_rows(pipes, clips, layout):
    """Seven inputs run as calls of 4, 2 and 1 (layouts.BATCHES): each row of the outputs is
    the one that input gets encoded alone."""
    from transmuter_jax.audio import layouts

    pipe = pipes(layout)
    audio = list(clips.values())
    audio = [audio[i % len(audio)] * (1 + 0.1 * i) for i in range(7)]
    features = pipe.input_features(audio, sampling_rate=RATE)
    calls = []
    model = pipe.encoder.model

    class Counted:
        def __call__(self, inputs):
            calls.append(len(next(iter(inputs.values()))))
            return model(inputs)

    pipe.encoder.model = Counted()
    try:
        together = pipe.encode(features)
    finally:
        pipe.encoder.model = model
    assert calls == [4, 2, 1] and layouts.BATCHES == (4, 2, 1)
    for i in range(len(audio)):
        alone = pipe.encode(features[i : i + 1])
        for name, value in together.items():
            np.testing.assert_allclose(value[i : i + 1], alone[name], rtol=1e-6, atol=1e-6)
