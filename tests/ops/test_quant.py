"""Quantization ops against onnxruntime CPU."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op, node_model, run_jax, run_ort

MS = "com.microsoft"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---------------------------------------------------------------- MatMulNBits


def _nbits_inputs(rng, k, n, block, bits, zero_points):
    """Random packed weights for MatMulNBits: b, scales and (optionally) zero points."""
    blocks = -(-k // block)
    per_byte = 8 // bits
    b = rng.integers(0, 256, (n, blocks, block // per_byte), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.1 + 0.01).astype(np.float32)
    zp = None
    if zero_points == "packed":
        zp = rng.integers(0, 256, (n, -(-blocks * bits // 8)), dtype=np.uint8)
    elif zero_points == "float":
        zp = (rng.random((n, blocks), dtype=np.float32) * 15).astype(np.float32)
    return b, scales, zp


def _check_nbits(inputs, k, n, block, *, constants=("b", "scales", "zp"), bits=4):
    """MatMulNBits against onnxruntime, the weights as initializers."""
    check_op(
        "MatMulNBits",
        inputs,
        domain=MS,
        constants=constants,
        rtol=1e-4,
        atol=1e-4,
        K=k,
        N=n,
        block_size=block,
        bits=bits,
    )


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("width", [32, 96])
def test_matmul_nbits_input_of_another_k_is_refused_at_trace_time(rng, accuracy_level, width):
    """A of another width than K is the graph's error, named when traced (the int4 kernel would
    refuse it only when run, as a bare runtime error)."""
    from transmuter_jax.onnx.errors import GraphError

    b, scales, _ = _nbits_inputs(rng, 64, 16, 32, 4, None)
    a = rng.standard_normal((2, width)).astype(np.float32)
    model = node_model(
        "MatMulNBits",
        {"a": a, "b": b, "scales": scales},
        ("y",),
        domain=MS,
        constants=("b", "scales"),
        K=64,
        N=16,
        block_size=32,
        bits=4,
        accuracy_level=accuracy_level,
    )
    with pytest.raises(GraphError, match=f"input A has {width} values per row, not K = 64"):
        run_jax(model, {"a": a})


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize("m", [1, 5])
def test_matmul_nbits(rng, block, zero_points, m):
    k, n = 128, 24
    b, scales, zp = _nbits_inputs(rng, k, n, block, 4, zero_points)
    inputs = {
        "a": rng.standard_normal((m, k)).astype(np.float32),
        "b": b,
        "scales": scales,
        "zp": zp,
    }
    _check_nbits(inputs, k, n, block)


@pytest.mark.parametrize("zero_points", [None, "packed", "float"])
def test_matmul_nbits_batch_ragged_k_bias(rng, zero_points):
    k, n, block = 72, 10, 32  # K is not a multiple of the block size
    b, scales, zp = _nbits_inputs(rng, k, n, block, 4, zero_points)
    inputs = {
        "a": rng.standard_normal((2, 3, k)).astype(np.float32),
        "b": b,
        "scales": scales.reshape(-1),
        "zp": zp,
        "g_idx": None,
        "bias": rng.standard_normal(n).astype(np.float32),
    }
    _check_nbits(inputs, k, n, block, constants=("b", "scales", "zp", "bias"))


@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("zero_points", [None, "packed"])
def test_matmul_nbits_other_bits(rng, bits, zero_points):
    k, n, block = 64, 8, 32
    b, scales, zp = _nbits_inputs(rng, k, n, block, bits, zero_points)
    scales = scales / (1 << (bits - 2))
    inputs = {
        "a": rng.standard_normal((3, k)).astype(np.float32),
        "b": b,
        "scales": scales,
        "zp": zp,
    }
    _check_nbits(inputs, k, n, block, bits=bits)


def test_matmul_nbits_weights_as_inputs(rng):
    k, n, block = 64, 8, 16
    b, scales, zp = _nbits_inputs(rng, k, n, block, 4, "packed")
    inputs = {
        "a": rng.standard_normal((2, k)).astype(np.float32),
        "b": b,
        "scales": scales,
        "zp": zp,
    }
    check_op("MatMulNBits", inputs, domain=MS, rtol=1e-4, atol=1e-4, K=k, N=n, block_size=block)


def _check_level_4(rng, m, block, zero_points, atol):
    """MatMulNBits at accuracy_level 4 on a [m, 256] input and 48 outputs against onnxruntime,
    the weights as initializers."""
    k, n = 256, 48
    b, scales, zp = _nbits_inputs(rng, k, n, block, 4, zero_points)
    inputs = {"a": rng.standard_normal((m, k)).astype(np.float32), "b": b, "scales": scales}
    inputs["zp"] = zp
    check_op(
        "MatMulNBits",
        inputs,
        domain=MS,
        constants=("b", "scales", "zp"),
        rtol=1e-5,
        atol=atol,
        K=k,
        N=n,
        block_size=block,
        accuracy_level=4,
    )


@pytest.mark.parametrize(
    ("block", "zero_points"), [(16, None), (32, None), (32, "packed"), (128, "packed")]
)
@pytest.mark.parametrize("m", [1, 5, 200])
def test_matmul_nbits_accuracy_level_4(rng, block, zero_points, m):
    """accuracy_level 4: the input quantized to int8 per row and block, as onnxruntime does."""
    _check_level_4(rng, m, block, zero_points, atol=2e-5)


def test_matmul_nbits_accuracy_level_4_float_zero_points(rng):
    """With float zero points onnxruntime dequantizes exactly at level 4, and so do we."""
    _check_level_4(rng, 3, 32, "float", atol=1e-4)


def test_matmul_nbits_accuracy_level_4_exact_when_asked(rng, monkeypatch):
    """TRANSMUTER_JAX_NBITS_INT8=0: level 4 dequantizes exactly, as onnxruntime does at level 0."""
    from transmuter_jax.onnx.ops.quant import INT8_ENV

    monkeypatch.setenv(INT8_ENV, "0")
    k, n, block = 128, 16, 32
    b, scales, _ = _nbits_inputs(rng, k, n, block, 4, None)
    inputs = {"a": rng.standard_normal((4, k)).astype(np.float32), "b": b, "scales": scales}
    options = dict(domain=MS, constants=("b", "scales"), K=k, N=n, block_size=block)
    feeds = {"a": inputs["a"]}
    ours = run_jax(node_model("MatMulNBits", inputs, ("y",), accuracy_level=4, **options), feeds)
    exact = run_ort(node_model("MatMulNBits", inputs, ("y",), accuracy_level=0, **options), feeds)
    int8 = run_ort(node_model("MatMulNBits", inputs, ("y",), accuracy_level=4, **options), feeds)
    np.testing.assert_allclose(ours["y"], exact["y"], rtol=1e-5, atol=1e-4)
    assert np.abs(int8["y"] - exact["y"]).max() > 1e-3  # the setting matters


# ---------------------------------------------------------------- GatherBlockQuantized


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("block", [16, 32])
def test_gather_block_quantized_uint8(rng, zero_points, block):
    vocab, hidden = 20, 64
    blocks = hidden // block
    inputs = {
        "data": rng.integers(0, 256, (vocab, hidden // 2), dtype=np.uint8),
        "indices": np.asarray([[3, 0, 19], [7, -1, 5]], np.int64),
        "scales": rng.random((vocab, blocks), dtype=np.float32),
        "zero_points": (
            rng.integers(0, 256, (vocab, -(-blocks // 2)), dtype=np.uint8) if zero_points else None
        ),
    }
    check_op(
        "GatherBlockQuantized",
        inputs,
        domain=MS,
        constants=("data", "scales", "zero_points"),
        block_size=block,
        bits=4,
        gather_axis=0,
        quantize_axis=1,
    )


@pytest.mark.parametrize("zero_points", [False, True])
def test_gather_block_quantized_unpacks_only_the_gathered_rows(rng, zero_points):
    # a tied int4 embedding is the lm_head's weight: unpacking all of it as int32 each step
    # held ~110 MB more at the default int4 model's decode peak
    import jax

    from transmuter_jax.onnx.ops.quant import GatherBlockQuantized

    vocab, hidden = 4096, 64
    data = rng.integers(0, 256, (vocab, hidden // 2), dtype=np.uint8)
    scales = rng.random((vocab, 2), dtype=np.float32)
    zp = rng.integers(0, 256, (vocab, 1), dtype=np.uint8) if zero_points else None
    indices = np.asarray([[5, 4095]], np.int64)

    def gather(data, indices, scales, zp):
        return GatherBlockQuantized(data, indices, scales, zp, bits=4, block_size=32)

    jaxpr = jax.make_jaxpr(gather)(data, indices, scales, zp)
    sizes = [v.aval.size for e in jaxpr.eqns for v in e.outvars]
    assert max(sizes) < data.size  # nothing as large as the table, let alone 2 values a byte


def test_gather_block_quantized_uint8_8bit(rng):
    inputs = {
        "data": rng.integers(0, 256, (10, 32), dtype=np.uint8),
        "indices": np.asarray([1, 9, 4], np.int32),
        "scales": rng.random((10, 2), dtype=np.float32),
    }
    check_op(
        "GatherBlockQuantized",
        inputs,
        domain=MS,
        constants=("data", "scales"),
        block_size=16,
        bits=8,
    )


# ---------------------------------------------------------------- standard quantization ops


def test_dequantize_linear_per_tensor(rng):
    x = rng.integers(0, 256, (3, 4), dtype=np.uint8)
    inputs = {"x": x, "s": np.asarray(0.3, np.float32), "zp": np.asarray(100, np.uint8)}
    check_op("DequantizeLinear", inputs)
    check_op("DequantizeLinear", inputs, opset=13)
    check_op("DequantizeLinear", {"x": x, "s": np.asarray(0.3, np.float32)}, opset=10)


def test_dequantize_linear_per_axis(rng):
    x = rng.integers(-128, 128, (2, 3, 4), dtype=np.int8)
    inputs = {"x": x, "s": rng.random(3, dtype=np.float32), "zp": np.asarray([1, -2, 3], np.int8)}
    check_op("DequantizeLinear", inputs, opset=13, axis=1)
    inputs = {
        "x": x,
        "s": rng.random(4, dtype=np.float32),
        "zp": np.asarray([1, -2, 3, 0], np.int8),
    }
    check_op("DequantizeLinear", inputs, axis=-1)


def test_dequantize_linear_blocked(rng):
    x = rng.integers(0, 256, (4, 10), dtype=np.uint8)
    inputs = {
        "x": x,
        "s": rng.random((4, 3), dtype=np.float32),
        "zp": rng.integers(0, 256, (4, 3), dtype=np.uint8),
    }
    check_op("DequantizeLinear", inputs, axis=1, block_size=4)


def test_dequantize_linear_fp16_scale(rng):
    x = rng.integers(0, 256, (3, 4), dtype=np.uint8)
    inputs = {"x": x, "s": np.asarray(0.25, np.float16), "zp": np.asarray(7, np.uint8)}
    check_op("DequantizeLinear", inputs, opset=19)


def test_dequantize_linear_ms(rng):
    x = rng.integers(0, 256, (3, 4), dtype=np.uint8)
    inputs = {"x": x, "s": np.asarray(0.3, np.float32), "zp": np.asarray(100, np.uint8)}
    check_op("DequantizeLinear", inputs, domain=MS)


def test_quantize_linear(rng):
    x = (rng.standard_normal((3, 8)) * 40).astype(np.float32)
    x[0, :4] = [0.5, 1.5, 2.5, -0.5]  # ties round to even
    check_op("QuantizeLinear", {"x": x, "s": np.asarray(1.0, np.float32)}, opset=10)
    inputs = {"x": x, "s": np.asarray(0.7, np.float32), "zp": np.asarray(-3, np.int8)}
    check_op("QuantizeLinear", inputs, opset=13)
    inputs = {"x": x, "s": rng.random(3, dtype=np.float32), "zp": np.asarray([0, 5, 250], np.uint8)}
    check_op("QuantizeLinear", inputs, opset=13, axis=0)
    inputs = {
        "x": x,
        "s": rng.random((3, 2), dtype=np.float32),
        "zp": rng.integers(0, 256, (3, 2), dtype=np.uint8),
    }
    check_op("QuantizeLinear", inputs, axis=1, block_size=4)
    inputs = {"x": x, "s": np.asarray(0.7, np.float32), "zp": np.asarray(30, np.uint16)}
    check_op("QuantizeLinear", inputs, opset=21)


def test_quantize_linear_ms(rng):
    x = (rng.standard_normal((3, 8)) * 40).astype(np.float32)
    inputs = {"x": x, "s": np.asarray(0.7, np.float32), "zp": np.asarray(128, np.uint8)}
    check_op("QuantizeLinear", inputs, domain=MS)


def test_dynamic_quantize_linear(rng):
    x = (rng.standard_normal((4, 6)) * 3).astype(np.float32)
    check_op("DynamicQuantizeLinear", {"x": x}, ("y", "scale", "zp"))
    check_op("DynamicQuantizeLinear", {"x": np.abs(x) + 1}, ("y", "scale", "zp"))


@pytest.mark.parametrize("per_column", [False, True])
def test_qlinear_matmul(rng, per_column):
    n = 5
    inputs = {
        "a": rng.integers(0, 256, (2, 3, 4), dtype=np.uint8),
        "a_scale": np.asarray(0.05, np.float32),
        "a_zp": np.asarray(120, np.uint8),
        "b": rng.integers(0, 256, (4, n), dtype=np.uint8),
        "b_scale": rng.random(n, dtype=np.float32) * 0.1
        if per_column
        else np.asarray(0.03, np.float32),
        "b_zp": rng.integers(0, 256, n, dtype=np.uint8)
        if per_column
        else np.asarray(130, np.uint8),
        "y_scale": np.asarray(0.2, np.float32),
        "y_zp": np.asarray(128, np.uint8),
    }
    check_op("QLinearMatMul", inputs, opset=21)


def test_gather_block_quantized_out_of_range(rng):
    # onnxruntime gives zero rows; this engine refuses indices outside the table on the host
    import transmuter_jax as tj

    inputs = {
        "data": rng.integers(0, 256, (6, 16), dtype=np.uint8),
        "indices": np.asarray([1, 6, -7, 2], np.int64),
        "scales": rng.random((6, 2), dtype=np.float32),
    }
    with pytest.raises(tj.InputError, match="outside the 6 rows of the table"):
        check_op(
            "GatherBlockQuantized", inputs, domain=MS, constants=("data", "scales"), block_size=16
        )


@pytest.mark.parametrize("gather_axis,quantize_axis", [(0, 1), (1, 0), (1, 1)])
def test_gather_block_quantized_int4(rng, gather_axis, quantize_axis):
    import ml_dtypes

    shape = (32, 48)
    scale_shape = list(shape)
    scale_shape[quantize_axis] //= 16
    inputs = {
        "data": rng.integers(-8, 8, shape).astype(ml_dtypes.int4),
        "indices": np.asarray([[0, 5], [31, 2]], np.int64),
        "scales": rng.random(scale_shape, dtype=np.float32),
        "zero_points": rng.integers(-8, 8, scale_shape).astype(ml_dtypes.int4),
    }
    check_op(
        "GatherBlockQuantized",
        inputs,
        domain=MS,
        constants=("data", "scales", "zero_points"),
        block_size=16,
        gather_axis=gather_axis,
        quantize_axis=quantize_axis,
    )
