"""Builds the C++ kernels with the system compiler, once per source, flags and jaxlib version.

The shared library goes to ``<cache folder>/kernels/<key>/`` (see
:func:`transmuter_jax.default.cache_dir`); a file lock keeps concurrent processes (pytest-xdist
workers) from building it twice. ``TRANSMUTER_JAX_KERNELS=0`` turns the kernels off; a missing
compiler or a failed build turns them off with one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax
import jaxlib

ENV = "TRANSMUTER_JAX_KERNELS"
OFF = ("0", "off", "false", "no")
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("pool.cc", "gemm.cc", "nbits.cc")  # and the headers beside them
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-pthread")
# FFI handlers exported by the library, by target name.
TARGETS = {"tj_gemm_f32": "TjGemmF32", "tj_matmul_nbits": "TjMatMulNBits"}
LIBRARY = "libtj_kernels.so"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def disabled_by_env() -> bool:
    """Whether ``TRANSMUTER_JAX_KERNELS`` turns the kernels off."""
    return os.environ.get(ENV, "").strip().lower() in OFF


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++`` or ``g++`` on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _key(cxx: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cc", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    for part in (*FLAGS, cxx, version, jaxlib.__version__, sys.platform):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(cxx: str) -> Path:
    """The path of the built library, compiling it first if the cache lacks it."""
    from ..default import cache_dir

    folder = cache_dir() / "kernels" / _key(cxx)
    target = folder / LIBRARY
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder / "build.lock"):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            out = Path(scratch) / LIBRARY
            command = [
                cxx,
                *FLAGS,
                "-isystem",
                jax.ffi.include_dir(),
                "-o",
                str(out),
                *(str(SOURCE_DIR / s) for s in SOURCES),
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
            os.replace(out, target)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library with its FFI targets registered, or None when off or unbuilt."""
    global _library, _tried
    if disabled_by_env():
        return None
    with _lock:
        if not _tried:
            _tried = True
            _library = _load()
    return _library


def _load() -> ctypes.CDLL | None:
    cxx = compiler()
    if cxx is None:
        warnings.warn(
            "transmuter_jax: no C++ compiler found; the CPU kernels are off (pure JAX instead)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    try:
        lib = ctypes.CDLL(str(build(cxx)))
        for name, symbol in TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except Exception as error:  # noqa: BLE001 - any failure means: run without kernels
        warnings.warn(
            f"transmuter_jax: building the CPU kernels failed; using pure JAX instead ({error})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return lib
