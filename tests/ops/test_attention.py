"""com.microsoft attention and fused ops against onnxruntime CPU."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto
from onnx_cases import assert_same, check_op, node_model, run_jax, run_ort

MS = "com.microsoft"
rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _seed():
    global rng
    rng = np.random.default_rng(0)


def _randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- GroupQueryAttention


_GQA_OPTIONAL = (
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
    "k_scale",
    "v_scale",
    "q_norm_weight",
    "k_norm_weight",
    "query_seqlens",
)


def _gqa(
    *,
    batch=2,
    seq=4,
    heads=4,
    kv_heads=2,
    head=16,
    buffer=0,
    seqlens=(3, 2),
    total=4,
    packed=False,
    rotary_dim=None,
    extra=None,
    outputs=("out", "present_key", "present_value"),
    tol=1e-4,
    dtype=np.float32,
    **attrs,
):
    """Runs one GroupQueryAttention node with onnxruntime and transmuter_jax; compares the output
    and the valid rows [0, seqlens_k[b] + 1) of the present buffers."""
    q = _randn(batch, seq, heads * head, dtype=dtype)
    k = _randn(batch, seq, kv_heads * head, dtype=dtype)
    v = _randn(batch, seq, kv_heads * head, dtype=dtype)
    inputs = {
        "query": np.concatenate([q, k, v], -1) if packed else q,
        "key": None if packed else k,
        "value": None if packed else v,
        "past_key": _randn(batch, kv_heads, buffer, head, dtype=dtype),
        "past_value": _randn(batch, kv_heads, buffer, head, dtype=dtype),
        "seqlens_k": np.asarray(seqlens, np.int32),
        "total_sequence_length": np.asarray(total, np.int32),
    }
    if attrs.get("do_rotary"):
        half = (rotary_dim or head) // 2
        angles = np.arange(64)[:, None] * (0.5 ** np.arange(half))[None, :]
        inputs["cos_cache"] = np.cos(angles).astype(dtype)
        inputs["sin_cache"] = np.sin(angles).astype(dtype)
    for name in _GQA_OPTIONAL:
        inputs.setdefault(name, None)
    inputs.update(extra or {})
    last = max(i for i, value in enumerate(inputs.values()) if value is not None)
    inputs = dict(list(inputs.items())[: last + 1])
    model = node_model(
        "GroupQueryAttention",
        inputs,
        outputs,
        domain=MS,
        num_heads=heads,
        kv_num_heads=kv_heads,
        **attrs,
    )
    feeds = {name: value for name, value in inputs.items() if value is not None}
    want, got = run_ort(model, feeds), run_jax(model, feeds)
    for name in outputs:
        assert got[name].shape == want[name].shape, name
    rows = extra.get("query_seqlens") if extra else None  # rows past these are unspecified
    for b in range(batch):
        end = seq if rows is None else rows[b]
        np.testing.assert_allclose(got["out"][b, :end], want["out"][b, :end], rtol=tol, atol=tol)
    for b, valid in enumerate(np.asarray(seqlens) + 1):
        for name in ("present_key", "present_value"):
            np.testing.assert_allclose(
                got[name][b, :, :valid], want[name][b, :, :valid], rtol=tol, atol=tol
            )
    return want, got


def test_gqa_prompt_empty_past():
    _gqa()


def test_gqa_prompt_long_zero_buffer():
    _gqa(buffer=8)


@pytest.mark.parametrize("attrs", [{}, {"do_rotary": 1}, {"local_window_size": 2}])
def test_gqa_prompt_in_a_buffer_of_the_step(attrs):
    # a first prompt whose buffer holds the step's rows (the engine's in-place prompt step):
    # every row's past is 0, so only the step's rows are attended
    _gqa(seq=6, buffer=6, seqlens=(5, 2), total=6, **attrs)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize(
    "case",
    [
        {},  # a first prompt
        {"seq": 6, "buffer": 6, "seqlens": (5, 2), "total": 6, "local_window_size": 2},
        {"seq": 1, "buffer": 8, "seqlens": (3, 6), "total": 7},  # decoding
        {"batch": 1, "seq": 3, "buffer": 8, "seqlens": (6,), "total": 7},  # a later chunk
        {"seq": 5, "buffer": 0, "seqlens": (4, 2), "total": 5, "causal": 0},
        {"heads": 6, "kv_heads": 3, "head": 32, "do_rotary": 1},
    ],
)
def test_gqa_with_and_without_the_attention_kernel(case, kernels_on):
    """The cases the CPU attention kernel takes, with it and on the op's XLA path (the kernels
    off, as on other backends): both onnxruntime's results."""
    from transmuter_jax import kernels

    if kernels_on and not kernels.enabled():
        pytest.skip("CPU kernels not available")
    if kernels_on:
        _gqa(**case)
    else:
        with kernels.off():
            _gqa(**case)


def test_gqa_prompt_packed():
    _gqa(packed=True)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_gqa_prompt_rotary(interleaved):
    _gqa(do_rotary=1, rotary_interleaved=interleaved)


def test_gqa_decode_longer_buffer_ragged():
    _gqa(seq=1, buffer=8, seqlens=(3, 6), total=7)


def test_gqa_decode_growing_cache():
    _gqa(seq=1, buffer=5, seqlens=(5, 2), total=6)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_gqa_decode_rotary_packed(interleaved):
    _gqa(
        seq=1,
        buffer=8,
        seqlens=(4, 7),
        total=8,
        packed=True,
        do_rotary=1,
        rotary_interleaved=interleaved,
    )


@pytest.mark.parametrize(
    "case",
    [
        {"seq": 1, "buffer": 8, "seqlens": (4, 7), "total": 8},  # decoding, no rotary
        {"seq": 1, "buffer": 8, "seqlens": (4, 7), "total": 8, "do_rotary": 1},
        {"seq": 1, "buffer": 8, "seqlens": (2, 5), "total": 8, "do_rotary": 1,
         "rotary_interleaved": 1},
        {"batch": 1, "seq": 3, "buffer": 10, "seqlens": (8,), "total": 9, "do_rotary": 1},
        {"seq": 1, "buffer": 8, "seqlens": (3, 6), "total": 7, "local_window_size": 3},
        {"head": 32, "rotary_dim": 16, "seq": 1, "buffer": 6, "seqlens": (2, 5), "total": 6,
         "do_rotary": 1},
        {"seq": 1, "buffer": 8, "seqlens": (2, 5), "total": 8, "do_rotary": 1,
         "extra": {"position_ids": np.array([[9], [3]], np.int64)}},
    ],
)  # fmt: skip
def test_gqa_packed_step_runs_in_one_kernel_call(case, monkeypatch):
    """A step of packed QKV over a buffer that holds it (the decoders' in-place cache) runs in
    one call of the step kernel (rotation, attention, the buffer's write): onnxruntime's
    results."""
    from transmuter_jax import kernels

    if not kernels.enabled():
        pytest.skip("CPU kernels not available")
    calls = []
    real = kernels.attention_step

    def counted(*args, **kwargs):
        done = real(*args, **kwargs)
        calls.append(done is not None)
        return done

    monkeypatch.setattr(kernels, "attention_step", counted)
    _gqa(packed=True, **case)
    assert calls and all(calls)


def test_gqa_partial_rotary():
    _gqa(head=32, rotary_dim=16, seq=1, buffer=6, seqlens=(2, 5), total=6, do_rotary=1)


def test_gqa_subsequent_prompt():
    _gqa(batch=1, seq=3, buffer=4, seqlens=(6,), total=7, do_rotary=1)


def test_gqa_subsequent_prompt_static_buffer():
    _gqa(batch=1, seq=3, buffer=10, seqlens=(6,), total=7, do_rotary=1)


@pytest.mark.parametrize("seq,buffer,seqlens,total", [(6, 0, (5, 3), 6), (1, 8, (3, 6), 7)])
def test_gqa_local_window(seq, buffer, seqlens, total):
    _gqa(seq=seq, buffer=buffer, seqlens=seqlens, total=total, local_window_size=2)


@pytest.mark.parametrize("seq,buffer,seqlens,total", [(6, 0, (5, 3), 6), (1, 8, (3, 6), 7)])
def test_gqa_softcap(seq, buffer, seqlens, total):
    _gqa(seq=seq, buffer=buffer, seqlens=seqlens, total=total, softcap=1.5, scale=0.4)


def test_gqa_smooth_softmax():
    _gqa(seq=6, seqlens=(5, 3), total=6, smooth_softmax=1)


def test_gqa_head_sink():
    _gqa(seq=1, buffer=8, seqlens=(3, 6), total=7, extra={"head_sink": _randn(4)})


def test_gqa_attention_bias():
    bias = _randn(2, 1, 1, 7)
    _gqa(seq=1, buffer=8, seqlens=(3, 6), total=7, extra={"attention_bias": bias})


def test_gqa_position_ids():
    pos = np.asarray([[9], [4]], np.int64)
    _gqa(seq=1, buffer=8, seqlens=(3, 6), total=7, do_rotary=1, extra={"position_ids": pos})


def test_gqa_prompt_position_ids():  # a first prompt reads position_ids[0, 0] only
    pos = np.asarray([[5, 9, 7, 8], [2, 3, 0, 5]], np.int64)
    _gqa(do_rotary=1, buffer=8, extra={"position_ids": pos})


def test_gqa_subsequent_prompt_position_ids():
    pos = np.asarray([[4, 9, 6]], np.int64)
    _gqa(batch=1, seq=3, buffer=4, seqlens=(6,), total=7, do_rotary=1, extra={"position_ids": pos})


def test_gqa_query_seqlens():
    lens = np.asarray([2, 3], np.int32)
    pos = np.asarray([[4, 9, 6], [1, 2, 3]], np.int64)
    extra = {"position_ids": pos, "query_seqlens": lens}
    _gqa(seq=3, buffer=10, seqlens=(6, 4), total=10, do_rotary=1, extra=extra)


def test_gqa_float16():
    _gqa(seq=1, buffer=6, seqlens=(3, 5), total=6, do_rotary=1, dtype=np.float16, tol=2e-3)


def test_gqa_not_causal():
    _gqa(seq=4, seqlens=(3, 3), total=4, causal=0)


@pytest.mark.parametrize("qk_output", [1, 2])
def test_gqa_qk_output(qk_output):
    outputs = ("out", "present_key", "present_value", "qk")
    want, got = _gqa(seq=1, buffer=6, seqlens=(3, 5), total=6, qk_output=qk_output, outputs=outputs)
    for b, valid in enumerate((4, 6)):
        np.testing.assert_allclose(
            got["qk"][b, ..., :valid], want["qk"][b, ..., :valid], rtol=1e-4, atol=1e-4
        )


# ---------------------------------------------------------------- MultiHeadAttention


def _mha(inputs, outputs=("out",), atol=1e-4, **attrs):
    check_op("MultiHeadAttention", inputs, outputs, domain=MS, rtol=1e-4, atol=atol, **attrs)


def test_mha_self():
    _mha(
        {"query": _randn(2, 5, 32), "key": _randn(2, 5, 32), "value": _randn(2, 5, 32)}, num_heads=4
    )


def test_mha_cross_lengths_and_bias():
    inputs = {
        "query": _randn(2, 3, 32),
        "key": _randn(2, 7, 32),
        "value": _randn(2, 7, 32),
        "bias": _randn(96),
    }
    _mha(inputs, num_heads=2, scale=0.2)


@pytest.mark.parametrize(
    ("kind", "attrs"),
    [("2d", {}), ("lengths", {"mask_filter_value": -1e9}), ("3d", {"mask_filter_value": -1e9})],
)
def test_mha_key_padding_mask(kind, attrs):
    """key_padding_mask as [B, L] 0/1, as lengths [B] or as [B, S, L] 0/1."""
    if kind == "2d":
        mask = np.ones((2, 6), np.int32)
        mask[1, 4:] = 0
    elif kind == "lengths":
        mask = np.asarray([6, 3], np.int32)
    else:
        mask = (rng.random((2, 3, 6)) > 0.3).astype(np.int32)
        mask[..., 0] = 1
    inputs = {
        "query": _randn(2, 3, 32),
        "key": _randn(2, 6, 32),
        "value": _randn(2, 6, 32),
        "bias": None,
        "key_padding_mask": mask,
    }
    _mha(inputs, num_heads=4, **attrs)


def test_mha_past_unidirectional():
    inputs = {
        "query": _randn(2, 2, 32),
        "key": _randn(2, 2, 32),
        "value": _randn(2, 2, 32),
        "bias": _randn(96),
        "key_padding_mask": None,
        "attention_bias": _randn(1, 4, 2, 7),
        "past_key": _randn(2, 4, 5, 8),
        "past_value": _randn(2, 4, 5, 8),
    }
    _mha(inputs, ("out", "present_key", "present_value"), num_heads=4, unidirectional=1)


def test_mha_cross_cached_keys():
    inputs = {"query": _randn(2, 1, 32), "key": _randn(2, 4, 6, 8), "value": _randn(2, 4, 6, 8)}
    _mha(inputs, num_heads=4)


# ---------------------------------------------------------------- DecoderMaskedMultiHeadAttention


def _dmmha(inputs, outputs=("out", "present_key", "present_value"), **attrs):
    while list(inputs.values())[-1] is None:
        inputs.popitem()
    check_op(
        "DecoderMaskedMultiHeadAttention",
        inputs,
        outputs,
        domain=MS,
        rtol=1e-4,
        atol=1e-4,
        num_heads=4,
        **attrs,
    )


def _dmmha_self(batch=2, past=5, shared=False, mask=False, beams=None, bias=False):
    heads, head, total = 4, 8, past + 1
    buffer = 9 if shared else past
    inputs = {
        "query": _randn(batch, 1, heads * head),
        "key": _randn(batch, 1, heads * head),
        "value": _randn(batch, 1, heads * head),
        "mask_index": None,
        "attention_bias": None,
        "past_key": _randn(batch, heads, buffer, head),
        "past_value": _randn(batch, heads, buffer, head),
        "past_sequence_length": np.asarray([past], np.int32) if shared else None,
        "beam_width": None,
        "cache_indirection": None,
        "bias": _randn(3 * heads * head) if bias else None,
    }
    if mask:
        m = np.ones((batch, total), np.int32)
        m[0, :2] = 0
        inputs["mask_index"] = m
    if beams:
        inputs["beam_width"] = np.asarray([beams], np.int32)
        ind = rng.integers(0, beams, (batch // beams, beams, buffer)).astype(np.int32)
        inputs["cache_indirection"] = ind
    return inputs


@pytest.mark.parametrize("shared", [True])  # onnxruntime's CPU kernel needs the shared buffer
def test_dmmha_self(shared):
    _dmmha(_dmmha_self(shared=shared), past_present_share_buffer=int(shared))


def test_dmmha_self_mask_bias_scale():
    _dmmha(_dmmha_self(shared=True, mask=True, bias=True), past_present_share_buffer=1, scale=0.2)


def test_dmmha_beam_search_cache_indirection():
    _dmmha(_dmmha_self(batch=4, shared=True, beams=2), past_present_share_buffer=1)


def test_dmmha_cross_attention_qk():
    inputs = {
        "query": _randn(2, 1, 32),
        "key": _randn(2, 4, 6, 8),
        "value": _randn(2, 4, 6, 8),
    }
    _dmmha(inputs, ("out",))


# ---------------------------------------------------------------- Attention (com.microsoft)


def _ms_attention(
    *,
    batch=2,
    seq=4,
    hidden=32,
    sizes=None,
    mask=None,
    past=0,
    bias=True,
    attn_bias=False,
    outputs=("out",),
    dtype=np.float32,
    tol=1e-4,
    **attrs,
):
    heads = attrs["num_heads"]
    widths = sizes or (hidden, hidden, hidden)
    total = past + seq
    inputs = {
        "input": _randn(batch, seq, hidden, dtype=dtype),
        "weights": _randn(hidden, sum(widths), dtype=dtype) * dtype(0.2),
        "bias": _randn(sum(widths), dtype=dtype) if bias else None,
        "mask_index": mask,
        "past": _randn(2, batch, heads, past, widths[1] // heads, dtype=dtype) if past else None,
        "attention_bias": _randn(1, heads, seq, total, dtype=dtype) if attn_bias else None,
    }
    while inputs and list(inputs.values())[-1] is None:
        inputs.popitem()
    if sizes:
        attrs["qkv_hidden_sizes"] = list(sizes)
    check_op("Attention", inputs, outputs, domain=MS, rtol=tol, atol=tol, **attrs)


def test_ms_attention_plain():
    _ms_attention(num_heads=4)


def test_ms_attention_no_bias_scale_sizes():
    _ms_attention(num_heads=2, bias=False, scale=0.3, sizes=(16, 16, 32))


@pytest.mark.parametrize("kind", ["lengths", "end_start", "2d", "3d"])
def test_ms_attention_masks(kind):
    if kind == "lengths":
        mask = np.asarray([4, 2], np.int32)
    elif kind == "end_start":
        mask = np.asarray([4, 3, 0, 1], np.int32)
    elif kind == "2d":
        mask = np.asarray([[1, 1, 1, 1], [1, 0, 1, 0]], np.int32)
    else:
        mask = (rng.random((2, 4, 4)) > 0.4).astype(np.int32)
        mask[..., 0] = 1
    _ms_attention(num_heads=4, mask=mask)


def test_ms_attention_unidirectional_past_present():
    mask = np.ones((2, 7), np.int32)
    mask[1, :2] = 0
    _ms_attention(
        num_heads=4, seq=3, past=4, mask=mask, unidirectional=1, outputs=("out", "present")
    )


def test_ms_attention_attention_bias():
    _ms_attention(num_heads=4, attn_bias=True, unidirectional=1)


def test_ms_attention_float16():
    _ms_attention(num_heads=4, dtype=np.float16, tol=5e-3)


# ---------------------------------------------------------------- RotaryEmbedding


def _caches(half, count=32):
    angles = np.arange(count)[:, None] * (0.3 ** np.arange(half))[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_3d(interleaved):
    cos, sin = _caches(8)
    pos = rng.integers(0, 32, (2, 5)).astype(np.int64)
    inputs = {"input": _randn(2, 5, 64), "position_ids": pos, "cos_cache": cos, "sin_cache": sin}
    check_op("RotaryEmbedding", inputs, domain=MS, interleaved=interleaved, num_heads=4)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_4d(interleaved):
    cos, sin = _caches(8)
    pos = rng.integers(0, 32, (2, 5)).astype(np.int64)
    inputs = {"input": _randn(2, 3, 5, 16), "position_ids": pos, "cos_cache": cos, "sin_cache": sin}
    check_op("RotaryEmbedding", inputs, domain=MS, interleaved=interleaved)


def test_rotary_offset_partial():
    cos, sin = _caches(4)
    pos = np.asarray([3], np.int64)
    inputs = {"input": _randn(2, 5, 64), "position_ids": pos, "cos_cache": cos, "sin_cache": sin}
    check_op("RotaryEmbedding", inputs, domain=MS, num_heads=4, rotary_embedding_dim=8)


# ---------------------------------------------------------------- norms and activations


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_norm(with_bias):
    inputs = {
        "input": _randn(2, 3, 16),
        "skip": _randn(2, 3, 16),
        "gamma": _randn(16),
        "beta": _randn(16),
        "bias": _randn(16) if with_bias else None,
    }
    outputs = ("y", "", "", "sum")
    check_op("SkipLayerNormalization", inputs, outputs, domain=MS, epsilon=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_norm(with_bias):
    inputs = {
        "input": _randn(2, 3, 16),
        "skip": _randn(2, 3, 16),
        "gamma": _randn(16),
        "bias": _randn(16) if with_bias else None,
    }
    outputs = ("y", "", "", "sum")
    check_op("SkipSimplifiedLayerNormalization", inputs, outputs, domain=MS, epsilon=1e-6)


def test_skip_simplified_layer_norm_one_output():
    inputs = {"input": _randn(4, 16), "skip": _randn(4, 16), "gamma": _randn(16)}
    check_op("SkipSimplifiedLayerNormalization", inputs, domain=MS)


@pytest.mark.parametrize("variant", ["full", "no_segment", "position_ids", "two_outputs"])
def test_embed_layer_norm(variant):
    b, s, d = 2, 5, 16
    inputs = {
        "input_ids": rng.integers(0, 30, (b, s)).astype(np.int32),
        "segment_ids": rng.integers(0, 2, (b, s)).astype(np.int32),
        "word_embedding": _randn(30, d),
        "position_embedding": _randn(12, d),
        "segment_embedding": _randn(2, d),
        "gamma": _randn(d),
        "beta": _randn(d),
        "mask": np.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32),
    }
    outputs = ("y", "mask_index", "sum")
    if variant == "no_segment":
        inputs["segment_ids"] = inputs["segment_embedding"] = inputs["mask"] = None
    elif variant == "position_ids":
        inputs["position_ids"] = rng.integers(0, 12, (b, s)).astype(np.int32)
    else:
        outputs = ("y", "mask_index") if variant == "two_outputs" else outputs
    check_op("EmbedLayerNormalization", inputs, outputs, domain=MS, epsilon=1e-5, atol=1e-4)


def test_gelus():
    x = _randn(3, 8) * 3
    check_op("Gelu", {"x": x}, domain=MS)
    check_op("BiasGelu", {"a": x, "b": _randn(8)}, domain=MS)
    check_op("FastGelu", {"x": x}, domain=MS)
    check_op("FastGelu", {"x": x, "bias": _randn(8)}, domain=MS)
    check_op("QuickGelu", {"x": x}, domain=MS)
    check_op("QuickGelu", {"x": x}, domain=MS, alpha=1.3)


def test_bias_add():  # onnxruntime has no CPU kernel for BiasAdd
    inputs = {"x": _randn(2, 4, 8), "bias": _randn(8), "skip": _randn(2, 4, 8)}
    got = run_jax(node_model("BiasAdd", inputs, domain=MS), inputs)["y"]
    np.testing.assert_allclose(got, inputs["x"] + inputs["bias"] + inputs["skip"], rtol=1e-6)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_fused_matmul(trans_a, trans_b):
    a = _randn(2, 5, 3) if trans_a else _randn(2, 3, 5)
    b = _randn(2, 4, 5) if trans_b else _randn(2, 5, 4)
    check_op("FusedMatMul", {"a": a, "b": b}, domain=MS, transA=trans_a, transB=trans_b, alpha=0.5)


def test_fused_matmul_trans_batch():
    a = _randn(3, 2, 5)  # transBatchA: [3, 2, 5] -> [2, 3, 5]
    b = _randn(2, 5, 4)
    check_op("FusedMatMul", {"a": a, "b": b}, domain=MS, transBatchA=1)


def test_dmmha_output_qk():
    inputs = _dmmha_self(shared=True)
    while list(inputs.values())[-1] is None:
        inputs.popitem()
    outputs = ("out", "present_key", "present_value", "qk")
    model = node_model(
        "DecoderMaskedMultiHeadAttention",
        inputs,
        outputs,
        domain=MS,
        num_heads=4,
        past_present_share_buffer=1,
        output_qk=1,
        constants=("past_sequence_length",),
    )
    model.graph.output[3].type.tensor_type.elem_type = TensorProto.FLOAT  # qk's type is free
    feeds = {k: v for k, v in inputs.items() if v is not None and k != "past_sequence_length"}
    assert_same(model, feeds, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- SparseAttention


def _csr(dense):
    """The CSR rows and (-1 padded) columns of block masks [layouts, R, R]."""
    rows = np.concatenate([np.zeros((len(dense), 1)), np.cumsum(dense.sum(-1), -1)], 1)
    nnz = int(dense.sum((1, 2)).max())
    cols = np.full((len(dense), nnz), -1)
    for i, layout in enumerate(dense):
        found = np.nonzero(layout)[1]
        cols[i, : len(found)] = found
    return rows.astype(np.int32), cols.astype(np.int32)


def _ort_shared_cache(model, feeds):
    """onnxruntime's outputs where present_key/present_value are bound to the past buffers (its
    CPU SparseAttention requires it)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    shared, buffers = {}, {}  # the OrtValues use the buffers' memory: keep them alive
    for name, array in feeds.items():
        if name in ("past_key", "past_value"):
            buffers[name] = array.copy()
            shared[name] = ort.OrtValue.ortvalue_from_numpy(buffers[name])
            binding.bind_ortvalue_input(name, shared[name])
        else:
            binding.bind_cpu_input(name, array)
    binding.bind_output("out")
    binding.bind_ortvalue_output("present_key", shared["past_key"])
    binding.bind_ortvalue_output("present_value", shared["past_value"])
    session.run_with_iobinding(binding)
    out = binding.copy_outputs_to_cpu()[0]
    return {
        "out": out,
        "present_key": buffers["past_key"],
        "present_value": buffers["past_value"],
    }


# Rows of one batch have the same length: with ragged key_total_sequence_lengths onnxruntime's
# CPU kernel attends the shorter rows differently (their present buffers agree).
@pytest.mark.parametrize(("seq", "totals"), [(20, (20, 20)), (1, (40, 40)), (3, (37, 37))])
@pytest.mark.parametrize("rotary", [0, 1])
def test_sparse_attention(seq, totals, rotary):
    batch, heads, kv_heads, head, block, buffer = 2, 4, 2, 16, 16, 64
    dense = np.tril(np.ones((2, 4, 4), np.int32))
    dense[0, 3, 1] = dense[1, 2, 0] = 0
    rows, cols = _csr(dense)
    inputs = {
        "query": _randn(batch, seq, heads * head),
        "key": _randn(batch, seq, kv_heads * head),
        "value": _randn(batch, seq, kv_heads * head),
        "past_key": _randn(batch, kv_heads, buffer, head),
        "past_value": _randn(batch, kv_heads, buffer, head),
        "block_row_indices": rows,
        "block_col_indices": cols,
        "total_sequence_length": np.asarray(max(totals), np.int32),
        "key_total_sequence_lengths": np.asarray(totals, np.int32),
    }
    if rotary:
        angles = np.arange(64)[:, None] * (0.5 ** np.arange(head // 2))[None, :]
        inputs["cos_cache"] = np.cos(angles).astype(np.float32)
        inputs["sin_cache"] = np.sin(angles).astype(np.float32)
    model = node_model(
        "SparseAttention",
        inputs,
        ("out", "present_key", "present_value"),
        domain=MS,
        num_heads=heads,
        kv_num_heads=kv_heads,
        sparse_block_size=block,
        do_rotary=rotary,
        constants=("total_sequence_length",),
    )
    feeds = {k: v for k, v in inputs.items() if k != "total_sequence_length"}
    want, got = _ort_shared_cache(model, feeds), run_jax(model, feeds)
    valid = max(totals) if seq > 1 else None
    for b, total in enumerate(totals):
        rows_b = slice(total - min(seq, total), total) if seq > 1 else slice(0, 1)
        np.testing.assert_allclose(got["out"][b, rows_b], want["out"][b, rows_b], atol=1e-4)
        for name in ("present_key", "present_value"):
            np.testing.assert_allclose(got[name][b, :, :total], want[name][b, :, :total], atol=1e-4)
    assert valid is None or got["out"].shape == want["out"].shape


# The attention core's precision rule: float16 rotary embedding is computed in float32 and
# rounded once, as onnxruntime's kernels compute it (both RotaryEmbedding ops).
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("onnx_op", [False, True])
def test_rotary_float16(interleaved, onnx_op):
    cos, sin = (c.astype(np.float16) for c in _caches(8))
    pos = rng.integers(0, 32, (2, 5)).astype(np.int64)
    x = (_randn(2, 5, 64) * 4).astype(np.float16)
    if onnx_op:
        inputs = {"x": x, "cos_cache": cos, "sin_cache": sin, "position_ids": pos}
        kwargs = {"opset": 23}
    else:
        inputs = {"input": x, "position_ids": pos, "cos_cache": cos, "sin_cache": sin}
        kwargs = {"domain": MS}
    model = node_model("RotaryEmbedding", inputs, interleaved=interleaved, num_heads=4, **kwargs)
    want, got = run_ort(model, inputs)["y"], run_jax(model, inputs)["y"]
    np.testing.assert_array_equal(got, want)  # one rounding: the same float16 values
