"""Weights packed at load are kept on disk, one file a model, and memory-mapped by later loads
(transmuter_jax.onnx.packed_store): used when valid, packed again when damaged or when the
data file changed, and not kept when the store is off."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import transmuter_jax as tj
from transmuter_jax import kernels
from transmuter_jax.onnx import packed_store, prepack

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels not available")


def _model(tmp_path, rng, scale: float = 1.0):
    """x [2, 64] @ w [64, 96] with w in an external data file."""
    w = (rng.standard_normal((64, 96)) * scale).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 96])],
        [numpy_helper.from_array(w, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "model.onnx"
    onnx.save(proto, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path, w


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def store(tmp_path, monkeypatch):
    from transmuter_jax.runtime import compile_cache

    cache = str(tmp_path / "cache")
    monkeypatch.setattr(compile_cache, "configure", lambda: cache)
    monkeypatch.setattr(compile_cache, "directory", lambda: cache)
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    monkeypatch.delenv(packed_store.ENV, raising=False)
    return tmp_path / "cache" / "packed"


def _no_packing(monkeypatch):
    def refuse(self, array):
        raise AssertionError("packed again instead of read from the store")

    monkeypatch.setattr(prepack.Packing, "pack", refuse)


@needs_kernels
def test_packed_weights_are_stored_then_mapped(tmp_path, rng, store, monkeypatch):
    path, w = _model(tmp_path, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    first = np.asarray(tj.load(path)({"x": x})["y"])
    files = list(store.glob("*.pack"))
    assert len(files) == 1
    np.testing.assert_allclose(first, x @ w, rtol=1e-5, atol=1e-4)
    with monkeypatch.context() as patch:
        _no_packing(patch)
        model = tj.load(path)
        np.testing.assert_array_equal(np.asarray(model({"x": x})["y"]), first)
    assert list(store.glob("*.pack")) == files


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "garbage", "other shape"])
def test_a_damaged_stored_file_is_packed_again(tmp_path, rng, store, damage, monkeypatch):
    path, w = _model(tmp_path, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    want = np.asarray(tj.load(path)({"x": x})["y"])
    (file,) = store.glob("*.pack")
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-200])
    elif damage == "garbage":
        file.write_bytes(b"\x00" * 1000)
    else:  # a header that lists another shape
        data = file.read_bytes()
        size = int.from_bytes(data[len(packed_store.MAGIC) :][:8], "little")
        start = len(packed_store.MAGIC) + 8
        index = json.loads(data[start : start + size])
        index[0][2][0] += 1
        text = json.dumps(index).encode()
        file.write_bytes(packed_store.MAGIC + len(text).to_bytes(8, "little") + text + data[-4096:])
    np.testing.assert_array_equal(np.asarray(tj.load(path)({"x": x})["y"]), want)
    with monkeypatch.context() as patch:  # replaced by a whole file, read without packing
        _no_packing(patch)
        np.testing.assert_array_equal(np.asarray(tj.load(path)({"x": x})["y"]), want)


@needs_kernels
def test_changed_weights_are_not_read_from_the_store(tmp_path, rng, store):
    path, _ = _model(tmp_path, rng)
    tj.load(path)
    path, w = _model(tmp_path, rng, scale=2.0)  # the same file names, other bytes
    x = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(tj.load(path)({"x": x})["y"]), x @ w, rtol=1e-5, atol=1e-4
    )
    assert len(list(store.glob("*.pack"))) == 2


@needs_kernels
def test_store_off(tmp_path, rng, store, monkeypatch):
    monkeypatch.setenv(packed_store.ENV, "0")
    path, w = _model(tmp_path, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(tj.load(path)({"x": x})["y"]), x @ w, rtol=1e-5, atol=1e-4
    )
    assert not store.exists()


def _three_products(tmp_path, rng, inline_scale: float = 1.0):
    """x @ w1 @ w2 @ w3, w1 and w2 in an external data file, w3 inside the .onnx file."""
    w1 = rng.standard_normal((64, 96)).astype(np.float32)
    w2 = rng.standard_normal((96, 32)).astype(np.float32)
    w3 = (rng.standard_normal((32, 2)) * inline_scale).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("MatMul", ["h", "w2"], ["g"]),
            helper.make_node("MatMul", ["g", "w3"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "model.onnx"
    onnx.save(proto, path, save_as_external_data=True, location="d.bin", size_threshold=1024)
    return path, w1 @ w2 @ w3


@needs_kernels
def test_a_models_weights_inline_ones_too_share_one_file(tmp_path, rng, store, monkeypatch):
    path, product = _three_products(tmp_path, rng)
    store.mkdir(parents=True)
    (store / "old.npy").write_bytes(b"left by an earlier version")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    want = np.asarray(tj.load(path)({"x": x})["y"])
    np.testing.assert_allclose(want, x @ product, rtol=1e-4, atol=1e-3)
    assert [p.suffix for p in store.iterdir()] == [".pack"]  # one file; the old one gone
    with monkeypatch.context() as patch:
        _no_packing(patch)
        np.testing.assert_array_equal(np.asarray(tj.load(path)({"x": x})["y"]), want)
    # The .onnx file alone rewritten with another inline weight: packed again, not read.
    proto = onnx.load(path, load_external_data=False)
    w3 = numpy_helper.to_array(proto.graph.initializer[2]) * 3.0
    proto.graph.initializer[2].CopyFrom(numpy_helper.from_array(w3, "w3"))
    onnx.save(proto, path)
    np.testing.assert_allclose(
        np.asarray(tj.load(path)({"x": x})["y"]), want * 3.0, rtol=1e-4, atol=1e-3
    )
    assert len(list(store.glob("*.pack"))) == 2


@needs_kernels
def test_the_store_keeps_the_newest_files_within_its_cap(tmp_path, rng, store, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, _ = _model(tmp_path / "a", rng)
    tj.load(first)
    (old,) = store.glob("*.pack")
    monkeypatch.setattr(packed_store, "MAX_BYTES", old.stat().st_size + 1)  # room for one file
    second, w = _model(tmp_path / "b", rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = np.asarray(tj.load(second)({"x": x})["y"])
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-4)
    (kept,) = store.glob("*.pack")
    assert kept != old  # the older file went, the one just written stayed


@needs_kernels
def test_a_store_that_cannot_be_written_packs_in_memory(tmp_path, rng, store):
    store.parent.mkdir(parents=True)
    store.write_text("a file where the store's folder should be")
    path, w = _model(tmp_path, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = np.asarray(tj.load(path)({"x": x})["y"])
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-4)
