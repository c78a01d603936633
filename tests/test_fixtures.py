"""Every graph of every fixture against onnxruntime: prefill, decode and a long GQA buffer.

The fixtures are tiny random models exported by the real exporters (tests/fixtures/make.py).
Logits and presents must agree within 1e-4 (max abs difference).
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
from transmuter_jax.onnx.ops.quant import INT8_ENV
from transmuter_jax.testing import example_inputs

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TOLERANCE = 1e-4
# MatMulNBits with int8 activations (accuracy_level 4): an input at a rounding boundary of the
# int8 grid may round the other way than in onnxruntime, whose input differs in the last bits.
INT8_TOLERANCE = 5e-4


# fixtures whose references have a family's format (not reference.json): their graphs too
FAMILY_REFERENCES = ("smolvlm-community/vlm.json", "trocr-community/trocr.json")


def _graphs():
    params = []
    references = [*FIXTURES.glob("*/reference.json"), *(FIXTURES / f for f in FAMILY_REFERENCES)]
    for reference in sorted(references):
        folder = reference.parent
        assert reference.exists(), reference
        for path in sorted(folder.rglob("*.onnx")):
            name = f"{folder.name}/{path.relative_to(folder)}"
            params.append(pytest.param(path, id=name))
    return params


# Known divergences of test_graph_matches_onnxruntime, each strict (it fails the day it passes,
# to be taken out): at int8 activations one input one ulp away from onnxruntime's
# (GroupQueryAttention rounds differently upstream) can fall on the other side of an int8
# rounding boundary, which moves the logits by a whole quantization step. The MatMulNBits
# products themselves are bit-equal to onnxruntime's on the same inputs
# (tests/test_kernels.py::test_matmul_nbits_block32_follows_onnxruntime).
BOUNDARY = {
    "gemma3-genai-int4/model.onnx": pytest.mark.xfail(
        strict=True,
        reason="layer 1 down_proj: one activation of 1280 at -28.5 rounds to the other int8 "
        "step than in onnxruntime (upstream attention differs in the last bit): 0.058 on the "
        "logits against the 5e-4 bound",
    ),
}


GRAPHS = _graphs()


@functools.cache
def _load(path: pathlib.Path) -> tj.Model:
    return tj.load(path)


@functools.cache
def _session(path: pathlib.Path, exact: bool = False) -> ort.InferenceSession:
    """onnxruntime on the graph, MatMulNBits as the file says (at accuracy_level 4 the CPU kernels
    quantize the activations to int8, as transmuter_jax does by default); ``exact``: with
    accuracy_level 0 (exact dequantisation) everywhere."""
    proto = onnx.load(path)
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits" and exact:
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = 0
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _config(path: pathlib.Path) -> dict:
    file = next((p / "config.json" for p in path.parents if (p / "config.json").exists()), None)
    return json.loads(file.read_text()) if file else {}


def _encoder_length(path: pathlib.Path) -> int:
    config = _config(path)
    if "max_source_positions" in config and "input_features" in {
        i.name for i in _load(path).inputs
    }:
        return 2 * config["max_source_positions"]
    return config.get("max_source_positions", 7) if "max_source_positions" in config else 7


def _vocab(path: pathlib.Path) -> int:
    config = _config(path)
    text = config.get("text_config", config)
    return min(config.get("vocab_size") or text.get("vocab_size") or 64, 500)


def _has_cache(model: tj.Model) -> bool:
    return any(i.name.startswith("past_key") for i in model.inputs)


def _has_gqa(path: pathlib.Path) -> bool:
    proto = onnx.load(path, load_external_data=False)
    return any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)


def _compare(
    path: pathlib.Path, inputs: dict[str, np.ndarray], model: tj.Model | None = None, exact=False
) -> None:
    model = model or _load(path)
    session = _session(path, exact)
    names = [o.name for o in model.outputs]
    want = dict(zip(names, session.run(names, inputs), strict=True))
    got = model(inputs)
    tolerance = TOLERANCE if exact or 4 not in _nbits_levels(path) else INT8_TOLERANCE
    for name in names:
        actual, expected = np.asarray(got[name]), want[name]
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        if expected.size:
            diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()
            assert diff <= tolerance, f"{name}: max abs difference {diff:.3g}"


def _steps(path: pathlib.Path) -> list[tuple[str, dict]]:
    model = _load(path)
    options = {"vocab": _vocab(path), "encoder_length": _encoder_length(path)}
    if not _has_cache(model):
        return [(f"batch 2 length {n}", dict(batch=2, length=n, **options)) for n in (5, 11)]
    steps = [(f"prefill {n}", dict(batch=2, length=n, past=0, **options)) for n in (1, 5, 17)]
    steps.append(("decode past 7", dict(batch=2, length=1, past=7, **options)))
    if _has_gqa(path):
        # onnxruntime takes a prompt into a longer buffer for one row only.
        steps.append(("gqa buffer prefill", dict(batch=1, length=5, past=0, buffer=16, **options)))
        steps.append(
            ("gqa buffer decode", dict(batch=2, length=1, past=[7, 3], buffer=16, **options))
        )
    return steps


# The quick tier compares every encoder and embedding graph, and the decoders of one family per
# exporter and format (the token parity tests run every family's decoder on every change); the
# other decoders are in the slow sweep.
QUICK_DECODERS = (
    "llama-optimum/", "llama-genai-fp32/", "llama-genai-int4/", "gemma3-optimum/",
    "gemma3-genai-int4/", "whisper-optimum/", "marian-optimum/", "qwen25vl-genai-fp32/",
    "smolvlm-torch/", "smolvlm-community/", "trocr-community/onnx/decoder_model_merged.onnx",
    "vitgpt2-optimum/", "mistral-window-optimum/",
)  # fmt: skip


def _quick_graph(name: str) -> bool:
    return "encoder" in name or "embed" in name or name.startswith(QUICK_DECODERS)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            *p.values,
            id=p.id,
            marks=[m for m in (BOUNDARY.get(p.id), pytest.mark.slow) if m is not None]
            if not _quick_graph(p.id)
            else [m for m in (BOUNDARY.get(p.id),) if m is not None],
        )
        for p in GRAPHS
    ],
)
def test_graph_matches_onnxruntime(path):
    for label, options in _steps(path):
        try:
            _compare(path, example_inputs(_load(path), **options))
        except AssertionError as error:
            raise AssertionError(f"{label}: {error}") from error


def _nbits_levels(path: pathlib.Path) -> set[int]:
    proto = onnx.load(path, load_external_data=False)
    return {
        a.i
        for n in proto.graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "accuracy_level"
    }


@pytest.mark.parametrize("path", [p for p in GRAPHS if 4 in _nbits_levels(p.values[0])])
def test_int4_graph_matches_exact_onnxruntime_when_asked(path, monkeypatch):
    """TRANSMUTER_JAX_NBITS_INT8=0: accuracy_level 4 dequantizes exactly, as level 0 does."""
    monkeypatch.setenv(INT8_ENV, "0")
    model = tj.load(path)  # traced under the setting
    for label, options in _steps(path)[:4]:
        try:
            _compare(path, example_inputs(model, **options), model, exact=True)
        except AssertionError as error:
            raise AssertionError(f"{label}: {error}") from error


def _graph_inputs(path: pathlib.Path) -> set[str]:
    proto = onnx.load(path, load_external_data=False)
    return {i.name for i in proto.graph.input}


MERGED = [p for p in GRAPHS if "use_cache_branch" in _graph_inputs(p.values[0])]


def test_merged_decoders_are_found_by_their_input():
    """Optimum's merged decoders (an If on use_cache_branch), whatever their file name; a graph
    named decoder_model_merged without the input (smolvlm-community's) is not one."""
    names = {p.values[0].name for p in MERGED}
    assert {"decoder_model_merged.onnx", "decoder_model_merged_quantized.onnx"} <= names
    unmerged = FIXTURES / "smolvlm-community" / "onnx" / "decoder_model_merged.onnx"
    assert unmerged in [p.values[0] for p in GRAPHS] and unmerged not in [
        p.values[0] for p in MERGED
    ]


@pytest.mark.parametrize("path", MERGED)
def test_merged_decoders_pick_their_branch_at_trace_time(path):
    assert _load(path).static_inputs == ("use_cache_branch",)
