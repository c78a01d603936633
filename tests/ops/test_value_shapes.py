"""Graphs whose shapes depend on the values of their inputs, against onnxruntime.

The nodes that decide those shapes run on the host from the concrete inputs; the rest is traced
and compiled once per resulting shape (see docs/tracer.md).
"""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_cases import assert_same, check_op

import transmuter_jax as tj
from transmuter_jax.onnx.errors import DynamicShapeError

rng = np.random.default_rng(0)
F = TensorProto.FLOAT


def model_of(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def loaded(model):
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "model.onnx")
    onnx.save(model, path)
    return tj.load(path)


def mask_rows(x, threshold=0.0):
    """x [N, 4]: the rows whose sum is above threshold (boolean indexing, as torch exports
    ``x[mask]``: NonZero, Transpose, GatherND)."""
    nodes = [
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "t"], ["mask"]),
        helper.make_node("NonZero", ["mask"], ["nz"]),
        helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
        helper.make_node("GatherND", ["x", "idx"], ["rows"]),
        helper.make_node("Mul", ["rows", "two"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.asarray([1], np.int64), "axes"),
        numpy_helper.from_array(np.asarray(threshold, np.float32), "t"),
        numpy_helper.from_array(np.asarray(2.0, np.float32), "two"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, ["n", 4])]
    outputs = [helper.make_tensor_value_info("y", F, None)]
    return model_of(nodes, inputs, outputs, inits)


@pytest.mark.parametrize(
    ("op_type", "inputs", "outputs"),
    [
        ("NonZero", {"x": rng.integers(0, 2, (3, 4)).astype(np.float32)}, ("y",)),
        ("Unique", {"x": rng.integers(0, 4, 12).astype(np.float32)}, ("y", "i", "v", "c")),
        (
            "Compress",
            {"x": rng.standard_normal((12, 2)).astype(np.float32), "c": rng.random(12) > 0.5},
            ("y",),
        ),
    ],
)
def test_one_node_on_inputs(op_type, inputs, outputs):
    check_op(op_type, inputs, outputs, opset=13)


def test_unique_on_input_along_axis_unsorted():
    x = rng.integers(0, 3, (6, 2)).astype(np.float32)
    check_op("Unique", {"x": x}, ("y", "i", "v", "c"), opset=11, axis=0, sorted=0)


def test_boolean_indexing_compiles_once_per_shape():
    model = mask_rows(None)
    jax_model = loaded(model)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    for feeds in ({"x": x}, {"x": -x}, {"x": x[::-1].copy()}, {"x": np.abs(x)}):
        assert_same(model, feeds)
        got = np.asarray(jax_model(feeds)["y"])
        assert got.shape[0] == int((feeds["x"].sum(1) > 0).sum())
    count = jax_model.compiled_count
    # The same number of kept rows is the same program, whichever rows they are.
    jax_model({"x": x[::-1].copy()})
    assert jax_model.compiled_count == count
    assert jax_model.host_split is not None
    assert "NonZero" in jax_model.host_split.label


def test_no_row_kept():
    model = mask_rows(None, threshold=1e9)
    assert_same(model, {"x": rng.standard_normal((5, 4)).astype(np.float32)})


def test_range_reshape_expand_topk_sized_by_data():
    """Range to the input's max, Expand to it, TopK with k from the data, Reshape by data."""
    nodes = [
        helper.make_node("ReduceMax", ["n"], ["m"], keepdims=0),
        helper.make_node("Range", ["zero", "m", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=F),
        helper.make_node("Concat", ["rows", "m1"], ["shape"], axis=0),
        helper.make_node("Expand", ["rf", "shape"], ["e"]),
        helper.make_node("Reshape", ["m", "one1"], ["k"]),
        helper.make_node("TopK", ["x", "k"], ["top", "ti"], axis=-1),
        helper.make_node("Reshape", ["e", "flat"], ["y"]),
        helper.make_node("Unsqueeze", ["m", "ax0"], ["m1"]),
    ]
    nodes = [nodes[i] for i in (0, 1, 2, 8, 3, 4, 5, 6, 7)]
    inits = [
        numpy_helper.from_array(np.asarray(0, np.int64), "zero"),
        numpy_helper.from_array(np.asarray(1, np.int64), "one"),
        numpy_helper.from_array(np.asarray([1], np.int64), "one1"),
        numpy_helper.from_array(np.asarray([3], np.int64), "rows"),
        numpy_helper.from_array(np.asarray([-1], np.int64), "flat"),
        numpy_helper.from_array(np.asarray([0], np.int64), "ax0"),
    ]
    inputs = [
        helper.make_tensor_value_info("n", TensorProto.INT64, [16]),
        helper.make_tensor_value_info("x", F, [2, 9]),
    ]
    outputs = [
        helper.make_tensor_value_info(name, F if name != "ti" else TensorProto.INT64, None)
        for name in ("y", "top", "ti")
    ]
    model = model_of(nodes, inputs, outputs, inits)
    x = rng.standard_normal((2, 9)).astype(np.float32)
    for top in (3, 7):
        n = rng.integers(1, top, 16).astype(np.int64)
        n[5] = top
        assert_same(model, {"n": n, "x": x})


def test_inside_a_loop_body_is_refused_by_name():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("NonZero", ["x"], ["nz"], name="inner_nonzero"),
            helper.make_node("ReduceSum", ["nz"], ["s"], keepdims=0),
            helper.make_node("Cast", ["s"], ["sf"], to=F),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("sf", F, []),
        ],
    )
    nodes = [helper.make_node("Loop", ["trips", "cond"], ["y"], body=body)]
    inits = [
        numpy_helper.from_array(np.asarray(3, np.int64), "trips"),
        numpy_helper.from_array(np.asarray(True), "cond"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [64])]
    model = model_of(nodes, inputs, [helper.make_tensor_value_info("y", F, None)], inits)
    with pytest.raises(DynamicShapeError, match="inner_nonzero"):
        loaded(model)({"x": rng.integers(0, 2, 64).astype(np.float32)})


def test_traced_inside_another_program_is_refused_by_name():
    """A program compiled around the model (a loop over tokens) cannot run the host part."""
    model = loaded(mask_rows(None))
    x = rng.standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(DynamicShapeError, match="NonZero.*retrace every step"):
        jax.jit(lambda v: model.trace({}, model.params, {"x": v}))(x)


def padding_frames_dropped():
    """SmolVLM's get_image_features pattern: pixel_values [batch, images, 3, 8, 8] flattened to
    frames, the all-zero (padding) frames dropped with NonZero + GatherND, then a patch
    embedding (Conv) of the real frames only: [real frames, 4 patches, 6]."""
    w = rng.standard_normal((6, 3, 4, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Reshape", ["pv", "frames"], ["flat"]),
        helper.make_node("Equal", ["flat", "zero"], ["is0"]),
        helper.make_node("Cast", ["is0"], ["is0i"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["is0i", "chw"], ["zeros"], keepdims=0),
        helper.make_node("Equal", ["zeros", "nb"], ["padding"]),
        helper.make_node("Not", ["padding"], ["real"]),
        helper.make_node("NonZero", ["real"], ["nz"], name="real_images_inds"),
        helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
        helper.make_node("GatherND", ["flat", "idx"], ["kept"]),
        helper.make_node("Conv", ["kept", "w"], ["patches"], strides=[4, 4]),
        helper.make_node("Reshape", ["patches", "tokens"], ["t"]),
        helper.make_node("Transpose", ["t"], ["image_features"], perm=[0, 2, 1]),
    ]
    inits = [
        numpy_helper.from_array(np.asarray([-1, 3, 8, 8], np.int64), "frames"),
        numpy_helper.from_array(np.asarray(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.asarray([1, 2, 3], np.int64), "chw"),
        numpy_helper.from_array(np.asarray(3 * 8 * 8, np.int64), "nb"),
        numpy_helper.from_array(np.asarray([0, 6, -1], np.int64), "tokens"),
        numpy_helper.from_array(w, "w"),
    ]
    inputs = [helper.make_tensor_value_info("pv", F, ["b", "n", 3, 8, 8])]
    outputs = [helper.make_tensor_value_info("image_features", F, None)]
    return model_of(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("padding", [(), (0,), (0, 1), (2,)])
def test_padding_frames_dropped(padding):
    """Single images and left-padded batches whose padding frames are all zeros."""
    model = padding_frames_dropped()
    pv = rng.standard_normal((2, 3, 3, 8, 8)).astype(np.float32)
    for frame in padding:  # the first frames of row 1: left padding
        pv[1, frame] = 0.0
    assert_same(model, {"pv": pv}, atol=1e-4)
    assert_same(model, {"pv": pv[:1, :1].copy()}, atol=1e-4)  # one image
