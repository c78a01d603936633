"""Memory maps of weights advised for 2 MiB pages (transmuter_jax.runtime.pages): asked only
where the system gives huge pages and the user has not said no, and a loaded model's packed
weights lying in one mapping so advised."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from test_packed_store import _model, needs_kernels

import transmuter_jax as tj
from transmuter_jax.onnx import prepack
from transmuter_jax.runtime import pages


def _mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry holding ``address``: its path ('' when anonymous), start, end
    and VmFlags."""
    entry = None
    with open("/proc/self/smaps") as file:
        for line in file:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                path = fields[5] if len(fields) > 5 else ""
                entry = {"start": start, "end": end, "path": path, "flags": []}
            elif fields[0] == "VmFlags:" and entry["start"] <= address < entry["end"]:
                return dict(entry, flags=fields[1:])
    raise AssertionError(f"{address:#x} is not mapped")


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_user_turns_it_off(value, monkeypatch):
    monkeypatch.setenv(pages.ENV, value)
    assert not pages.available()
    mapping = mmap.mmap(-1, 4 << 20)
    assert not pages.advise(mapping)
    start = np.frombuffer(mapping, np.uint8, count=1).ctypes.data
    assert "hg" not in _mapping_of(start)["flags"]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
        (None, False),
    ],
)
def test_the_systems_setting_decides(setting, expected, tmp_path, monkeypatch):
    monkeypatch.delenv(pages.ENV, raising=False)
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(pages, "SETTING", str(path))
    assert pages.available() is expected


needs_huge_pages = pytest.mark.skipif(
    not pages.available(), reason="this system gives no transparent huge pages"
)


@needs_huge_pages
def test_an_advised_mapping_is_marked_for_huge_pages():
    mapping = mmap.mmap(-1, 4 << 20)
    assert pages.advise(mapping)
    start = np.frombuffer(mapping, np.uint8, count=1).ctypes.data
    assert "hg" in _mapping_of(start)["flags"]


@needs_kernels
@needs_huge_pages
def test_a_models_packed_weights_lie_in_one_advised_mapping(tmp_path, monkeypatch):
    from transmuter_jax.runtime import compile_cache

    cache = str(tmp_path / "cache")
    monkeypatch.setattr(compile_cache, "configure", lambda: cache)
    monkeypatch.setattr(compile_cache, "directory", lambda: cache)
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    rng = np.random.default_rng(2)
    path, w = _model(tmp_path, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for _ in range(2):  # packed and stored, then read from the store
        model = tj.load(path)
        (weight,) = model.params.values()
        mapping = _mapping_of(weight.unsafe_buffer_pointer())
        assert mapping["path"].endswith(".pack") and "hg" in mapping["flags"]
        y = np.asarray(model({"x": x})["y"])
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-4)


def _resident(path) -> int:
    """How many of the file's pages are in the page cache (mincore over a map of it)."""
    import ctypes

    size = path.stat().st_size
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    count = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = np.frombuffer(mapping, np.uint8, count=1).ctypes.data
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(size), vec) == 0
    resident = sum(v & 1 for v in vec)
    mapping.close()
    return resident


def _filesystem(path) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/mounts") as file:
        for line in file:
            fields = line.split()
            point = fields[1]
            inside = str(path).startswith(point.rstrip("/") + "/") or str(path) == point
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


@needs_huge_pages
def test_a_file_just_written_leaves_the_page_cache(tmp_path):
    """A file just written sits in the page cache in the write path's pages; uncache writes it
    out and drops them, so that its first advised map reads it into 2 MiB pages."""
    if _filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory filesystem keeps its pages: there is nothing to drop")
    path = tmp_path / "weights"
    with open(path, "wb") as file:
        file.write(np.random.default_rng(0).bytes(8 << 20))
        file.flush()
        assert _resident(path) > 0
        assert pages.uncache(file.fileno())
    assert _resident(path) == 0
    assert path.read_bytes()[:4] == np.random.default_rng(0).bytes(8 << 20)[:4]  # written out


def test_uncache_does_nothing_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv(pages.ENV, "0")
    path = tmp_path / "weights"
    with open(path, "wb") as file:
        file.write(b"\1" * (1 << 20))
        file.flush()
        assert not pages.uncache(file.fileno())
        assert _resident(path) > 0


def _split(path, size: int) -> None:
    """Leaves the last three quarters of the file at ``path`` in the page cache in 4 KiB pages
    (dropped, then read back a page at a time without read-ahead): as reclaim leaves a file
    whose 2 MiB pages were split."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, size // 4, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for at in range(size // 4, size, mmap.PAGESIZE):
            os.pread(fd, mmap.PAGESIZE, at)
    finally:
        os.close(fd)


@needs_huge_pages
def test_a_file_whose_pages_were_split_is_read_again_whole(tmp_path):
    if _filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory filesystem keeps its pages: there is nothing to drop")
    path, size = tmp_path / "weights", 32 << 20
    data = np.random.default_rng(1).bytes(size)
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        pages.uncache(file.fileno())
    with open(path, "rb") as file:
        first = pages.mapped(file.fileno())
        whole = pages.whole_share(first)
        first.close()
    if not whole:
        pytest.skip("this filesystem reads no file into 2 MiB pages")
    _split(path, size)
    with open(path, "rb") as file:
        split = pages._advised(file.fileno())
        share = pages.whole_share(split)
        split.close()
        if not 0 < share < pages.WHOLE:  # the case mapped() mends
            pytest.skip(f"the page cache kept {share:.0%} of the file whole: not split here")
        mapping = pages.mapped(file.fileno())
    assert pages.whole_share(mapping) >= whole - 0.01
    assert mapping[:] == data  # the same bytes, read again
    mapping.close()


def test_mapped_leaves_a_small_or_unadvised_file_as_it_is(tmp_path, monkeypatch):
    path = tmp_path / "weights"
    path.write_bytes(b"\2" * (1 << 20))
    with open(path, "rb") as file:
        mapping = pages.mapped(file.fileno())
    assert mapping[:] == b"\2" * (1 << 20)
    mapping.close()
    monkeypatch.setenv(pages.ENV, "0")
    big = tmp_path / "big"
    big.write_bytes(b"\3" * (8 << 20))
    with open(big, "rb") as file:
        mapping = pages.mapped(file.fileno())
    assert pages.whole_share(mapping) is None  # not asked: nothing measured, nothing dropped
    assert _resident(big) > 0
    mapping.close()
