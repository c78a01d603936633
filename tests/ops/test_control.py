"""If and Loop against onnxruntime: static and traced conditions, trip counts, scan outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_cases import run_jax, run_ort

import transmuter_jax as tj

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, opset=21):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _same(model, feeds):
    want, got = run_ort(model, feeds), run_jax(model, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6)


def _branches():
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["t"])],
        "then",
        [],
        [helper.make_empty_tensor_value_info("t")],
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["e"])],
        "else",
        [],
        [helper.make_empty_tensor_value_info("e")],
    )
    return then, other


@pytest.mark.parametrize("opset", [11, 13, 16, 21])
@pytest.mark.parametrize("flag", [True, False])
def test_if_with_a_static_condition(opset, flag):
    then, other = _branches()
    model = _model(
        [helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other)],
        [
            helper.make_tensor_value_info("x", F, [4]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", F, [4])],
        opset,
    )
    _same(model, {"x": np.arange(4, dtype=np.float32), "flag": np.array(flag)})


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_with_a_condition_computed_from_values(sign):
    # The condition depends on all 16 values of x: it is traced, and If becomes lax.cond.
    then, other = _branches()
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["flag"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, [16])],
        [helper.make_tensor_value_info("y", F, [16])],
        [onnx.numpy_helper.from_array(np.array(0, np.float32), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    _same(model, {"x": sign * np.arange(1, 17, dtype=np.float32)})


def _loop_body(scan: bool):
    """carried: acc <- acc + i * x; scan output: acc (when ``scan``)."""
    nodes = [
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["fi", "x"], ["ix"]),
        helper.make_node("Add", ["acc_in", "ix"], ["acc_out"]),
    ]
    outputs = [
        helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("acc_out", F, [3]),
    ]
    if scan:
        nodes.append(helper.make_node("Identity", ["acc_out"], ["scan_out"]))
        outputs.append(helper.make_tensor_value_info("scan_out", F, [3]))
    return helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", F, [3]),
        ],
        outputs,
    )


@pytest.mark.parametrize("scan", [False, True])
def test_loop_with_a_static_trip_count(scan):
    outputs = ["acc"] + (["stacked"] if scan else [])
    model = _model(
        [helper.make_node("Loop", ["n", "cond", "acc0"], outputs, body=_loop_body(scan))],
        [
            helper.make_tensor_value_info("x", F, [3]),
            helper.make_tensor_value_info("acc0", F, [3]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
    )
    feeds = {
        "x": np.array([1, 2, 3], np.float32),
        "acc0": np.zeros(3, np.float32),
        "n": np.array(5, np.int64),
        "cond": np.array(True),
    }
    _same(model, feeds)


def test_loop_with_a_traced_trip_count_runs_as_a_while_loop(tmp_path):
    # The trip count is the sum of 16 values: it is traced, so the loop is a lax.while_loop.
    nodes = [
        helper.make_node("ReduceSum", ["counts"], ["n"], keepdims=0),
        helper.make_node("Loop", ["n", "", "acc0"], ["acc"], body=_loop_body(False)),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", F, [3]),
            helper.make_tensor_value_info("acc0", F, [3]),
            helper.make_tensor_value_info("counts", TensorProto.INT64, [16]),
        ],
        [helper.make_empty_tensor_value_info("acc")],
    )
    counts = np.zeros(16, np.int64)
    counts[:3] = [2, 1, 1]
    feeds = {"x": np.array([1, 2, 3], np.float32), "acc0": np.ones(3, np.float32), "counts": counts}
    _same(model, feeds)


def test_loop_with_traced_stops_and_scan_outputs_is_refused(tmp_path):
    nodes = [
        helper.make_node("ReduceSum", ["counts"], ["n"], keepdims=0),
        helper.make_node(
            "Loop", ["n", "", "acc0"], ["acc", "stacked"], body=_loop_body(True), name="the_loop"
        ),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", F, [3]),
            helper.make_tensor_value_info("acc0", F, [3]),
            helper.make_tensor_value_info("counts", TensorProto.INT64, [16]),
        ],
        [
            helper.make_empty_tensor_value_info("acc"),
            helper.make_empty_tensor_value_info("stacked"),
        ],
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    loaded = tj.load(path)
    feeds = {
        "x": np.ones(3, np.float32),
        "acc0": np.ones(3, np.float32),
        "counts": np.ones(16, np.int64),
    }
    with pytest.raises(tj.DynamicShapeError, match="the_loop"):
        loaded(feeds)
