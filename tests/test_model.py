"""load() and Model: signatures, compile cache, pruning, static inputs and clear errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_cases import run_ort

import transmuter_jax as tj
from transmuter_jax import kernels


def _save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, path)
    return str(path)


def _graph_model(nodes, inputs, outputs, inits=(), opset=21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


@pytest.fixture
def linear(tmp_path):
    """y = reshape(x, (batch, -1)) @ W + (1 or -1 by the flag); z = y * 2."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((12, 5)).astype(np.float32)
    then = helper.make_graph(
        [helper.make_node("Add", ["y0", "one"], ["t"])],
        "then",
        [],
        [helper.make_empty_tensor_value_info("t")],
    )
    other = helper.make_graph(
        [helper.make_node("Sub", ["y0", "one"], ["e"])],
        "else",
        [],
        [helper.make_empty_tensor_value_info("e")],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"]),
        helper.make_node("Concat", ["b", "minus_one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["y0"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other),
        helper.make_node("Add", ["y", "y"], ["z"]),
    ]
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.ones(5, np.float32), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    model = _graph_model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, [1]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 5]),
        ],
        inits,
    )
    return model, _save(model, tmp_path / "linear.onnx")


def test_signature_and_outputs_match_onnxruntime(linear):
    proto, path = linear
    model = tj.load(path)
    assert model.inputs == [
        tj.ValueInfo("x", "float32", ("batch", 3, 4)),
        tj.ValueInfo("flag", "bool", (1,)),
    ]
    assert [o.name for o in model.outputs] == ["y", "z"]
    assert model.static_inputs == ("flag",)
    rng = np.random.default_rng(1)
    for flag in (True, False):
        feeds = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32), "flag": np.array([flag])}
        want = run_ort(proto, feeds)
        got = model(feeds)
        for name in ("y", "z"):
            np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-5, atol=1e-5)


def test_compiled_once_per_signature(linear):
    _, path = linear
    model = tj.load(path)
    x = np.zeros((2, 3, 4), np.float32)
    model({"x": x, "flag": np.array([True])})
    model({"x": x + 1, "flag": np.array([True])})
    assert model.compiled_count == 1
    model({"x": np.zeros((3, 3, 4), np.float32), "flag": np.array([True])})
    model({"x": x, "flag": np.array([False])})
    assert model.compiled_count == 3
    assert all(s.trace_s >= 0 and s.compile_s > 0 for s in model.compile_stats)


def test_weights_are_arguments_not_constants(linear):
    _, path = linear
    model = tj.load(path)
    assert list(model.params) == ["W"]
    assert len(model.graph.proto.initializer) == 0
    x = np.ones((1, 3, 4), np.float32)
    before = np.asarray(model({"x": x, "flag": np.array([True])})["y"])
    # A new weight value changes the result without recompiling: it is an argument.
    model.params["W"] = model.params["W"] * 2
    after = np.asarray(model({"x": x, "flag": np.array([True])})["y"])
    np.testing.assert_allclose(after - 1, (before - 1) * 2, rtol=1e-5)
    assert model.compiled_count == 1


def test_outputs_prunes_the_graph(linear):
    _, path = linear
    model = tj.load(path, outputs=["y"])
    assert [o.name for o in model.outputs] == ["y"]
    # on a CPU with the kernels, the product of the weight is packed for them (docs/kernels.md)
    product = ("transmuter_jax", "PackedMatMul") if kernels.enabled() else ("", "MatMul")
    assert model.op_types == {("", op) for op in ("Shape", "Gather", "Concat", "Reshape", "If")} | {
        product
    }
    out = model({"x": np.zeros((1, 3, 4), np.float32), "flag": np.array([True])})
    assert set(out) == {"y"}
    with pytest.raises(ValueError, match="no outputs"):
        tj.load(path, outputs=["nope"])


def test_pruning_drops_unneeded_nodes(tmp_path):
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["a"]),
        helper.make_node("Add", ["x", "x"], ["b"]),
    ]
    proto = _graph_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2]),
        ],
    )
    model = tj.load(_save(proto, tmp_path / "m.onnx"), outputs=["b"])
    assert model.op_types == {("", "Add")}


def test_input_errors_name_the_input(linear):
    _, path = linear
    model = tj.load(path)
    with pytest.raises(tj.InputError, match=r"missing input 'x'.*\(batch, 3, 4\)"):
        model({"flag": np.array([True])})
    with pytest.raises(tj.InputError, match=r"'x'.*shape \(batch, 3, 4\), got \(2, 3, 5\)"):
        model({"x": np.zeros((2, 3, 5), np.float32), "flag": np.array([True])})
    with pytest.raises(tj.InputError, match=r"'x' .*must be float32.*got int32"):
        model({"x": np.zeros((2, 3, 4), np.int32), "flag": np.array([True])})
    with pytest.raises(tj.InputError, match="no inputs"):
        model({"x": np.zeros((2, 3, 4), np.float32), "flag": np.array([True]), "q": 1})


def test_int64_inputs_run_as_int32(tmp_path):
    proto = _graph_model(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])],
    )
    model = tj.load(_save(proto, tmp_path / "m.onnx"))
    out = model({"x": np.array([1, 2, 3], np.int64)})["y"]
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [2, 4, 6])
    with pytest.raises(tj.InputError, match="overflow"):
        model({"x": np.array([2**40], np.int64)})


def test_unsupported_op_names_op_domain_node_and_file(tmp_path):
    proto = _graph_model(
        [helper.make_node("FancyOp", ["x"], ["y"], name="the_node", domain="my.domain")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    proto.opset_import.append(helper.make_opsetid("my.domain", 1))
    path = _save(proto, tmp_path / "fancy.onnx")
    with pytest.raises(tj.UnsupportedOpError) as error:
        tj.load(path)
    for part in ("FancyOp", "my.domain", "the_node", "fancy.onnx"):
        assert part in str(error.value)


def test_corrupt_and_truncated_files_give_clear_errors(tmp_path, linear):
    _, path = linear
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff\x00 not a model" * 50)
    for bad in (truncated, garbage):
        with pytest.raises(tj.ModelFileError, match="not a readable ONNX model"):
            tj.load(bad)
    with pytest.raises(tj.ModelFileError, match="no ONNX file"):
        tj.load(tmp_path / "missing.onnx")


def _external_model(tmp_path, location: str) -> str:
    w = np.arange(100, dtype=np.float32)
    tensor = numpy_helper.from_array(w, "W")
    proto = _graph_model(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [100])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [100])],
        [tensor],
    )
    onnx.external_data_helper.convert_model_to_external_data(
        proto, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0
    )
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(proto, path)
    if location != "weights.bin":
        for init in proto.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(proto, path)
    return str(path)


def test_external_data_loads(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    model = tj.load(path)
    out = model({"x": np.ones(100, np.float32)})["y"]
    np.testing.assert_array_equal(out, np.arange(100) + 1)


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../x.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path, location):
    path = _external_model(tmp_path, location)
    with pytest.raises(tj.ModelFileError, match="outside the model's folder"):
        tj.load(path)


def test_truncated_external_data_is_refused(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    weights = tmp_path / "model" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(tj.ModelFileError, match="truncated"):
        tj.load(path)


def test_value_dependent_shape_runs_on_the_host(tmp_path):
    # Reshape to a shape read from a large input's values: the shape is computed on the host.
    proto = _graph_model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape_by_value")],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [16]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = tj.load(_save(proto, tmp_path / "m.onnx"))
    assert "reshape_by_value" in model.host_split.label
    out = model({"x": np.full(1, 3.0, np.float32), "shape": np.ones(16, np.int64)})
    assert out["y"].shape == (1,) * 16 and float(out["y"].reshape(())) == 3.0
    with pytest.raises(tj.GraphError, match="reshape_by_value"):
        model({"x": np.zeros(1, np.float32), "shape": np.full(16, 2, np.int64)})


def test_small_shape_input_becomes_a_compile_time_input(tmp_path):
    proto = _graph_model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [12]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = tj.load(_save(proto, tmp_path / "m.onnx"))
    assert model.static_inputs == ("shape",)
    x = np.arange(12, dtype=np.float32)
    assert model({"x": x, "shape": np.array([3, 4])})["y"].shape == (3, 4)
    assert model({"x": x, "shape": np.array([2, 6])})["y"].shape == (2, 6)


def test_large_folded_values_are_computed_in_the_program(tmp_path):
    # ConstantOfShape(Shape(x)) is known at trace time, but 512 x 512 values are too many to
    # embed in the compiled program: the traced function has no constant that large.
    import jax

    from transmuter_jax.onnx.trace import FOLD_LIMIT

    proto = _graph_model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node(
                "ConstantOfShape",
                ["s"],
                ["c"],
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [2.0]),
            ),
            helper.make_node("Mul", ["x", "c"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, 512])],
    )
    model = tj.load(_save(proto, tmp_path / "m.onnx"))
    x = np.ones((512, 512), np.float32)
    np.testing.assert_array_equal(model({"x": x})["y"], 2 * x)
    jaxpr = jax.make_jaxpr(lambda p, i: model.trace({}, p, i))(model.params, {"x": x})
    assert max((np.size(c) for c in jaxpr.consts), default=0) <= FOLD_LIMIT
