"""Large initializers inside an .onnx file are read in place (transmuter_jax.onnx.inline)."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import transmuter_jax as tj
from transmuter_jax.onnx import inline
from transmuter_jax.onnx import model as model_module
from transmuter_jax.testing import example_inputs

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
INLINE = [FIXTURES / "llama-optimum" / "model.onnx", FIXTURES / "gpt2-optimum" / "model.onnx"]


@pytest.mark.parametrize("path", INLINE, ids=lambda p: p.parent.name)
def test_read_gives_the_initializers_and_the_rest_of_the_model(path):
    whole = onnx.load(path)
    found = inline.read(str(path))
    assert found is not None
    expected = {t.name: numpy_helper.to_array(t) for t in whole.graph.initializer}
    assert found.arrays  # the large ones
    for name, array in found.arrays.items():
        assert array.nbytes >= inline.IN_PLACE_BYTES
        np.testing.assert_array_equal(array, expected[name])
        assert not array.flags.writeable  # a view of the file, not a copy
    small = {t.name for t in found.proto.graph.initializer if t.name not in found.arrays}
    for tensor in found.proto.graph.initializer:
        if tensor.name in small:
            np.testing.assert_array_equal(numpy_helper.to_array(tensor), expected[tensor.name])
        else:
            assert not tensor.raw_data
    # Everything but the large initializers' bytes is kept.
    for proto in (whole, found.proto):
        for tensor in proto.graph.initializer:
            tensor.ClearField("raw_data")
    assert found.proto.SerializeToString() == whole.SerializeToString()


@pytest.mark.parametrize("path", INLINE, ids=lambda p: p.parent.name)
def test_a_model_read_in_place_computes_the_same(path, monkeypatch):
    parsed = tj.load(path)
    monkeypatch.setattr(model_module, "INLINE_FILE_BYTES", 0)
    in_place = tj.load(path)
    inputs = example_inputs(parsed, length=5)
    want, got = parsed(inputs), in_place(inputs)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def test_files_without_inline_weights_are_left_to_onnx(tmp_path):
    source = FIXTURES / "llama-genai-fp32" / "model.onnx"  # external data
    assert inline.read(str(source)) is None
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert inline.read(str(empty)) is None
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x3a\xff\xff\xff\xff\x0f")  # a graph field longer than the file
    assert inline.read(str(broken)) is None
