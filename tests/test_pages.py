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
