"""Weights packed at load (:mod:`.prepack`) kept on disk and memory-mapped by later loads.

Packing the float32 weights of a model for the CPU kernels copies all of them (about 1.5 s for
SmolLM2-135M's 540 MB on a loaded 2-core machine). The first load writes each packed weight to
``<compile cache folder>/packed/<key>.npy``; later loads map that file instead of packing again, and
JAX on the CPU uses the mapped pages without a copy (file-backed, shared between processes).

The key names the packing, the library's packed layouts, and where the weight comes from: the
external data file's absolute path, size, modification time and inode, and the tensor's offset
and length in it (weights stored inside the .onnx file are packed each time). A stored file that
does not read back as an array of the expected shape and dtype (damaged, truncated) is packed
again and replaced. The store is on when the compile cache is (it sits beside it), unless
``TRANSMUTER_JAX_PACKED_STORE=0``; beyond :data:`MAX_BYTES` the oldest files go.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Protocol

import numpy as np
from onnx import TensorProto

from ..runtime import compile_cache

ENV = "TRANSMUTER_JAX_PACKED_STORE"
MAX_BYTES = 4 << 30
# Bump when a packed layout changes (kernels.pack, kernels.nbits_pack, nbits_pack_scales).
LAYOUT = "strips32-nbits4x32-v2-parts-tiles16"


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


def _source(tensor: TensorProto, model_folder: str) -> str | None:
    """The identity of the bytes a weight is read from, or None when it has no data file."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    file = os.path.realpath(os.path.join(model_folder, info.get("location", "")))
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


def _read(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if array.shape != shape or array.dtype != dtype:
        return None
    return array


def _write(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as file:
            np.save(file, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(temporary, path)
    except OSError:
        if os.path.exists(temporary):
            os.unlink(temporary)
        return
    _trim(path.parent, keep=path)


def _trim(where: Path, keep: Path) -> None:
    """Removes the oldest stored weights beyond :data:`MAX_BYTES`."""
    try:
        files = sorted(where.glob("*.npy"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for old in files:
            if total <= MAX_BYTES:
                break
            if old != keep:
                total -= old.stat().st_size
                old.unlink()
    except OSError:
        pass


def packed(packing: Packed, tensor: TensorProto, model_folder: str, array: np.ndarray):
    """``packing.pack(array)``, read from the store when it holds it (memory-mapped), else
    packed and stored."""
    where, source = folder(), _source(tensor, model_folder)
    if where is None or source is None:
        return packing.pack(array)
    digest = hashlib.sha256(f"{LAYOUT}\0{packing!r}\0{source}".encode()).hexdigest()
    path = where / f"{digest}.npy"
    result = packing.pack(array) if not path.exists() else None
    if result is None:
        stored = _read(path, packing.packed_shape(array.shape), np.dtype(packing.dtype))
        if stored is not None:
            return stored
        result = packing.pack(array)  # damaged or from another layout: packed again
    _write(path, result)
    stored = _read(path, result.shape, result.dtype)
    return result if stored is None else stored  # the mapped copy: its pages are shared
