"""Weights packed at load (:mod:`.prepack`) kept on disk and memory-mapped by later loads.

Packing the float32 weights of a model for the CPU kernels copies all of them (about 1.5 s for
SmolLM2-135M's 540 MB on a loaded 2-core machine). The first load writes a model's packed weights
to one file, ``<compile cache folder>/packed/<key>.pack``; later loads map that file instead of
packing again, and JAX on the CPU uses the mapped pages without a copy (file-backed, shared
between processes). The map asks for 2 MiB pages (:mod:`..runtime.pages`): one file lets them
cover all the weights, which every decode step reads.

The key names the library's packed layouts and, for each weight, its packing and where it comes
from: the file holding its bytes (its external data file, else the .onnx file), by absolute path,
size, modification time and inode, and the tensor's name, offset and length. A
stored file whose header does not list exactly the expected arrays, or whose size is not theirs
(damaged, truncated), is packed again and replaced. The store is on when the compile cache is
(it sits beside it), unless ``TRANSMUTER_JAX_PACKED_STORE=0``; beyond :data:`MAX_BYTES` the
oldest files go (and at once the ``.npy`` files of earlier versions).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
from onnx import TensorProto

from ..runtime import compile_cache, pages

ENV = "TRANSMUTER_JAX_PACKED_STORE"
MAX_BYTES = 4 << 30
# Bump when a packed layout changes (kernels.pack, kernels.nbits_pack, nbits_pack_scales).
LAYOUT = "strips32-nbits4x32-v2-parts-tiles16"
MAGIC = b"transmuter_jax packed weights 1\n"
SUFFIX = ".pack"
ALIGN = 4096  # each array starts on its own page of the file


class Packed(Protocol):
    """A packing of :mod:`.prepack`."""

    dtype: type

    def pack(self, array: np.ndarray) -> np.ndarray: ...

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...


def folder() -> Path | None:
    """Where packed weights are kept, or None when the store is off."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    compile_cache.configure()
    cache = compile_cache.directory()
    return None if cache is None else Path(cache) / "packed"


def _source(tensor: TensorProto, onnx_path: str) -> str | None:
    """The identity of the bytes a weight is read from (its external data file, else the .onnx
    file itself), or None when that file cannot be found. Packing runs on the initializers as
    read, before any rewrite of the graph: their bytes are the file's."""
    info = {e.key: e.value for e in tensor.external_data}
    if tensor.data_location == TensorProto.EXTERNAL:
        folder = os.path.dirname(os.path.abspath(onnx_path))
        file = os.path.realpath(os.path.join(folder, info.get("location", "")))
    else:
        file = os.path.realpath(onnx_path)
    try:
        stat = os.stat(file)
    except OSError:
        return None
    return "\0".join(
        [
            file,
            str(stat.st_size),
            str(stat.st_mtime_ns),
            str(stat.st_ino),
            info.get("offset", "0"),
            info.get("length", ""),
            tensor.name,
        ]
    )


class Item(NamedTuple):
    """One weight to pack: its name, its packing, its tensor, and its values."""

    name: str
    packing: Packed
    tensor: TensorProto
    array: np.ndarray


def _expected(item: Item) -> tuple[str, str, list[int]]:
    shape = item.packing.packed_shape(tuple(item.array.shape))
    return item.name, np.dtype(item.packing.dtype).str, [int(d) for d in shape]


def _layout(
    items: Sequence[Item],
) -> tuple[bytes, list[tuple[str, str, list[int]]], list[int], int]:
    """The file's header, each item's (name, dtype, packed shape) and offset in the file, and
    the file's size."""
    entries = [_expected(item) for item in items]
    offsets, at = [], 0
    for _, dtype, shape in entries:
        offsets.append(at)
        at += _padded(math.prod(shape) * np.dtype(dtype).itemsize)
    index = json.dumps([[*entry, offset] for entry, offset in zip(entries, offsets, strict=True)])
    start = _padded(len(MAGIC) + 8 + len(index.encode()))
    header = MAGIC + len(index.encode()).to_bytes(8, "little") + index.encode()
    return header, entries, [start + offset for offset in offsets], start + at


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _read(path: Path, items: Sequence[Item]) -> dict[str, np.ndarray] | None:
    """The stored arrays, read-only views of the file mapped for huge pages; None unless the
    file is whole and lists exactly ``items``' names, dtypes and packed shapes."""
    header, entries, offsets, size = _layout(items)
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size != size:
                return None
            mapping = pages.mapped(file.fileno())  # in 2 MiB pages where it can be
    except (OSError, ValueError):
        return None
    if mapping[: len(header)] != header:
        mapping.close()
        return None
    arrays = {}
    for (name, dtype, shape), offset in zip(entries, offsets, strict=True):
        count = math.prod(shape)
        array = np.frombuffer(mapping, np.dtype(dtype), count=count, offset=offset)
        arrays[name] = array.reshape(shape)
    return arrays


def _write(path: Path, items: Sequence[Item]) -> bool:
    """Packs each item into a new file at ``path``, one at a time; whether it was written."""
    header, entries, offsets, size = _layout(items)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".partial")
    except OSError:  # a folder that cannot be written: nothing stored
        return False
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(header)
            for item, entry, offset in zip(items, entries, offsets, strict=True):
                array = np.ascontiguousarray(item.packing.pack(item.array))
                if entry != (item.name, array.dtype.str, list(array.shape)):
                    raise OSError(f"{item.name}: packed as {array.dtype}{list(array.shape)}")
                file.seek(offset)
                file.write(array.data)
            file.truncate(size)
            file.flush()
            pages.uncache(file.fileno())  # its first map reads it into 2 MiB pages
        os.replace(temporary, path)
    except OSError:
        if os.path.exists(temporary):
            os.unlink(temporary)
        return False
    _trim(path.parent, keep=path)
    return True


def _trim(where: Path, keep: Path) -> None:
    """Removes the oldest stored files beyond :data:`MAX_BYTES` (and any left by older
    versions of the store)."""
    try:
        files = [p for p in where.iterdir() if p.suffix in (SUFFIX, ".npy")]
        files.sort(key=lambda p: (p.suffix == SUFFIX, p.stat().st_mtime))
        total = sum(p.stat().st_size for p in files)
        for old in files:
            if total <= MAX_BYTES and old.suffix == SUFFIX:
                break
            if old != keep:
                total -= old.stat().st_size
                old.unlink()
    except OSError:
        pass


def packed(items: Sequence[Item], onnx_path: str) -> dict[str, np.ndarray]:
    """Each item's ``packing.pack(array)`` by name, read from one file of the store (memory-
    mapped), else packed and stored there; packed each time when the store is off."""
    where = folder()
    sources = {item.name: _source(item.tensor, onnx_path) for item in items}
    kept = [item for item in items if where is not None and sources[item.name] is not None]
    found = _stored(where, kept, sources) if kept else {}
    return {i.name: found[i.name] if i.name in found else _pack_now(i) for i in items}


def _pack_now(item: Item) -> np.ndarray:
    return item.packing.pack(item.array)


def _stored(where: Path, items: Sequence[Item], sources: dict[str, str | None]):
    """The items' packed arrays from the store's file for them, written first when absent or
    damaged; packed in memory when it cannot be written."""
    parts = [LAYOUT, *(f"{i.name}\0{i.packing!r}\0{sources[i.name]}" for i in items)]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    path = where / f"{digest}{SUFFIX}"
    found = _read(path, items) if path.exists() else None
    if found is None and _write(path, items):  # absent, damaged or another layout
        found = _read(path, items)
    return found if found is not None else {item.name: _pack_now(item) for item in items}
