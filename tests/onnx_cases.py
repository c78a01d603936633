"""Builds one-node ONNX models and compares transmuter_jax with onnxruntime on them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

import transmuter_jax as tj

OPSETS = {"": 21, "com.microsoft": 1}


def node_model(
    op_type: str,
    inputs: Mapping[str, np.ndarray | None],
    outputs: Sequence[str] = ("y",),
    *,
    domain: str = "",
    opset: int = 21,
    constants: Sequence[str] = (),
    **attrs,
) -> onnx.ModelProto:
    """A model of one node. ``inputs`` in order (None = omitted optional input); the names in
    ``constants`` become initializers (known at trace time), the rest graph inputs."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    node = helper.make_node(op_type, names, list(outputs), domain=domain, **attrs)
    graph_inputs, inits = [], []
    for name, value in inputs.items():
        if value is None:
            continue
        if name in constants:
            inits.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, _elem(value), value.shape))
    graph_outputs = [helper.make_empty_tensor_value_info(o) for o in outputs if o]
    graph = helper.make_graph([node], "test", graph_inputs, graph_outputs, inits)
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _elem(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)


def run_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))


def run_jax(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.onnx")
        onnx.save(model, path)
        loaded = tj.load(path)
        out = loaded(feeds)
    return {k: np.asarray(v) for k, v in out.items()}


def assert_same(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    """transmuter_jax and onnxruntime give the same outputs (values, shapes, dtype kinds)."""
    want = run_ort(model, feeds)
    got = run_jax(model, feeds)
    assert set(got) == set(want)
    for name, expected in want.items():
        actual = got[name]
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        assert actual.dtype.kind == expected.dtype.kind, (name, actual.dtype, expected.dtype)
        if expected.dtype.kind in "fc":
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(actual, expected.astype(actual.dtype), err_msg=name)


def check_op(
    op_type: str,
    inputs: Mapping[str, np.ndarray | None],
    outputs=("y",),
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    **kwargs,
) -> None:
    """Builds the one-node model and asserts transmuter_jax matches onnxruntime on it."""
    model = node_model(op_type, inputs, outputs, **kwargs)
    constants = kwargs.get("constants", ())
    feeds = {k: v for k, v in inputs.items() if v is not None and k not in constants}
    assert_same(model, feeds, rtol=rtol, atol=atol)
