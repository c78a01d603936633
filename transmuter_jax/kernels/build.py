"""Builds the C++ kernels with the system compiler, once per source, flags, jaxlib and CPU.

The shared library goes to ``<cache folder>/kernels/<key>/`` (see
``transmuter_jax.runtime.paths.cache_dir``). The key covers the sources, the flags, the compiler,
jaxlib and the CPU's identity (``-march=native`` code runs only on the CPU it was built for), so
a cache folder shared between machines holds one library per CPU. The library is written to a
temporary file and renamed into place, with its sha256 beside it (``libtj_kernels.so.sha256``);
a library that does not match its checksum (truncated, damaged, or left by an interrupted build)
is rebuilt before it is loaded. A file lock keeps concurrent processes (pytest-xdist workers)
from building it twice. ``TRANSMUTER_JAX_KERNELS=0`` turns the kernels off; a missing compiler or
a failed build turns them off with one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
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

from ..runtime import switch

ENV = switch.KERNELS_ENV
OFF = switch.OFF_VALUES
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# The sources (and the headers beside them):
SOURCES = (
    "pool.cc",
    "gemm.cc",
    "nbits.cc",
    "norm.cc",
    "attention.cc",
    "activation.cc",
    "matmul_nt.cc",
    "matmul_nn.cc",
    "softmax.cc",
    "swap.cc",
    "argmax.cc",
)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-pthread")
# FFI handlers exported by the library, by target name.
STRIP = 32  # columns per strip of a packed float32 weight, as gemm.cc's kStrip
TARGETS = {
    "tj_gemm_f32": "TjGemmF32",
    "tj_gemm_rows_f32": "TjGemmRowsF32",
    "tj_gemm_live_f32": "TjGemmLiveF32",
    "tj_gemm_gate_up_f32": "TjGemmGateUpF32",
    "tj_gemm_gate_up_live_f32": "TjGemmGateUpLiveF32",
    "tj_gemm_skip_norm_f32": "TjGemmSkipNormF32",
    "tj_gemm_skip_norm_live_f32": "TjGemmSkipNormLiveF32",
    "tj_matmul_nbits": "TjMatMulNBits",
    "tj_matmul_nbits_live": "TjMatMulNBitsLive",
    "tj_matmul_nbits_gate_up": "TjMatMulNBitsGateUp",
    "tj_matmul_nbits_gate_up_live": "TjMatMulNBitsGateUpLive",
    "tj_matmul_nbits_skip_norm": "TjMatMulNBitsSkipNorm",
    "tj_matmul_nbits_skip_norm_live": "TjMatMulNBitsSkipNormLive",
    "tj_rms_norm": "TjRmsNorm",
    "tj_skip_rms_norm": "TjSkipRmsNorm",
    "tj_attention_f32": "TjAttentionF32",
    "tj_gqa_step_f32": "TjGqaStepF32",
    "tj_silu_mul_f32": "TjSiluMulF32",
    "tj_matmul_nt_f32": "TjMatMulNtF32",
    "tj_matmul_nn_f32": "TjMatMulNnF32",
    "tj_softmax_f32": "TjSoftmaxF32",
    "tj_swap_axes_f32": "TjSwapAxesF32",
    "tj_argmax_f32": "TjArgmaxF32",
}
LIBRARY = "libtj_kernels.so"
CHECKSUM = LIBRARY + ".sha256"
# /proc/cpuinfo fields that name what -march=native compiles for (x86, then Arm).
CPU_FIELDS = ("vendor_id", "model name", "cpu family", "model", "flags")
ARM_FIELDS = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def disabled_by_env() -> bool:
    """Whether ``TRANSMUTER_JAX_KERNELS`` turns the kernels off."""
    return not switch.wanted()


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++`` or ``g++`` on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def cpu_identity() -> str:
    """This CPU's model and feature flags: the first processor's entries of /proc/cpuinfo, and
    the machine and processor names of :mod:`platform`."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if not line.strip() and fields:
                break  # the first processor's entries: the others are alike
            name, _, value = (part.strip() for part in line.partition(":"))
            if name in ("flags", "Features"):  # the order of the flags is no identity
                value = " ".join(sorted(value.split()))
            if name in CPU_FIELDS + ARM_FIELDS:
                fields.setdefault(name, value)
    parts = [f"{name}={value}" for name, value in sorted(fields.items())]
    return "\n".join([*parts, platform.machine(), platform.processor()])


def _key(cxx: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cc", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    for part in (*FLAGS, cxx, version, jaxlib.__version__, sys.platform, cpu_identity()):
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verified(target: Path) -> bool:
    """Whether the library ``target`` exists and matches the checksum kept beside it."""
    try:
        want = (target.parent / CHECKSUM).read_text().strip()
        return bool(want) and _sha256(target) == want
    except OSError:
        return False


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def build(cxx: str) -> Path:
    """The path of the built library, verified; compiled first if the cache lacks it or holds a
    library that does not match its checksum."""
    from ..runtime.paths import cache_dir

    folder = cache_dir() / "kernels" / _key(cxx)
    target = folder / LIBRARY
    if verified(target):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder / "build.lock"):
        if verified(target):  # another process built it meanwhile
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
            with open(out, "rb+") as file:
                os.fsync(file.fileno())
            checksum = _sha256(out)
            # The old checksum goes first: a library renamed into place before its checksum is
            # written is rebuilt, never loaded.
            with contextlib.suppress(OSError):
                (folder / CHECKSUM).unlink()
            os.replace(out, target)
            _write_atomically(folder / CHECKSUM, (checksum + "\n").encode())
        if not verified(target):
            raise RuntimeError(f"the library built at {target} does not match its checksum")
    return target


def vector_lanes() -> int | None:
    """Floats per vector of the library's float32 kernels, or None when it is not loaded."""
    lib = library()
    return None if lib is None else int(lib.tj_vector_lanes())


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
        if lib.tj_strip_width() != STRIP:
            raise RuntimeError(f"its strip width is {lib.tj_strip_width()}, the packer's {STRIP}")
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
