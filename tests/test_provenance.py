"""onnx.provenance: what a graph's run derives once from a value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from transmuter_jax.onnx import provenance


def test_a_derived_value_is_made_once_a_run():
    """The same value and name give the first result back within one run; another name, a
    subgraph's run (traced apart) and a later run make their own."""
    made = []

    def make():
        made.append(None)
        return object()

    def traced(x):
        with provenance.scope():
            first = provenance.derived(x, "rows", make)
            assert provenance.derived(x, "rows", make) is first
            assert provenance.derived(x, "other", make) is not first
            with provenance.scope():  # a subgraph's run
                inner = provenance.derived(x, "rows", make)
                assert inner is not first
                assert provenance.derived(x, "rows", make) is inner
            assert provenance.derived(x, "rows", make) is first
        return x

    jax.jit(traced)(jnp.zeros(2))
    assert len(made) == 3
    jax.jit(traced).lower(jnp.ones(3))  # another run
    assert len(made) == 6


def test_outside_a_run_or_on_host_values_it_is_made_each_time():
    made = []

    def make():
        made.append(None)
        return len(made)

    x = jnp.zeros(2)
    assert provenance.derived(x, "rows", make) == 1
    assert provenance.derived(x, "rows", make) == 2
    host = np.zeros(2)
    with provenance.scope():
        assert provenance.derived(host, "rows", make) == 3
        assert provenance.derived(host, "rows", make) == 4
