"""The one switch of the CPU kernels, and the environment variables that change a trace.

The kernels run in a program being traced when they are wanted (``TRANSMUTER_JAX_KERNELS`` does
not turn them off), their library is loaded on the CPU backend (:mod:`transmuter_jax.kernels`
tells this module with :func:`provide`), and the program does not run over a mesh: programs
whose arguments span several devices are traced inside :func:`off`, because XLA's partitioner
cannot split the kernels' custom calls (it would gather their operands on each device).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

KERNELS_ENV = "TRANSMUTER_JAX_KERNELS"
OFF_VALUES = ("0", "off", "false", "no")
# "1": MatMulNBits runs its portable code even where the CPU has AVX512-VNNI (for testing).
PORTABLE_ENV = "TRANSMUTER_JAX_KERNEL_PORTABLE"
# "0": MatMulNBits at accuracy_level 4 dequantizes exactly instead of quantizing to int8.
INT8_ENV = "TRANSMUTER_JAX_NBITS_INT8"
# Environment switches read while tracing (they change the traced program): their values are
# part of every compile key, so a program traced under one setting is never reused under another.
TRACE_ENVIRONMENT = (KERNELS_ENV, PORTABLE_ENV, INT8_ENV)

_OFF = contextvars.ContextVar("transmuter_jax_kernels_off", default=False)
_available: Callable[[], bool] = lambda: False  # noqa: E731 - until the kernels say otherwise


def trace_environment() -> tuple[tuple[str, str | None], ...]:
    """The values of the :data:`TRACE_ENVIRONMENT` switches now."""
    return tuple((name, os.environ.get(name)) for name in TRACE_ENVIRONMENT)


def int8_activations(accuracy_level: int) -> bool:
    """Whether a MatMulNBits node of ``accuracy_level`` quantizes its input to int8: at level 4,
    unless ``TRANSMUTER_JAX_NBITS_INT8=0``."""
    return accuracy_level == 4 and os.environ.get(INT8_ENV, "").strip() != "0"


def wanted() -> bool:
    """Whether ``TRANSMUTER_JAX_KERNELS`` leaves the kernels on."""
    return os.environ.get(KERNELS_ENV, "").strip().lower() not in OFF_VALUES


def provide(available: Callable[[], bool]) -> None:
    """Called by the kernels' package: ``available()`` says whether their library is loaded."""
    global _available
    _available = available


def here() -> bool:
    """Whether the kernels run on this backend, outside any :func:`off` block."""
    return jax.default_backend() == "cpu" and _available()


def enabled() -> bool:
    """Whether the kernels run in what is traced now: :func:`here`, and no :func:`off` block."""
    return not _OFF.get() and here()


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Traces without the kernels inside the block."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def spans_devices(tree: Any) -> bool:
    """Whether an array of ``tree`` lies on more than one device (a mesh)."""
    return any(
        isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in jax.tree.leaves(tree)
    )


def off_over_mesh(tree: Any) -> contextlib.AbstractContextManager:
    """:func:`off` where an array of ``tree`` spans several devices, else nothing: the one rule
    for the kernels over a mesh."""
    return off() if spans_devices(tree) else contextlib.nullcontext()
