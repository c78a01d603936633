"""The persistent compilation cache: this package's compiled programs kept on disk.

Nothing is set when transmuter_jax is imported. The first model load (or :func:`enable`) picks
the folder: ``<cache folder>/jax`` (see :func:`.paths.cache_dir`), moved by the
environment variable ``TRANSMUTER_JAX_COMPILE_CACHE`` (a folder) or turned off by it (``0``,
``off``, ``false`` or ``no``). JAX's global configuration is never changed: the programs this
package compiles are compiled inside :func:`scope`, which lends JAX's cache machinery a cache of
this folder for the calling thread only, so the caller's own programs are never written there.
A caller that set ``jax_compilation_cache_dir`` itself keeps it: then this package's programs go
to the caller's cache, with the caller's settings.

Each entry holds its key and a digest of its contents; an entry whose key or digest does not
match is compiled again and replaced, with one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax

from . import heap

ENV = "TRANSMUTER_JAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")
MAX_BYTES = 2 << 30  # least recently used entries go beyond this
MAGIC = b"transmuter_jax-entry-1\0"
# Before the names of this package's entries: plain JAX (and older versions of this package)
# neither read them nor are read by it, even in a shared folder.
PREFIX = "tj1-"

_lock = threading.RLock()
_state: dict = {"configured": False, "folder": None, "cache": None}
_local = threading.local()  # depth: how deeply this thread is inside scope()
_warned: set[str] = set()


def warn_once(topic: str, message: str) -> None:
    """Warns ``message`` the first time ``topic`` comes up in this process."""
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def seal(key: str, payload: bytes) -> bytes:
    """``payload`` with its key and digest in front, as a stored entry holds it."""
    name = key.encode()
    header = MAGIC + len(name).to_bytes(4, "big") + name
    return header + hashlib.sha256(payload).digest() + payload


def unseal(key: str, data: bytes) -> tuple[bytes | None, str]:
    """The payload of a stored entry of ``key``, or None and what is wrong with it."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        return None, "it lacks the header of this package's entries (damaged or truncated)"
    at = len(MAGIC)
    size = int.from_bytes(data[at : at + 4], "big")
    name = data[at + 4 : at + 4 + size]
    if name != key.encode():
        return None, f"it holds the entry of key {name[:80].decode(errors='replace')!r}"
    at += 4 + size
    digest, payload = data[at : at + 32], data[at + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        return None, "its contents do not match their digest (truncated or damaged)"
    return payload, ""


def directory() -> str | None:
    """The folder this package's compiled programs are kept in, or None when they are not kept.

    None until the first model load or :func:`enable`; the caller's own
    ``jax_compilation_cache_dir`` when the caller set one.
    """
    caller = jax.config.jax_compilation_cache_dir
    if caller is not None and _state["configured"]:
        return caller
    return _state["folder"]


def enable(path: str | os.PathLike | None = None) -> str:
    """Keeps this package's compiled programs in ``path`` (default: ``<cache folder>/jax``),
    unless the caller set ``jax_compilation_cache_dir``: that one is used then.

    Returns:
        The folder.
    """
    if path is None:
        from .paths import cache_dir

        path = cache_dir() / "jax"
    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    with _lock:
        _state.update(configured=True, folder=str(folder), cache=None)
    return str(folder)


def disable() -> None:
    """Stops keeping this package's compiled programs on disk (in this process)."""
    with _lock:
        _state.update(configured=True, folder=None, cache=None)


def configure() -> str | None:
    """Applies ``TRANSMUTER_JAX_COMPILE_CACHE`` once (on the first model load).

    Returns:
        The folder, or None when the cache is off.
    """
    with _lock:
        if _state["configured"]:
            return directory()
        heap.trim_after_compiles()  # what a compile frees leaves the process (see .heap)
        setting = os.environ.get(ENV)
        if setting is not None and setting.strip().lower() in OFF:
            disable()
            return None
        if jax.config.jax_compilation_cache_dir is not None:
            disable()  # the caller's cache is used as it is (see scope)
            return directory()
        try:
            enable(setting or None)
        except OSError as error:  # a read-only home: run without the cache rather than fail
            disable()
            warn_once(
                "folder",
                f"transmuter_jax keeps no compiled programs on disk: cannot create its cache "
                f"folder ({error}); set {ENV} to a writable folder",
            )
        return directory()


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Within it, the programs this thread compiles are read from and written to the cache.

    Outside it, and in other threads, JAX's persistent cache is as the caller left it. A caller
    that set ``jax_compilation_cache_dir`` (or turned off ``jax_enable_compilation_cache``) keeps
    its own settings here too.
    """
    configure()
    depth = getattr(_local, "depth", 0)
    if depth == 0:  # the compiler options' probe compiles outside any cache, before the lend
        from .jit import jit_options

        jit_options()
    folder = _state["folder"]
    own = (
        depth == 0
        and folder is not None
        and jax.config.jax_compilation_cache_dir is None
        and jax.config.jax_enable_compilation_cache
    )
    if not own:
        _local.depth = depth + 1
        try:
            yield
        finally:
            _local.depth = depth
        return
    with _lock:
        jax_cache = _jax_cache()
        if jax_cache is None:
            yield
            return
        cache = _state["cache"]
        if cache is None or cache.folder != folder:
            try:
                cache = _state["cache"] = _VerifiedCache(folder)
            except (OSError, RuntimeError) as error:
                warn_once("folder", f"transmuter_jax keeps no compiled programs on disk: {error}")
                disable()
                yield
                return
        from jax._src import config

        mutex = getattr(jax_cache, "_cache_initialized_mutex", None) or contextlib.nullcontext()
        with mutex:
            saved = {name: getattr(jax_cache, name) for name in _JAX_STATE}
        _local.depth = 1
        cache.owner = threading.get_ident()
        try:
            with mutex:
                jax_cache._cache = cache
                jax_cache._cache_initialized = jax_cache._cache_checked = True
                jax_cache._cache_used = True
            with (
                config.compilation_cache_dir(folder),
                config.persistent_cache_min_compile_time_secs(0.0),
                config.persistent_cache_min_entry_size_bytes(-1),
            ):
                yield
        finally:
            cache.owner = None
            with mutex:
                for name, value in saved.items():
                    setattr(jax_cache, name, value)
            _local.depth = 0


_JAX_STATE = ("_cache", "_cache_initialized", "_cache_checked", "_cache_used")


def _jax_cache():
    """JAX's compilation cache module, or None (with one warning) where it is not as expected."""
    try:
        from jax._src import compilation_cache, config
        from jax._src.lru_cache import LRUCache  # noqa: F401
    except ImportError:
        compilation_cache = config = None
    names = ("compilation_cache_dir", "persistent_cache_min_compile_time_secs")
    if (
        compilation_cache is None
        or not all(hasattr(compilation_cache, n) for n in _JAX_STATE)
        or not all(hasattr(config, n) for n in names)
    ):
        warn_once(
            "jax",
            f"transmuter_jax keeps no compiled programs on disk: jax {jax.__version__} has no "
            "persistent cache of the kind it knows (jax 0.4.30 to 0.10)",
        )
        return None
    return compilation_cache


def _base_cache(folder: str):
    from jax._src.lru_cache import LRUCache

    try:
        return LRUCache(folder, max_size=MAX_BYTES)
    except RuntimeError:  # no filelock: no size limit
        return LRUCache(folder, max_size=-1)


class _VerifiedCache:
    """JAX's file cache of ``folder`` (duck-typed as JAX's CacheInterface), whose entries hold
    their key; used by one thread at a time.

    A get from another thread than ``owner`` finds nothing and a put from it writes nothing, so
    programs compiled elsewhere while a scope is open stay out.
    """

    def __init__(self, folder: str):
        self.folder = folder
        self.owner: int | None = None
        self._base = _base_cache(folder)

    @property
    def _path(self):
        return self._base._path

    def _ours(self) -> bool:
        return self.owner == threading.get_ident()

    def get(self, key: str) -> bytes | None:
        if not self._ours():
            return None
        data = self._base.get(PREFIX + key)
        if data is None:
            return None
        payload, problem = unseal(key, data)
        if payload is None:
            path = Path(self.folder) / f"{PREFIX}{key}-cache"
            warn_once(
                "entry",
                f"compiled program {path} does not match its key: {problem}; compiling it again "
                "and replacing it",
            )
            with contextlib.suppress(OSError):
                path.unlink()
        return payload

    def put(self, key: str, value: bytes) -> None:
        if self._ours():
            self._base.put(PREFIX + key, seal(key, value))

    def clear(self) -> None:
        pass
