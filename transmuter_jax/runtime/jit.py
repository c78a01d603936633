"""The XLA compiler options the library's programs are compiled with."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

# On CPU, XLA's default alias analysis copies a donated buffer that is read and then updated in
# place (a KV cache read by attention and given its new rows): every cache buffer, twice a step.
# Region analysis sees that the reads come first and drops the copies.
#
# XLA hands some dots, reductions and elementwise fusions to YNNPACK, whose tiling depends on the
# number of rows: a row's RMS norm or attention then differs in the last bit between batch 1 and
# batch 8, which int8-quantized products (MatMulNBits accuracy_level 4) turn into other tokens.
# With XLA's own emitters (and the library's kernels for the large products) each row is
# computed alike at any batch.
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True, YNN_OPTION: ""}


@functools.cache
def cpu_options() -> dict[str, Any]:
    """:data:`CPU_OPTIONS` less the YNNPACK option where this XLA does not know it (older)."""
    options = dict(CPU_OPTIONS)
    try:
        from jax._src import config

        with config.enable_compilation_cache(False):  # the probe stays out of every cache
            jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except Exception:  # noqa: BLE001 - an XLA without YNNPACK fusions: nothing to turn off
        options.pop(YNN_OPTION)
    return options


def jit_options(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``options`` for ``jax.jit`` with the library's compiler options added (the caller's
    ``compiler_options`` win)."""
    options = dict(options or {})
    if jax.default_backend() == "cpu":
        options["compiler_options"] = {**cpu_options(), **options.get("compiler_options", {})}
    return options


def put(value: Any, dtype: Any = None) -> jax.Array:
    """``value`` (a host value) as a device array, copied without compiling a program:
    ``jnp.asarray`` or ``jnp.full`` of a host value compiles one per shape and dtype, 10 to 60
    ms each in a new process, on the way to its first token. Not for traced code."""
    return jax.device_put(np.asarray(value, dtype))


def put_all(tree: Any) -> Any:
    """``tree`` with its numpy leaves as device arrays, copied in one call (see :func:`put`:
    one ``device_put`` per array costs ~0.1 ms of the host's time each)."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [i for i, a in enumerate(leaves) if isinstance(a, np.ndarray)]
    for i, a in zip(host, jax.device_put([leaves[i] for i in host]), strict=True):
        leaves[i] = a
    return jax.tree.unflatten(treedef, leaves)


def filled(shape: int | tuple[int, ...], value: Any, dtype: Any) -> jax.Array:
    """``jnp.full(shape, value, dtype)`` without compiling a program (see :func:`put`)."""
    return jax.device_put(np.full(shape, value, dtype))
