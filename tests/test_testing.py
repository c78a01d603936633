"""transmuter_jax.testing: example inputs, comparison with onnxruntime, first divergence."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

import transmuter_jax as tj
from transmuter_jax import kernels
from transmuter_jax.onnx import prepack, registry
from transmuter_jax.testing import compare_with_onnxruntime, example_inputs, first_divergence

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "llama-optimum" / "model.onnx"
GQA = FIXTURES / "llama-genai-fp32" / "model.onnx"


def test_example_inputs_follow_the_signature():
    model = tj.load(LLAMA)
    inputs = example_inputs(model, batch=2, length=3, past=[4, 2])
    assert inputs["input_ids"].shape == (2, 3)
    assert inputs["past_key_values.0.key"].shape == (2, 2, 4, 16)
    # Right-aligned past: row 1 has 2 valid cached tokens out of 4.
    np.testing.assert_array_equal(inputs["attention_mask"], [[1] * 7, [0, 0] + [1] * 5])
    np.testing.assert_array_equal(inputs["position_ids"], [[4, 5, 6], [4, 5, 6]])


def test_example_inputs_in_a_longer_buffer():
    model = tj.load(GQA)
    inputs = example_inputs(model, batch=2, length=1, past=[3, 1], buffer=6)
    np.testing.assert_array_equal(inputs["attention_mask"], [[1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    free = inputs["past_key_values.0.key"][1, :, 1:]
    assert not free.any()
    with pytest.raises(ValueError, match="does not fit"):
        example_inputs(model, batch=1, length=4, past=3, buffer=6)


def test_compare_with_onnxruntime_reports_small_differences():
    model = tj.load(LLAMA)
    diffs = compare_with_onnxruntime(model, example_inputs(model, batch=2, length=4, past=3))
    assert set(diffs) == {o.name for o in model.outputs}
    assert max(diffs.values()) < 1e-4


def test_first_divergence_is_none_when_all_nodes_agree():
    model = tj.load(LLAMA)
    assert first_divergence(model, example_inputs(model, batch=1, length=3)) is None


def test_first_divergence_names_the_wrong_node(monkeypatch):
    # Break Sigmoid (used by the SiLU of the MLP): the first divergence is a Sigmoid node. The
    # graph as written: with the kernels on, the gate's Sigmoid is fused into SiluMul at load.
    key = ("", "Sigmoid")
    broken = [dataclasses.replace(s, fn=lambda x: x * 0.5) for s in registry._REGISTRY[key]]
    monkeypatch.setitem(registry._REGISTRY, key, broken)
    with kernels.off():
        model = tj.load(LLAMA)
        label, name, diff = first_divergence(model, example_inputs(model, batch=1, length=3))
    assert "(Sigmoid)" in label and diff > 1e-4


def test_first_divergence_names_a_fused_node(monkeypatch):
    # With the kernels, the gate is one fused node (SiluMul, or PackedGateUp with its two
    # products where the weights are packed): broken, it is the first divergence.
    if not kernels.enabled():
        pytest.skip("the gate is fused only with the CPU kernels")
    fused = {op for domain, op in tj.load(LLAMA).op_types if domain == prepack.DOMAIN}
    op = "PackedGateUp" if "PackedGateUp" in fused else "SiluMul"
    key = (prepack.DOMAIN, op)

    def ungated(*args, **attributes):  # the gate's product without its SiLU
        if op == "SiluMul":
            return args[0] * args[1]
        a, gate, up = args
        n = attributes["n"]
        return kernels.matmul(a, gate, n) * kernels.matmul(a, up, n)

    broken = [dataclasses.replace(s, fn=ungated) for s in registry._REGISTRY[key]]
    monkeypatch.setitem(registry._REGISTRY, key, broken)
    model = tj.load(LLAMA)
    label, name, diff = first_divergence(model, example_inputs(model, batch=1, length=3))
    assert label.endswith(f"::{op})") and diff > 1e-4


def test_example_inputs_of_a_vision_encoder_of_images_and_masks():
    """pixel_values [batch, images, 3, H, W] and pixel_attention_mask [batch, images, H, W]:
    each row's first image whole, the others padded (the top-left quarter real)."""
    path = pathlib.Path(__file__).parent / "fixtures/smolvlm-community/onnx/vision_encoder.onnx"
    inputs = example_inputs(tj.load(path), batch=2)
    pixels, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    assert pixels.shape == (2, 2, 3, 64, 64) and pixels.dtype == np.float32
    assert mask.shape == (2, 2, 64, 64) and mask.dtype == np.int64
    assert (mask[:, 0] == 1).all() and mask[:, 1].sum((1, 2)).tolist() == [32 * 32] * 2
