"""The one cache of compiled generation programs, keyed by what determines them.

A key names the graph (its fingerprint), the cache mode, the placement, the options a program
closes over and the jit options; the shapes of the arguments pick a compiled program inside
each entry (:class:`~transmuter_jax.stored.StoredJit`). Specifications and engines that agree
on a key share its programs, whichever of them compiled it first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

KEEP = 256  # entries kept; the least recently used go first

_PROGRAMS: OrderedDict[Hashable, Any] = OrderedDict()
_LOCK = threading.Lock()


def program(key: Hashable, make: Callable[[], Any]) -> Any:
    """The program of ``key``, made by ``make()`` the first time."""
    with _LOCK:
        found = _PROGRAMS.get(key)
        if found is not None:
            _PROGRAMS.move_to_end(key)
            return found
    made = make()
    with _LOCK:
        found = _PROGRAMS.setdefault(key, made)
        _PROGRAMS.move_to_end(key)
        while len(_PROGRAMS) > KEEP:
            _PROGRAMS.popitem(last=False)
        return found


def count() -> int:
    """How many entries the cache holds."""
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
