"""Asks the kernel for 2 MiB pages on the memory maps that hold weights.

A decode step reads every matrix-product weight once. Read through 4 KiB pages, the CPU spends
part of each step translating addresses: on the default fp32 model a step ran 1.2x faster with
its weights on 2 MiB pages (an AVX-512 Xeon, benchmarks/README.md). :func:`advise` marks a
mapping ``MADV_HUGEPAGE`` before its first access; Linux then reads a file mapped that way into
2 MiB page-cache pages and maps them whole, still shared with every other process mapping the
file. A file's pages already in the page cache keep their size, so a file just written (in
small pages, by the write path) is first dropped from it (:func:`uncache`): written out, then
read back into 2 MiB pages by its first map. The page cache may also split a file's 2 MiB
pages later (reclaim, memory pressure), and every map then reads it through small pages (the
default fp32 model decoded ~16% slower): :func:`mapped` maps a file, faults it in and, where part
but not most of it is mapped whole, drops the file's pages and reads it again, once. All of them
do nothing where the system gives no huge pages (``transparent_hugepage`` set to ``never``, not
Linux) or where ``TRANSMUTER_JAX_HUGE_PAGES`` is ``0``, ``off``, ``false`` or ``no``.
"""

from __future__ import annotations

import mmap
import os

ENV = "TRANSMUTER_JAX_HUGE_PAGES"
SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
SMAPS = "/proc/self/smaps"
HUGE = 2 << 20
WHOLE = 0.5  # below this share mapped whole (and above none), a file's pages were split
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14: fault the map in


def available() -> bool:
    """Whether :func:`advise` asks: not turned off, and the kernel gives huge pages on request
    (``always`` or ``madvise``)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(SETTING) as file:
            setting = file.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def advise(mapping: mmap.mmap) -> bool:
    """Marks the whole of ``mapping`` for huge pages; whether the kernel took the advice."""
    if not available() or len(mapping) == 0:
        return False
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def uncache(fd: int) -> bool:
    """Writes the open file ``fd`` out and drops its pages from the page cache, so that a later
    map advised by :func:`advise` reads it into 2 MiB pages (a file just written sits in the
    page cache in the write path's pages, which its maps then use); whether it was dropped."""
    if not available() or not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def mapped(fd: int) -> mmap.mmap:
    """The open file ``fd`` mapped read-only, advised by :func:`advise`; where the page cache
    holds the file in pages split since they were read (some of it mapped whole, less than
    :data:`WHOLE`), its pages are dropped (:func:`uncache`) and it is mapped and read again."""
    mapping = _advised(fd)
    share = whole_share(mapping) if len(mapping) >= 2 * HUGE else None
    if share is None or share == 0.0 or share >= WHOLE:  # none whole: no 2 MiB pages here
        return mapping
    mapping.close()
    dropped = uncache(fd)
    mapping = _advised(fd)
    if dropped:
        whole_share(mapping)  # read back into 2 MiB pages now, as the first map did
    return mapping


def whole_share(mapping: mmap.mmap) -> float | None:
    """The share of ``mapping`` mapped in 2 MiB pages once faulted in (it is, all of it), from
    /proc/self/smaps; None where that cannot be told."""
    if not available():
        return None
    try:
        mapping.madvise(POPULATE_READ)
    except (OSError, ValueError):
        return None
    import numpy as np  # the map's address

    start = np.frombuffer(mapping, np.uint8, count=1).ctypes.data
    fields = _smaps_entry(start)
    if fields is None or "FilePmdMapped" not in fields or not fields.get("Size"):
        return None
    return fields["FilePmdMapped"] / fields["Size"]


def _advised(fd: int) -> mmap.mmap:
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    advise(mapping)  # before the first access
    return mapping


def _smaps_entry(start: int) -> dict[str, int] | None:
    """The sizes (kB) of the /proc/self/smaps entry of the mapping that starts at ``start``."""
    head = f"{start:x}-"
    try:
        with open(SMAPS) as file:
            for line in file:
                if not line.startswith(head):
                    continue
                sizes = {}
                for line in file:
                    name, _, rest = line.partition(":")
                    if name == "VmFlags":
                        break
                    value = rest.split()
                    if value and value[0].isdigit():
                        sizes[name] = int(value[0])
                return sizes
    except OSError:
        return None
    return None
