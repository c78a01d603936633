"""The onnxruntime-genai 0.18 Whisper export (fixtures/whisper-genai-fp32) against onnxruntime.

The encoder uses com.microsoft Attention and returns the cross-attention cache
(present_{key,value}_cross_N); the decoder takes it as past_{key,value}_cross_N, with int32
input_ids. Every output must agree within 1e-4 (max abs difference).
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import transmuter_jax as tj

FOLDER = pathlib.Path(__file__).parent / "fixtures" / "whisper-genai-fp32"
TOLERANCE = 1e-4
CONFIG = json.loads((FOLDER / "config.json").read_text())
LAYERS = CONFIG["decoder_layers"]
HEADS = CONFIG["decoder_attention_heads"]
HEAD = CONFIG["d_model"] // HEADS
FRAMES = 2 * CONFIG["max_source_positions"]
PROMPT = np.array([[5, 17, 20], [5, 8, 10]], np.int32)  # <|startoftranscript|> first
NEXT = np.array([[31], [12]], np.int32)
CROSS = [f"present_{kind}_cross_{i}" for i in range(LAYERS) for kind in ("key", "value")]


@functools.cache
def _model(name: str) -> tj.Model:
    return tj.load(FOLDER / name)


@functools.cache
def _session(name: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(FOLDER / name), options, providers=["CPUExecutionProvider"])


def _ort(name: str, inputs: dict) -> dict[str, np.ndarray]:
    session = _session(name)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def _assert_close(got: dict, want: dict) -> dict[str, float]:
    """Every output of ``want`` in ``got``, same shape, within TOLERANCE; the differences."""
    assert set(got) == set(want)
    diffs = {}
    for name, expected in want.items():
        actual = np.asarray(got[name])
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        diffs[name] = float(np.abs(actual.astype(np.float64) - expected).max())
        assert diffs[name] <= TOLERANCE, f"{name}: max abs difference {diffs[name]:.3g}"
    return diffs


def _features(seed: int = 0, batch: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, CONFIG["num_mel_bins"], FRAMES)).astype(np.float32)


def _decoder_feeds(ids: np.ndarray, cross: dict, past: dict | None = None) -> dict:
    """Decoder inputs: ``ids``, the self cache ``past`` (present_*_self_N; empty if None) and
    the encoder's ``cross`` cache (present_*_cross_N)."""
    feeds = {"input_ids": ids}
    for i in range(LAYERS):
        for kind in ("key", "value"):
            self_past = (past or {}).get(f"present_{kind}_self_{i}")
            if self_past is None:
                self_past = np.zeros((ids.shape[0], HEADS, 0, HEAD), np.float32)
            feeds[f"past_{kind}_self_{i}"] = np.asarray(self_past)
            feeds[f"past_{kind}_cross_{i}"] = np.asarray(cross[f"present_{kind}_cross_{i}"])
    return feeds


def test_layout_is_the_genai_whisper_one():
    encoder = onnx.load(FOLDER / "encoder.onnx", load_external_data=False)
    ops = {(n.domain, n.op_type) for n in encoder.graph.node}
    assert ("com.microsoft", "Attention") in ops
    assert [o.name for o in encoder.graph.output] == ["hidden_states", *sorted(CROSS)]
    decoder = _model("decoder.onnx")
    assert {i.name: i.dtype for i in decoder.inputs}["input_ids"] == "int32"
    genai = json.loads((FOLDER / "genai_config.json").read_text())["model"]
    assert genai["type"] == "whisper"
    assert genai["encoder"]["filename"] == "encoder.onnx"
    assert genai["decoder"]["inputs"]["cross_past_key_names"] == "past_key_cross_%d"


@pytest.mark.parametrize(("seed", "batch"), [(0, 2), (1, 1)])
def test_encoder_matches_onnxruntime(seed, batch):
    inputs = {"audio_features": _features(seed, batch)}
    want = _ort("encoder.onnx", inputs)
    assert set(want) == {"hidden_states", *CROSS}
    _assert_close(_model("encoder.onnx")(inputs), want)


def test_decoder_steps_match_onnxruntime_on_the_encoder_cross_cache():
    cross = _ort("encoder.onnx", {"audio_features": _features()})
    decoder = _model("decoder.onnx")
    prefill = _decoder_feeds(PROMPT, cross)
    want = _ort("decoder.onnx", prefill)
    assert want["logits"].shape == (2, 3, CONFIG["vocab_size"])
    _assert_close(decoder(prefill), want)
    step = _decoder_feeds(NEXT, cross, past=want)
    want_step = _ort("decoder.onnx", step)
    assert want_step["present_key_self_0"].shape == (2, HEADS, 4, HEAD)
    _assert_close(decoder(step), want_step)


def test_encoder_then_decoder_in_transmuter_jax_matches_onnxruntime():
    """The decoder fed transmuter_jax's own cross cache gives onnxruntime's logits."""
    features = {"audio_features": _features(2)}
    cross = _model("encoder.onnx")(features)
    got = _model("decoder.onnx")(_decoder_feeds(PROMPT, cross))
    want = _ort("decoder.onnx", _decoder_feeds(PROMPT, _ort("encoder.onnx", features)))
    _assert_close({"logits": got["logits"]}, {"logits": want["logits"]})


def _cross_inputs(decoder: tj.Model) -> list[str]:
    """The decoder's cross-attention inputs, which the encoder computes."""
    return [i.name for i in decoder.inputs if "_cross_" in i.name]


@pytest.mark.parametrize("beams", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_generation_on_the_encoder_cross_cache_matches_the_optimum_export(beams):
    """generate with the cross cache given by the caller (the genai encoder's) gives the tokens
    of the optimum export of the same model, whose first step computes that cache."""
    from transmuter_jax import generation as gen

    features = _features(3)
    encoded = _model("encoder.onnx")({"audio_features": features})
    cross = {n.replace("present_", "past_", 1): np.asarray(v) for n, v in encoded.items()}
    cross.pop("hidden_states")
    decoder = _model("decoder.onnx")
    options = {"max_new_tokens": 6, "num_beams": beams}  # exact grow: a compiled step per length
    genai = gen.compile(gen.context(FOLDER, decoder, given=sorted(cross), **options), 2)
    other = FOLDER.parent / "whisper-optimum"
    hidden = tj.load(other / "encoder_model.onnx")({"input_features": features})
    merged = tj.load(other / "decoder_model_merged.onnx")
    ctx = gen.context(other, merged, given=["encoder_hidden_states"], **options)
    optimum = gen.compile(ctx, 2)
    prompts = [[5, 17], [5, 8]]
    got = gen.generate(genai, prompts, [0, 0], cross)
    states = {"encoder_hidden_states": hidden["last_hidden_state"]}
    assert got == gen.generate(optimum, prompts, [0, 0], states)
    assert sum(len(t) for t in got) > 3


def test_a_decoder_without_its_cross_cache_is_refused():
    """The genai decoder's cross-attention inputs have no present output: the caller gives
    them, and a context or a call without them is refused with a clear error."""
    from transmuter_jax import generation as gen

    decoder = _model("decoder.onnx")
    cross = _cross_inputs(decoder)
    assert gen.context(FOLDER, decoder, given=cross).cache.given == tuple(cross)
    with pytest.raises(gen.GenerationError, match=r"from the caller \(past_key_cross_0, "):
        gen.context(FOLDER, decoder)
    with pytest.raises(gen.GenerationError, match=r"name them in given="):
        gen.context(FOLDER, decoder, given=cross[1:])
    ctx = gen.compile(gen.context(FOLDER, decoder, given=cross, max_new_tokens=2), 1)
    with pytest.raises(gen.GenerationError, match=r"'past_key_cross_0' \(a cross-attention"):
        gen.generate(ctx, [[5]], [0], {})
