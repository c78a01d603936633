"""Asks the kernel for 2 MiB pages on the memory maps that hold weights.

A decode step reads every matrix-product weight once. Read through 4 KiB pages, the CPU spends
part of each step translating addresses: on the default fp32 model a step ran 1.2x faster with
its weights on 2 MiB pages (an AVX-512 Xeon, benchmarks/README.md). :func:`advise` marks a
mapping ``MADV_HUGEPAGE`` before its first access; Linux then reads a file mapped that way into
2 MiB page-cache pages and maps them whole, still shared with every other process mapping the
file. A file's pages already in the page cache keep their size, so a file just written (in
small pages, by the write path) is first dropped from it (:func:`uncache`): written out, then
read back into 2 MiB pages by its first map. Both do nothing where the system gives no huge
pages (``transparent_hugepage`` set to ``never``, not Linux) or where
``TRANSMUTER_JAX_HUGE_PAGES`` is ``0``, ``off``, ``false`` or ``no``.
"""

from __future__ import annotations

import mmap
import os

ENV = "TRANSMUTER_JAX_HUGE_PAGES"
SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


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
