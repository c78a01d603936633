"""Model.trace_last: the LM head of one position per row equals that row of the whole output."""

from __future__ import annotations

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import transmuter_jax as tj
from transmuter_jax import kernels

H, V = 8, 11


def _graph(tmp_path, tail: list[str]):
    """x [B, S, H] -> Relu -> MatMul by W [H, V] -> the ``tail`` ops -> logits."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((H, V)).astype(np.float32), "W")
    scale = numpy_helper.from_array(np.float32(0.5), "half")
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("MatMul", ["h", "W"], ["t0"]),
    ]
    for i, op in enumerate(tail):
        inputs = [f"t{i}", "half"] if op in ("Mul", "Div") else [f"t{i}"]
        attrs = {"axis": -1} if op == "Softmax" else {}
        nodes.append(helper.make_node(op, inputs, [f"t{i + 1}"], **attrs))
    nodes.append(helper.make_node("Identity", [f"t{len(tail)}"], ["logits"]))
    nodes.append(helper.make_node("Neg", ["h"], ["other"]))  # an output the head does not feed
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", H])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", V]),
            helper.make_tensor_value_info("other", TensorProto.FLOAT, ["b", "s", H]),
        ],
        [weight, scale],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return tj.load(path)


@pytest.mark.parametrize(
    ("tail", "head"),
    [([], True), (["Div", "Tanh", "Mul"], True), (["Softmax"], False), (["Mul", "Softmax"], False)],
)
def test_one_position_per_row_equals_that_row_of_the_whole_output(tmp_path, tail, head):
    model = _graph(tmp_path, tail)
    found = model.head("logits")
    assert (found is not None) == head
    if head:
        ops = [n.op_type for n in found[1]]
        assert found[0] == "h" and ops[0] in ("MatMul", "PackedMatMul")
        assert ops[1:] == [*tail, "Identity"]
    x = np.random.default_rng(1).standard_normal((3, 5, H)).astype(np.float32)
    last = np.array([4, 0, 2], np.int32)
    whole = jax.jit(lambda p, i: model.trace({}, p, i))(model.params, {"x": x})
    one = jax.jit(lambda p, i, l: model.trace_last({}, p, i, l))(model.params, {"x": x}, last)
    assert one["logits"].shape == (3, 1, V)
    expected = np.asarray(whole["logits"])[np.arange(3), last]
    np.testing.assert_allclose(np.asarray(one["logits"])[:, 0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(one["other"]), np.asarray(whole["other"]))


def _nbits_graph(tmp_path):
    """x [B, S, K] -> MatMulNBits (4-bit weights, blocks of 32, int8 activations) -> logits: an
    int4 LM head, as onnxruntime-genai's model builder exports it."""
    k, n, block = 64, 40, 32
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    scales = (rng.random(n * (k // block)) * 0.1 + 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits", ["x", "W", "S"], ["logits"], domain="com.microsoft",
        K=k, N=n, bits=4, block_size=block, accuracy_level=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", n])],
        [numpy_helper.from_array(packed, "W"), numpy_helper.from_array(scales, "S")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    path = tmp_path / "q.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets), path)
    return tj.load(path), k


def test_an_int4_head_runs_on_the_last_positions_only(tmp_path):
    """MatMulNBits (prepacked for the kernels or as stored) is an LM head: the prompt's logits
    come from its last positions only, equal to those rows of the whole output."""
    model, k = _nbits_graph(tmp_path)
    found = model.head("logits")
    assert found is not None and found[0] == "x"
    assert [n.op_type for n in found[1]] in (["MatMulNBits"], ["PackedMatMulNBits"])
    x = np.random.default_rng(4).standard_normal((2, 7, k)).astype(np.float32)
    last = np.array([6, 3], np.int32)
    whole = jax.jit(lambda p, i: model.trace({}, p, i))(model.params, {"x": x})
    one = jax.jit(lambda p, i, l: model.trace_last({}, p, i, l))(model.params, {"x": x}, last)
    expected = np.asarray(whole["logits"])[np.arange(2), last]
    np.testing.assert_array_equal(np.asarray(one["logits"])[:, 0], expected)


def _token_graph(tmp_path):
    """inputs_embeds [B, S, H] -> MatMul -> Relu -> MatMul -> logits and "present" (a cache's
    rows); pixels [B, P, H] -> MatMul -> "pooled" (another input's product); Gemm of the
    transposed tokens (its rows are not the tokens)."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("W1", (H, H)), ("W2", (H, V)), ("W3", (H, 4)), ("W4", (2, 3)))
    ]
    nodes = [
        helper.make_node("MatMul", ["inputs_embeds", "W1"], ["a"]),
        helper.make_node("Relu", ["a"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["logits"]),
        helper.make_node("Identity", ["a"], ["present"]),
        helper.make_node("MatMul", ["pixels", "W3"], ["pooled"]),
        helper.make_node("Gemm", ["pair", "W4"], ["swapped"], transA=1),
    ]
    float_info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "g",
        [
            float_info("inputs_embeds", TensorProto.FLOAT, ["b", "s", H]),
            float_info("pixels", TensorProto.FLOAT, ["b", "p", H]),
            float_info("pair", TensorProto.FLOAT, [2, 2]),
        ],
        [
            float_info("logits", TensorProto.FLOAT, ["b", "s", V]),
            float_info("present", TensorProto.FLOAT, ["b", "s", H]),
            float_info("pooled", TensorProto.FLOAT, ["b", "p", 4]),
            float_info("swapped", TensorProto.FLOAT, [2, 3]),
        ],
        weights,
    )
    path = tmp_path / "t.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return tj.load(path)


@pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels not available")
def test_the_tokens_after_each_rows_last_are_skipped_by_the_products_over_tokens(tmp_path):
    """The products that read the token input are marked and skip each row's tokens past
    ``last`` (copies of its last one); the logits at ``last`` and every other row equal the
    whole trace's; a product over another input keeps all its rows."""
    model = _token_graph(tmp_path)
    marked = {
        n.output[0]: any(a.name == "tokens" and a.i == 1 for a in n.attribute)
        for n in model.graph.proto.node
        if n.op_type.startswith("Packed")
    }
    assert marked == {"a": True, "logits": True, "pooled": False, "swapped": False}
    rng = np.random.default_rng(2)
    inputs = {
        "inputs_embeds": rng.standard_normal((3, 6, H)).astype(np.float32),
        "pixels": rng.standard_normal((3, 6, H)).astype(np.float32),
        "pair": rng.standard_normal((2, 2)).astype(np.float32),
    }
    last = np.array([5, 0, 2], np.int32)
    whole = jax.jit(lambda p, i: model.trace({}, p, i))(model.params, inputs)
    one = jax.jit(lambda p, i, l: model.trace_last({}, p, i, l))(model.params, inputs, last)
    rows = np.arange(3)
    np.testing.assert_array_equal(
        np.asarray(one["logits"])[:, 0], np.asarray(whole["logits"])[rows, last]
    )
    present, expected = np.asarray(one["present"]), np.asarray(whole["present"])
    for b, end in enumerate(last):
        np.testing.assert_array_equal(present[b, : end + 1], expected[b, : end + 1])
        pad = present[b, end + 1 :]
        np.testing.assert_array_equal(pad, np.broadcast_to(expected[b, end], pad.shape))
    for name in ("pooled", "swapped"):
        np.testing.assert_array_equal(np.asarray(one[name]), np.asarray(whole[name]))
