"""The persistent compilation cache: compiled programs kept on disk across processes.

On by default when transmuter_jax is imported, in ``<cache folder>/jax`` (see
:func:`transmuter_jax.default.cache_dir`), unless the process already set JAX's
``jax_compilation_cache_dir``. The environment variable ``TRANSMUTER_JAX_COMPILE_CACHE`` moves it
(a folder) or turns it off (``0``, ``off``, ``false`` or ``no``). The minimum compile time and
entry size are lowered so that the small step and selection programs are stored too; the folder
is kept under 2 GiB, least recently used entries going first.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "TRANSMUTER_JAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")
MAX_BYTES = 2 << 30  # least recently used entries go beyond this

_ours = False  # whether the folder in JAX's config was set by this module


def directory() -> str | None:
    """The folder JAX's persistent cache writes to, or None when it is off."""
    return jax.config.jax_compilation_cache_dir


def _reset() -> None:
    """Makes JAX read the cache settings again (it decides once per process)."""
    try:
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        pass


def enable(path: str | os.PathLike | None = None) -> str:
    """Turns the persistent cache on, in ``path`` (default: ``<cache folder>/jax``)."""
    global _ours
    if path is None:
        from .default import cache_dir

        path = cache_dir() / "jax"
    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _ours = True
    _reset()
    return str(folder)


def disable() -> None:
    """Turns the persistent cache off for this process."""
    global _ours
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)
    _ours = False
    _reset()


def configure() -> str | None:
    """Applies ``TRANSMUTER_JAX_COMPILE_CACHE`` (called on import); returns the folder or None.

    A folder the process set in JAX's config itself is left as it is.
    """
    setting = os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in OFF:
        if _ours:
            disable()
        return directory()
    if directory() is not None and not _ours:
        return directory()
    try:
        return enable(setting or None)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
