"""Large initializers stored inside an .onnx file, read in place.

``onnx.load`` parses every initializer's bytes into the protobuf, and reading them as arrays
copies them again: a file with its weights inline (optimum's exports below 2 GB) is held two or
three times while it loads. :func:`read` instead walks the file's protobuf encoding, parses the
model without the bytes of its large initializers, and gives each of those as an array over a
read-only memory map of the file.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto

# Field numbers of the protobuf messages walked here.
MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_RAW_DATA = 1, 2, 8, 9
# Initializers with at least this many bytes are read in place.
IN_PLACE_BYTES = 4096
# Element types whose raw bytes are the numpy array as it lies (little-endian).
PLAIN = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT8: np.int8,
    TensorProto.INT16: np.int16,
    TensorProto.INT32: np.int32,
    TensorProto.INT64: np.int64,
    TensorProto.UINT8: np.uint8,
    TensorProto.UINT16: np.uint16,
    TensorProto.UINT32: np.uint32,
    TensorProto.UINT64: np.uint64,
    TensorProto.BOOL: np.bool_,
}


class _Malformed(ValueError):
    pass


class Inline(NamedTuple):
    """A model parsed without its large initializers' bytes, and those as arrays by name."""

    proto: onnx.ModelProto
    arrays: dict[str, np.ndarray]


def read(path: str) -> Inline | None:
    """The model at ``path`` with its large inline initializers as arrays over a memory map of
    the file; None when it has none (or an encoding this reader does not walk): load it as usual.
    """
    if np.little_endian is False:  # pragma: no cover - raw bytes are little-endian
        return None
    with open(path, "rb") as file:
        try:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError):  # an empty file, or one that cannot be mapped
            return None
    data = memoryview(mapped)
    arrays: dict[str, np.ndarray] = {}
    try:
        stripped = _message(data, 0, len(data), {MODEL_GRAPH: _graph}, arrays, mapped)
    except (_Malformed, IndexError):
        return None
    if not arrays:
        return None
    return Inline(onnx.load_from_string(bytes(stripped)), arrays)


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _Malformed("varint too long")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(data: memoryview, start: int, end: int):
    """(field number, wire type, start of the field, start of its value, end of the field)."""
    pos = start
    while pos < end:
        tag, value = _varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, stop = _varint(data, value)
        elif wire == 1:
            stop = value + 8
        elif wire == 2:
            length, value = _varint(data, value)
            stop = value + length
        elif wire == 5:
            stop = value + 4
        else:
            raise _Malformed(f"wire type {wire}")
        if stop > end:
            raise _Malformed("field past the end of its message")
        yield field, wire, pos, value, stop
        pos = stop


def _message(data, start, end, handlers, arrays, mapped) -> bytearray:
    """The message's bytes, the fields with a handler rewritten by it (length-delimited)."""
    out = bytearray()
    for field, wire, first, value, stop in _fields(data, start, end):
        handler = handlers.get(field) if wire == 2 else None
        if handler is None:
            out += data[first:stop]
            continue
        body = handler(data, value, stop, arrays, mapped)
        out += _encode_varint(field << 3 | 2) + _encode_varint(len(body)) + body
    return out


def _graph(data, start, end, arrays, mapped) -> bytearray:
    return _message(data, start, end, {GRAPH_INITIALIZER: _tensor}, arrays, mapped)


def _tensor(data, start, end, arrays, mapped) -> bytearray:
    """The tensor without its raw bytes when they are read in place (recorded in ``arrays``)."""
    dims, dtype, name, raw = [], None, None, None
    for field, wire, _, value, stop in _fields(data, start, end):
        if field == TENSOR_DIMS and wire == 0:
            dims.append(_varint(data, value)[0])
        elif field == TENSOR_DIMS and wire == 2:  # packed
            pos = value
            while pos < stop:
                dim, pos = _varint(data, pos)
                dims.append(dim)
        elif field == TENSOR_DATA_TYPE and wire == 0:
            dtype = _varint(data, value)[0]
        elif field == TENSOR_NAME and wire == 2:
            name = bytes(data[value:stop]).decode("utf-8", "replace")
        elif field == TENSOR_RAW_DATA and wire == 2:
            raw = (value, stop)
    if raw is None or name is None or dtype not in PLAIN or name in arrays:
        return bytearray(data[start:end])
    count = int(np.prod(dims, dtype=np.int64))
    itemsize = np.dtype(PLAIN[dtype]).itemsize
    if raw[1] - raw[0] != count * itemsize or raw[1] - raw[0] < IN_PLACE_BYTES:
        return bytearray(data[start:end])
    array = np.frombuffer(mapped, PLAIN[dtype], count=count, offset=raw[0]).reshape(dims)
    arrays[name] = array
    out = bytearray()
    for field, _, first, _, stop in _fields(data, start, end):
        if field != TENSOR_RAW_DATA:
            out += data[first:stop]
    return out
