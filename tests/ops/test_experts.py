"""com.microsoft MoE and QMoE against onnxruntime CPU."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op

MS = "com.microsoft"
E, H, I = 4, 16, 16  # experts, hidden size, inter size


def _inputs(rng, *, tokens=(2, 3), fused=1, fc3=False, bias=True):
    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "input": randn(*tokens, H),
        "router_probs": randn(int(np.prod(tokens)), E),
        "fc1_experts_weights": randn(E, fused * I, H) * 0.3,
        "fc1_experts_bias": randn(E, fused * I) if bias else None,
        "fc2_experts_weights": randn(E, H, I) * 0.3,
        "fc2_experts_bias": randn(E, H) if bias else None,
        "fc3_experts_weights": randn(E, I, H) * 0.3 if fc3 else None,
        "fc3_experts_bias": None,
    }


def _trim(inputs):
    while list(inputs.values())[-1] is None:
        inputs.popitem()
    return inputs


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "identity"])
@pytest.mark.parametrize("k", [1, 2])
def test_moe_activations(activation, k):
    rng = np.random.default_rng(0)
    inputs = _trim(_inputs(rng))
    check_op("MoE", inputs, domain=MS, activation_type=activation, k=k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fusion", [1])  # onnxruntime's CPU MoE only has the interleaved layout
def test_moe_swiglu(fusion):
    rng = np.random.default_rng(1)
    inputs = _trim(_inputs(rng, tokens=(5,), fused=2))
    attrs = dict(activation_type="swiglu", swiglu_fusion=fusion, k=2, normalize_routing_weights=1)
    attrs.update(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=1.5)
    check_op("MoE", inputs, domain=MS, rtol=1e-4, atol=1e-4, **attrs)


def test_moe_normalized_no_bias():
    rng = np.random.default_rng(2)
    inputs = _trim(_inputs(rng, bias=False))
    check_op("MoE", inputs, domain=MS, k=3, normalize_routing_weights=1, rtol=1e-4, atol=1e-4)


def _quantize(rng, shape, bits, block):
    """Random packed weights [E, N, K * bits / 8] with their scales (and zero points)."""
    e, n, k = shape
    q = rng.integers(0, 1 << bits, shape).astype(np.uint8)
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    groups = k // block if block else None
    scales = rng.uniform(0.01, 0.05, (e, n, groups) if block else (e, n)).astype(np.float32)
    return q, scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [0, 16])
def test_qmoe_int(bits, block):
    rng = np.random.default_rng(3)
    w1, s1 = _quantize(rng, (E, 2 * I, H), bits, block)
    w2, s2 = _quantize(rng, (E, H, I), bits, block)
    inputs = {
        "input": rng.standard_normal((3, H)).astype(np.float32),
        "router_probs": rng.standard_normal((3, E)).astype(np.float32),
        "fc1_experts_weights": w1,
        "fc1_scales": s1,
        "fc1_experts_bias": rng.standard_normal((E, 2 * I)).astype(np.float32),
        "fc2_experts_weights": w2,
        "fc2_scales": s2,
    }
    # onnxruntime's CPU QMoE renormalizes the top-k weights even with normalize_routing_weights=0
    # (its CPU MoE does not): test the attribute's documented meaning only where both agree.
    attrs = dict(activation_type="swiglu", swiglu_fusion=1, k=2, expert_weight_bits=bits)
    attrs["normalize_routing_weights"] = 1
    if block:
        attrs["block_size"] = block
    check_op("QMoE", inputs, domain=MS, rtol=1e-3, atol=1e-3, **attrs)
