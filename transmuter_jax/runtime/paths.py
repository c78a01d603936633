"""Where transmuter_jax keeps files for the user: the per-user cache folder."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TRANSMUTER_JAX_CACHE"


def cache_dir() -> Path:
    """The per-user cache folder: $TRANSMUTER_JAX_CACHE, else $XDG_CACHE_HOME/transmuter_jax,
    else ~/.cache/transmuter_jax."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transmuter_jax"
