"""The one cache of compiled generation programs, keyed by what determines them.

A key names the graph (its fingerprint), the cache mode, the placement, the options a program
closes over and the jit options; the shapes of the arguments pick a compiled program inside
each entry (:class:`~transmuter_jax.stored.StoredJit`). Specifications and engines that agree
on a key share its programs, whichever of them compiled it first.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

_PROGRAMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def program(key: Hashable, make: Callable[[], Any], holder: dict | None = None) -> Any:
    """The program of ``key``, made by ``make()`` the first time.

    The cache holds programs weakly: an engine keeps the programs it runs (in ``holder``, or as
    its attributes), so a program lives while one of the engines that share it does, and the
    weights its graph closes over go with the last of them.
    """
    with _LOCK:
        found = _PROGRAMS.get(key)
    if found is None:
        made = make()
        with _LOCK:
            found = _PROGRAMS.setdefault(key, made)
    if holder is not None:
        holder[key] = found
    return found


def count() -> int:
    """How many programs the cache holds (those some engine keeps)."""
    return len(_PROGRAMS)


def placement_key(placement: Any) -> Hashable:
    """What a program reads of a placement: the mesh (its axes and devices) and the cache's
    partition specs; None without one."""
    if placement is None:
        return None
    mesh = placement.mesh
    devices = tuple(int(d.id) for d in mesh.devices.flat)
    return (tuple(mesh.axis_names), mesh.devices.shape, devices,
            tuple(sorted((k, str(v)) for k, v in placement.cache.items())))  # fmt: skip


def jit_key(options: Any) -> str:
    """The jit options as a stable string."""
    return repr(sorted(dict(options or {}).items()))
