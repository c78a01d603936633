"""Lowered programs kept on disk (``jax.export``), so that a new process skips tracing.

JAX's persistent compilation cache (:mod:`transmuter_jax.compile_cache`) keeps compiled programs,
but it finds them by the lowered program: every process still traces the ONNX graph and lowers
it (about 0.6 s for each step shape of a 30-layer decoder). :class:`StoredJit` keeps the lowered
program of each input signature in ``<compile cache folder>/lowered`` instead, keyed by
everything the program depends on: the library's own source, the versions of jax, jaxlib, numpy
and onnx, the backend, the environment variables that change tracing, the ONNX graph (not its
weights: their shapes and dtypes), what the caller says the function closes over, and the shapes
and dtypes of the arguments. A new process reads the program back and lowers only a call to it,
which the persistent cache then finds compiled. The store is on when the compilation cache is.

Each file holds its key and a digest of the program; a file whose key, digest or arguments do
not match the call is traced again and replaced, with one warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import onnx

from . import compile_cache, switch

MAX_BYTES = 256 << 20  # oldest programs go beyond this
# The files hold their key (see compile_cache.seal); older versions' files end in .jaxexport
# alone, so the two never read each other's, and the old ones go first when the folder is full.
SUFFIX = ".tj1.jaxexport"
# Environment variables that change what a traced program computes.
ENVIRONMENT = switch.TRACE_ENVIRONMENT
# The custom calls of the CPU kernels (jax.export refuses unknown ones unless told; a program
# that calls one missing here is not stored, and compiles in every process): kernels.build's
# TARGETS, which test_stored_programs_know_every_kernel checks.
CUSTOM_CALLS = (
    "tj_gemm_f32",
    "tj_gemm_rows_f32",
    "tj_gemm_live_f32",
    "tj_gemm_gate_up_f32",
    "tj_gemm_gate_up_live_f32",
    "tj_gemm_skip_norm_f32",
    "tj_gemm_skip_norm_live_f32",
    "tj_matmul_nbits",
    "tj_matmul_nbits_live",
    "tj_matmul_nbits_gate_up",
    "tj_matmul_nbits_gate_up_live",
    "tj_matmul_nbits_skip_norm",
    "tj_matmul_nbits_skip_norm_live",
    "tj_rms_norm",
    "tj_skip_rms_norm",
    "tj_attention_f32",
    "tj_gqa_step_f32",
    "tj_silu_mul_f32",
    "tj_matmul_nt_f32",
    "tj_matmul_nn_f32",
    "tj_softmax_f32",
    "tj_swap_axes_f32",
    "tj_argmax_f32",
)
# Programs this process traced and stored ("exported"), and read back instead ("read").
counts = {"exported": 0, "read": 0}
# Called as listener("start", 0.0) before this process traces a program that is not stored, and
# listener("done", seconds) once that program is compiled (the command line reports first runs).
compile_listeners: list[Callable[[str, float], None]] = []


def _tell(event: str, seconds: float = 0.0) -> None:
    for listener in list(compile_listeners):
        listener(event, seconds)


def folder() -> Path | None:
    """Where lowered programs are kept: beside the compiled ones, or None when the cache is off."""
    compile_cache.configure()
    cache = compile_cache.directory()
    return None if cache is None else Path(cache) / "lowered"


@functools.cache
def _library() -> str:
    """The fingerprint of this library's code and of the packages that shape its programs."""
    digest = hashlib.sha256()
    root = Path(__file__).parent.parent  # the package's sources, all floors
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    import jaxlib

    for name, version in (
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("numpy", np.__version__),
        ("onnx", onnx.__version__),
    ):
        digest.update(f"{name}={version}\0".encode())
    on = switch.here()  # not an off() block's view
    digest.update(f"kernels={on}\0".encode())
    return digest.hexdigest()


def _environment() -> str:
    device = jax.devices()[0]
    values = [f"{name}={os.environ.get(name)}" for name in ENVIRONMENT]
    values += [
        f"backend={jax.default_backend()}",
        f"device={device.device_kind}",
        f"x64={jax.config.jax_enable_x64}",
        f"matmul={jax.config.jax_default_matmul_precision}",
    ]
    return "\0".join(values)


def _abstract(args: tuple) -> tuple[Any, list[jax.ShapeDtypeStruct]]:
    leaves, tree = jax.tree.flatten(args)
    canonical = jax.dtypes.canonicalize_dtype
    specs = [jax.ShapeDtypeStruct(np.shape(x), canonical(x.dtype)) for x in leaves]
    return tree, specs


def _key(key: Hashable, tree: Any, specs: list[jax.ShapeDtypeStruct]) -> str:
    digest = hashlib.sha256()
    for part in (_library(), _environment(), repr(key), str(tree)):
        digest.update(part.encode() + b"\0")
    for spec in specs:
        digest.update(f"{spec.shape}{spec.dtype};".encode())
    return digest.hexdigest()


class StoredJit:
    """``jax.jit(fn)`` whose lowered program for each input signature is kept on disk.

    Args:
        fn: the function to compile.
        key: what ``fn`` computes beyond its arguments' shapes: every value it closes over (with
            :attr:`Model.fingerprint` of the models it runs), as a value whose repr is stable across
            processes; None keeps nothing on disk (plain ``jax.jit``).
        donate_argnums, **jit_options: as for ``jax.jit``.

    Call it as ``stored(signature, *args)``: ``signature`` is any hashable value that tells
    apart the shapes and dtypes of ``args`` (the caller knows which of them vary), so a call
    does not flatten all the arguments to find its program.
    """

    def __init__(
        self,
        fn: Callable,
        key: Hashable | None,
        *,
        donate_argnums: tuple[int, ...] = (),
        **jit_options: Any,
    ):
        self._fn = fn
        self._key = key
        self._donate = donate_argnums
        self._options = jit_options
        self._plain: dict[bool, Any] = {}  # plain jit, by whether it traces the kernels
        self._programs: dict[Hashable, Any] = {}

    def __call__(self, signature: Hashable, *args):
        program = self._programs.get(signature)
        if program is not None:
            return program(*args)
        start, read = time.perf_counter(), counts["read"]
        with compile_cache.scope():
            program = self._program(args)
            result = program(*args)  # compiles
        self._programs[signature] = program
        release_heap()
        if counts["read"] == read:
            _tell("done", time.perf_counter() - start)
        return result

    def warm(self, signature: Hashable, *specs) -> None:
        """Reads or compiles the program of ``specs`` (``jax.ShapeDtypeStruct`` s shaped as a
        call's arguments) without running it: a later call of that signature starts at once."""
        if signature in self._programs:
            return
        with compile_cache.scope():
            program = self._program(specs)
            program.lower(*specs).compile()
        self._programs[signature] = program
        release_heap()

    @property
    def function(self) -> Callable:
        """The function it compiles (to call inside another traced program)."""
        return self._fn

    def _program(self, args: tuple):
        where = folder()
        # Arguments over a mesh: stored programs keep no shardings, so these run as plain jit,
        # traced without the kernels (runtime.switch: the partitioner cannot split them).
        mesh = switch.spans_devices(args)
        if mesh or self._key is None or where is None or not _store_works():
            _tell("start")
            return self._jit(kernels=not mesh)
        tree, specs = _abstract(args)
        key = _key(self._key, tree, specs)
        path = where / (key + SUFFIX)
        exported = _read(path, key, specs)
        if exported is not None:
            counts["read"] += 1
        else:
            _tell("start")
            checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in CUSTOM_CALLS]
            export = jax.export.export(
                jax.jit(self._fn), platforms=[jax.default_backend()], disabled_checks=checks
            )
            try:
                exported = export(*jax.tree.unflatten(tree, specs))
                data = exported.serialize()
            except Exception:  # noqa: BLE001 - what jax.export cannot store runs as plain jit
                return self._jit()
            _write(path, compile_cache.seal(key, bytes(data)))
            counts["exported"] += 1
        return jax.jit(exported.call, donate_argnums=self._donate, **self._options)

    def _jit(self, kernels: bool = True):
        """``jax.jit`` of the function; ``kernels=False`` traces it inside :func:`switch.off`."""
        if kernels not in self._plain:
            fn = self._fn if kernels else _without_kernels(self._fn)
            self._plain[kernels] = jax.jit(fn, donate_argnums=self._donate, **self._options)
        return self._plain[kernels]


def _without_kernels(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def traced(*args):
        with switch.off():
            return fn(*args)

    return traced


def storable(cls: type) -> type:
    """Registers a dataclass pytree without static fields (``jax.tree_util.register_dataclass``)
    for ``jax.export``, so programs that take or return it can be stored."""
    jax.export.register_pytree_node_serialization(
        cls,
        serialized_name=f"transmuter_jax.{cls.__module__}.{cls.__qualname__}",
        serialize_auxdata=lambda aux: b"",
        deserialize_auxdata=lambda data: (),
    )
    return cls


def signature(args: Any) -> tuple:
    """A :class:`StoredJit` signature of ``args``: their tree, shapes and dtypes."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple(_spec(x) for x in leaves)


def _spec(x: Any) -> tuple:
    """(shape, dtype) of an array, or of a Python scalar as numpy takes it."""
    try:
        return x.shape, x.dtype
    except AttributeError:
        return np.shape(x), np.result_type(x)


class AutoStoredJit(StoredJit):
    """A :class:`StoredJit` called with its arguments only: the signature is their shapes and
    dtypes (for small argument lists, such as the selection's)."""

    def __call__(self, *args):
        return super().__call__(signature(args), *args)

    def warm(self, *specs) -> None:  # type: ignore[override]
        """As :meth:`StoredJit.warm`, the signature read from ``specs``."""
        super().warm(signature(specs), *specs)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_heap() -> None:
    """Gives the memory that compiling freed back to the system (glibc keeps freed heap pages:
    about 100 MiB after the programs of a 30-layer decoder)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _read(path: Path, key: str, specs: list[jax.ShapeDtypeStruct]):
    """The program stored at ``path`` for ``key``; None when there is none, or (with one warning)
    when the file is damaged or holds another program: it is then traced again and replaced."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        os.utime(path)  # recently used: kept longest
    except OSError:
        pass
    payload, problem = compile_cache.unseal(key, data)
    exported = None
    if payload is not None:
        try:
            exported = jax.export.deserialize(bytearray(payload))
        except Exception as error:  # noqa: BLE001 - a damaged or foreign file
            problem = f"it cannot be read back ({type(error).__name__}: {error})"
    if exported is not None:
        want = [(tuple(s.shape), np.dtype(s.dtype)) for s in specs]
        have = [(tuple(a.shape), np.dtype(a.dtype)) for a in exported.in_avals]
        if have != want:
            problem = "its arguments are not those of the call"
            exported = None
    if exported is None:
        compile_cache.warn_once(
            "stored",
            f"stored program {path} does not match its key: {problem}; tracing it again and "
            "replacing it",
        )
    return exported


@functools.cache
def _store_works() -> bool:
    """Whether jax.export can store programs here (it needs flatbuffers); warns once if not."""
    try:
        import flatbuffers  # noqa: F401
    except ImportError:
        compile_cache.warn_once(
            "flatbuffers",
            "transmuter_jax keeps no lowered programs on disk, so each new process traces its "
            "programs again: jax.export needs the package flatbuffers (pip install flatbuffers)",
        )
        return False
    return True


def _write(path: Path, data: bytes) -> None:
    """Writes ``data`` atomically; then trims the folder to MAX_BYTES. A failure warns once and
    is otherwise ignored: the store only saves time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as file:
            file.write(data)
        os.replace(file.name, path)
        _trim(path.parent)
    except OSError as error:
        compile_cache.warn_once(
            "store write",
            f"transmuter_jax cannot keep lowered programs in {path.parent} ({error}), so each new "
            f"process traces them again; set {compile_cache.ENV} to a writable folder",
        )


def _trim(where: Path) -> None:
    entries = []
    for path in where.glob("*.jaxexport"):
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= MAX_BYTES:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            pass
