"""Neural-network ops against onnxruntime, one node at a time."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op

TOL = {"rtol": 1e-4, "atol": 1e-5}


def rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(dtype)


# --- matrix products ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((3, 4), (4, 5)),
        ((2, 3, 4), (4, 5)),
        ((2, 1, 3, 4), (3, 4, 2)),
        ((4,), (4, 5)),
        ((3, 4), (4,)),
    ],
)
@pytest.mark.parametrize("opset", [9, 13])
def test_matmul(a_shape, b_shape, opset):
    check_op("MatMul", {"a": rand(*a_shape), "b": rand(*b_shape, seed=1)}, opset=opset, **TOL)


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (5,), (3, 5), (1,)])
@pytest.mark.parametrize("opset", [9, 11, 13])
def test_gemm(trans_a, trans_b, c_shape, opset):
    if c_shape is None and opset < 11:
        pytest.skip("C is required before opset 11")
    a = rand(4, 3) if trans_a else rand(3, 4)
    b = rand(5, 4, seed=1) if trans_b else rand(4, 5, seed=1)
    c = rand(*c_shape, seed=2) if c_shape else None
    check_op(
        "Gemm",
        {"a": a, "b": b, "c": c},
        transA=trans_a,
        transB=trans_b,
        alpha=0.5,
        beta=2.0,
        opset=opset,
        **TOL,
    )


def test_gemm_defaults():
    check_op("Gemm", {"a": rand(3, 4), "b": rand(4, 5, seed=1), "c": rand(3, 5)}, **TOL)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("zero_points", ["none", "scalar", "vector"])
def test_matmul_integer(dtype, zero_points):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    a = rng.integers(info.min, info.max, (3, 4)).astype(dtype)
    b = rng.integers(info.min, info.max, (4, 5)).astype(dtype)
    inputs = {"a": a, "b": b}
    if zero_points == "scalar":
        inputs |= {"za": np.array(3, dtype), "zb": np.array(5, dtype)}
    elif zero_points == "vector":
        # onnxruntime takes a per-column zero point of B only (A's per-row one: backend cases).
        inputs |= {"za": np.array(2, dtype), "zb": np.arange(5).astype(dtype)}
    check_op("MatMulInteger", inputs)


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("bhsd,bhtd->bhst", [(1, 2, 3, 4), (1, 2, 5, 4)]),
        ("ii->i", [(4, 4)]),
        ("ij->ji", [(3, 4)]),
        ("ij->", [(3, 4)]),
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
        ("i,j->ij", [(3,), (4,)]),
        ("i j , j k -> i k", [(3, 4), (4, 5)]),
    ],
)
def test_einsum(equation, shapes):
    inputs = {f"x{i}": rand(*s, seed=i) for i, s in enumerate(shapes)}
    check_op("Einsum", inputs, equation=equation, **TOL)


# --- convolution ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"pads": [1, 1]},
        {"pads": [2, 0], "strides": [2]},
        {"dilations": [2], "pads": [1, 2]},
        {"group": 2},
        {"group": 4, "strides": [3], "pads": [1, 1]},
        {"auto_pad": "SAME_UPPER", "strides": [2]},
        {"auto_pad": "SAME_LOWER", "strides": [2]},
        {"auto_pad": "VALID", "strides": [2]},
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_1d(attrs, bias):
    group = attrs.get("group", 1)
    x = rand(2, 4, 11)
    w = rand(6 if group != 4 else 8, 4 // group, 3, seed=1)
    b = rand(w.shape[0], seed=2) if bias else None
    check_op("Conv", {"x": x, "w": w, "b": b}, constants=("w", "b"), **attrs, **TOL)


@pytest.mark.parametrize(
    "attrs",
    [
        {"pads": [1, 1, 1, 1]},
        {"pads": [0, 1, 2, 1], "strides": [2, 1]},
        {"dilations": [2, 1], "strides": [1, 2]},
        {"group": 2, "kernel_shape": [3, 3]},
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        {"auto_pad": "SAME_LOWER", "strides": [2, 3]},
        {"auto_pad": "VALID"},
    ],
)
@pytest.mark.parametrize("opset", [11, 22])
def test_conv_2d(attrs, opset):
    group = attrs.get("group", 1)
    x = rand(2, 4, 7, 8)
    w = rand(6, 4 // group, 3, 3, seed=1)
    check_op("Conv", {"x": x, "w": w, "b": rand(6, seed=2)}, opset=opset, **attrs, **TOL)


def test_conv_3d():
    x, w = rand(1, 2, 5, 6, 7), rand(4, 2, 3, 2, 3, seed=1)
    check_op("Conv", {"x": x, "w": w}, pads=[1, 0, 1, 1, 1, 0], strides=[1, 2, 2], **TOL)


def test_conv_whisper_stem():
    """Whisper's encoder stem: Conv1d(80 -> 16, k=3, pad=1) then stride 2."""
    x, w = rand(1, 80, 30), rand(16, 80, 3, seed=1)
    check_op("Conv", {"x": x, "w": w, "b": rand(16)}, constants=("w", "b"), pads=[1, 1], **TOL)
    check_op("Conv", {"x": x, "w": w}, pads=[1, 1], strides=[2], **TOL)


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"strides": [2]},
        {"strides": [3], "pads": [1, 2]},
        {"strides": [2], "output_padding": [1]},
        {"dilations": [2], "pads": [1, 1]},
        {"group": 2, "strides": [2]},
        {"strides": [2], "output_shape": [12]},
        {"strides": [2], "auto_pad": "SAME_UPPER"},
    ],
)
def test_conv_transpose_1d(attrs):
    group = attrs.get("group", 1)
    x, w = rand(2, 4, 5), rand(4, 6 // group, 3, seed=1)
    check_op("ConvTranspose", {"x": x, "w": w, "b": rand(6, seed=2)}, **attrs, **TOL)


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": [2, 2]},
        {"strides": [2, 1], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
        {"group": 2, "dilations": [1, 2]},
    ],
)
def test_conv_transpose_2d(attrs):
    group = attrs.get("group", 1)
    x, w = rand(1, 4, 4, 5), rand(4, 6 // group, 3, 2, seed=1)
    check_op("ConvTranspose", {"x": x, "w": w}, **attrs, **TOL)


# --- pooling --------------------------------------------------------------------------------

POOL_2D = [
    {"kernel_shape": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2]},
    {"kernel_shape": [3, 2], "pads": [1, 1, 1, 0], "strides": [2, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 3], "pads": [1, 1, 1, 1], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER", "strides": [2, 2]},
    {"kernel_shape": [3, 3], "auto_pad": "VALID", "strides": [2, 2]},
]


@pytest.mark.parametrize("attrs", [*POOL_2D, {"kernel_shape": [2, 2], "dilations": [2, 2]}])
def test_max_pool(attrs):
    check_op("MaxPool", {"x": rand(2, 3, 8, 9)}, **attrs)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("attrs", POOL_2D[:5])
def test_max_pool_indices(attrs, storage_order):
    check_op("MaxPool", {"x": rand(2, 3, 8, 9)}, ("y", "i"), storage_order=storage_order, **attrs)


def test_max_pool_1d_3d():
    check_op("MaxPool", {"x": rand(2, 3, 9)}, kernel_shape=[3], strides=[2], pads=[1, 1])
    check_op("MaxPool", {"x": rand(1, 2, 5, 6, 7)}, kernel_shape=[2, 2, 3], strides=[1, 2, 2])


def test_max_pool_int8():
    x = np.random.default_rng(0).integers(-128, 127, (1, 2, 6, 6)).astype(np.int8)
    check_op("MaxPool", {"x": x}, kernel_shape=[2, 2], strides=[2, 2], opset=12)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("attrs", POOL_2D)
def test_average_pool(attrs, count_include_pad):
    check_op("AveragePool", {"x": rand(2, 3, 8, 9)}, count_include_pad=count_include_pad, **attrs)


@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_1d_3d(count_include_pad):
    kw = {"count_include_pad": count_include_pad}
    check_op("AveragePool", {"x": rand(2, 3, 9)}, kernel_shape=[3], strides=[2], pads=[1, 1], **kw)
    check_op(
        "AveragePool",
        {"x": rand(1, 2, 5, 6, 7)},
        kernel_shape=[2, 2, 3],
        strides=[1, 2, 2],
        pads=[0, 1, 1, 1, 0, 1],
        **kw,
    )


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("attrs", POOL_2D[:3])
def test_lp_pool(attrs, p):
    check_op("LpPool", {"x": rand(2, 3, 8, 9)}, p=p, **attrs, **TOL)


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 3, 4, 5), (1, 2, 3, 4, 5)])
def test_global_pool(op_type, shape):
    check_op(op_type, {"x": rand(*shape)}, **TOL)


# --- normalization --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 5), (2, 3, 4, 5)])
@pytest.mark.parametrize("opset", [9, 14, 15])
def test_batch_normalization(shape, opset):
    c = shape[1]
    inputs = {
        "x": rand(*shape),
        "scale": rand(c, seed=1),
        "b": rand(c, seed=2),
        "mean": rand(c, seed=3),
        "var": np.abs(rand(c, seed=4)) + 0.5,
    }
    check_op("BatchNormalization", inputs, opset=opset, epsilon=1e-3, **TOL)


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5)])
def test_instance_normalization(shape):
    c = shape[1]
    inputs = {"x": rand(*shape), "scale": rand(c, seed=1), "b": rand(c, seed=2)}
    check_op("InstanceNormalization", inputs, epsilon=1e-4, **TOL)


@pytest.mark.parametrize("axis", [-1, -2, 1, 0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("outputs", [("y",), ("y", "mean", "inv_std")])
def test_layer_normalization(axis, bias, outputs):
    x = rand(2, 3, 4)
    norm_shape = x.shape[axis % 3 :]
    inputs = {"x": x, "scale": rand(*norm_shape, seed=1)}
    if bias:
        inputs["b"] = rand(*norm_shape, seed=2)
    check_op("LayerNormalization", inputs, outputs, axis=axis, epsilon=1e-3, opset=17, **TOL)


def test_layer_normalization_broadcast_scale():
    x = rand(2, 3, 8)
    inputs = {"x": x, "scale": rand(8, seed=1), "b": rand(8, seed=2)}
    check_op("LayerNormalization", inputs, constants=("scale", "b"), **TOL)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("shape,groups", [((2, 4, 5), 2), ((2, 6, 3, 4), 3), ((1, 4, 3), 4)])
def test_group_normalization(opset, shape, groups):
    per = groups if opset == 18 else shape[1]
    inputs = {"x": rand(*shape), "scale": rand(per, seed=1), "b": rand(per, seed=2)}
    check_op("GroupNormalization", inputs, num_groups=groups, epsilon=1e-3, opset=opset, **TOL)


@pytest.mark.parametrize("axis", [-1, -2, 1])
def test_rms_normalization(axis):
    x = rand(2, 3, 4)
    inputs = {"x": x, "scale": rand(*x.shape[axis % 3 :], seed=1)}
    check_op("RMSNormalization", inputs, axis=axis, epsilon=1e-3, opset=23, **TOL)


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("outputs", [("y",), ("y", "inv_std_var")])
def test_simplified_layer_normalization(axis, outputs):
    x = rand(2, 3, 4)
    inputs = {"x": x, "scale": rand(*x.shape[axis % 3 :], seed=1)}
    check_op("SimplifiedLayerNormalization", inputs, outputs, axis=axis, epsilon=1e-5, **TOL)


@pytest.mark.parametrize("size", [1, 3, 5])  # onnxruntime takes odd sizes only
def test_lrn(size):
    check_op("LRN", {"x": rand(2, 6, 3, 4)}, size=size, alpha=1e-3, beta=0.6, bias=2.0, **TOL)


@pytest.mark.parametrize("axes", [None, [1], [0, 1, 2, 3], [2, 3]])
def test_mean_variance_normalization(axes):
    kwargs = {} if axes is None else {"axes": axes}
    check_op("MeanVarianceNormalization", {"x": rand(2, 3, 4, 5)}, **kwargs, **TOL)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_normalization(p, axis):
    x = rand(3, 4, 5)
    x[0, 0] = 0
    check_op("LpNormalization", {"x": x}, p=p, axis=axis, **TOL)


# --- softmax --------------------------------------------------------------------------------


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
def test_softmax(op_type, opset, axis):
    kwargs = {} if axis is None else {"axis": axis}
    x = rand(2, 3, 4) * 10
    if op_type == "Hardmax":
        x[0, 0, :2] = 50  # ties keep the first
    check_op(op_type, {"x": x}, opset=opset, **kwargs, **TOL)


def test_softmax_large_values():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, 0.0, 1000.0]], np.float32)
    check_op("Softmax", {"x": x}, **TOL)
    check_op("LogSoftmax", {"x": x}, **TOL)


# --- dropout --------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [7, 10])
def test_dropout_ratio_attribute(opset):
    # onnxruntime fills the mask of these opsets with zeros; the spec's reference with ones.
    check_op("Dropout", {"x": rand(3, 4)}, opset=opset, ratio=0.3)


@pytest.mark.parametrize("outputs", [("y",), ("y", "mask")])
def test_dropout(outputs):
    check_op("Dropout", {"x": rand(3, 4)}, outputs, opset=13)


def test_dropout_inputs():
    inputs = {"x": rand(3, 4), "ratio": np.array(0.3, np.float32), "training_mode": None}
    check_op("Dropout", inputs, ("y", "mask"), constants=("ratio",))
    inputs["training_mode"] = np.array(False)
    check_op("Dropout", inputs, ("y", "mask"), constants=("ratio",))


# --- attention ------------------------------------------------------------------------------

ATTN_OUTPUTS = ("y", "present_key", "present_value")


@pytest.mark.parametrize("is_causal", [0, 1])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_4d(is_causal, kv_heads):
    q, k, v = rand(2, 4, 5, 8), rand(2, kv_heads, 5, 8, seed=1), rand(2, kv_heads, 5, 8, seed=2)
    check_op("Attention", {"q": q, "k": k, "v": v}, is_causal=is_causal, opset=23, **TOL)


@pytest.mark.parametrize("is_causal", [0, 1])
def test_attention_past(is_causal):
    q, k, v = rand(1, 4, 2, 8), rand(1, 2, 2, 8, seed=1), rand(1, 2, 2, 8, seed=2)
    past_k, past_v = rand(1, 2, 5, 8, seed=3), rand(1, 2, 5, 8, seed=4)
    inputs = {"q": q, "k": k, "v": v, "mask": None, "past_k": past_k, "past_v": past_v}
    check_op("Attention", inputs, ATTN_OUTPUTS, is_causal=is_causal, opset=23, **TOL)


@pytest.mark.parametrize("mask_kind", ["bool", "float", "float_2d"])
def test_attention_mask(mask_kind):
    q, k, v = rand(2, 2, 3, 4), rand(2, 2, 6, 4, seed=1), rand(2, 2, 6, 4, seed=2)
    rng = np.random.default_rng(0)
    if mask_kind.startswith("bool"):
        mask = rng.random((2, 1, 3, 6)) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = rng.standard_normal((2, 2, 3, 6)).astype(np.float32)
    else:
        mask = rng.standard_normal((3, 6)).astype(np.float32)
    check_op("Attention", {"q": q, "k": k, "v": v, "mask": mask}, opset=23, **TOL)


def test_attention_3d():
    q, k, v = rand(2, 5, 16), rand(2, 5, 8, seed=1), rand(2, 5, 12, seed=2)
    check_op(
        "Attention",
        {"q": q, "k": k, "v": v},
        ATTN_OUTPUTS,
        q_num_heads=4,
        kv_num_heads=2,
        is_causal=1,
        opset=23,
        **TOL,
    )


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_scale_softcap(mode):
    q, k, v = rand(1, 2, 3, 4) * 3, rand(1, 2, 4, 4, seed=1) * 3, rand(1, 2, 4, 4, seed=2)
    mask = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    check_op(
        "Attention",
        {"q": q, "k": k, "v": v, "mask": mask},
        (*ATTN_OUTPUTS, "qk"),
        scale=0.3,
        softcap=2.0,
        qk_matmul_output_mode=mode,
        opset=23,
        **TOL,
    )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_float16(kv_heads):
    """float16 inputs: computed in float32 and rounded once (the attention core's rule)."""
    q, k, v = (
        rand(2, 4, 5, 8).astype(np.float16),
        rand(2, kv_heads, 7, 8, seed=1).astype(np.float16),
        rand(2, kv_heads, 7, 8, seed=2).astype(np.float16),
    )
    check_op("Attention", {"q": q, "k": k, "v": v}, is_causal=1, opset=23, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("window", [(-1, -1), (2, 0), (1, 1)])
def test_attention_sliding_window(window):
    q, k, v = rand(1, 2, 6, 4), rand(1, 2, 6, 4, seed=1), rand(1, 2, 6, 4, seed=2)
    left, right = window
    check_op(
        "Attention",
        {"q": q, "k": k, "v": v},
        opset=25,
        left_window_size=left,
        right_window_size=right,
        **TOL,
    )


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_rotary_embedding_position_ids(interleaved, rotary_dim):
    x = rand(2, 3, 5, 8)
    half = (rotary_dim or 8) // 2
    angles = rand(16, half, seed=1)
    position_ids = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], np.int64)
    inputs = {"x": x, "cos": np.cos(angles), "sin": np.sin(angles), "pos": position_ids}
    check_op(
        "RotaryEmbedding",
        inputs,
        interleaved=interleaved,
        rotary_embedding_dim=rotary_dim,
        opset=23,
        **TOL,
    )


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_3d(interleaved):
    x = rand(2, 5, 24)
    angles = rand(2, 5, 4, seed=1)
    inputs = {"x": x, "cos": np.cos(angles), "sin": np.sin(angles)}
    check_op("RotaryEmbedding", inputs, interleaved=interleaved, num_heads=3, opset=23, **TOL)


def test_dropout_training_without_drop():
    inputs = {"x": rand(3, 4), "ratio": np.array(0.0, np.float32), "training_mode": np.array(True)}
    check_op("Dropout", inputs, ("y", "mask"), constants=("ratio",))
