"""Model.trace_last: the LM head of one position per row equals that row of the whole output."""

from __future__ import annotations

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import transmuter_jax as tj

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
