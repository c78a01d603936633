"""Where transmuter_jax keeps files for the user (the per-user cache folder), and what a path
given as an input file is when it is no regular file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

CACHE_ENV = "TRANSMUTER_JAX_CACHE"


def cache_dir() -> Path:
    """The per-user cache folder: $TRANSMUTER_JAX_CACHE, else $XDG_CACHE_HOME/transmuter_jax,
    else ~/.cache/transmuter_jax."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transmuter_jax"


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path: str | os.PathLike, what: str) -> str | None:
    """Why ``path``, given where a ``what`` file is expected ("an audio", "an image"), cannot be
    read as one (it is missing, a folder, a FIFO, a device, a socket); None for a regular file
    (after its links)."""
    shown = repr(os.fspath(path))
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return f"no {what.split(' ', 1)[-1]} file {shown}"
    for test, kind in _KINDS:
        if test(mode):
            return f"{shown} is {kind}, not {what} file"
    return None if stat.S_ISREG(mode) else f"{shown} is not a regular file, not {what} file"
