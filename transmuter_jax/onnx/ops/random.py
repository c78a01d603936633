"""Random ops: RandomUniform, RandomNormal, their *Like forms, Bernoulli and Multinomial.

The values come from JAX's generator seeded by the ``seed`` attribute (0 without one): they
are not bit-equal to onnxruntime's or numpy's, and a node draws the same values at every call,
since the key is fixed when the graph is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import op
from ._util import onnx_dtype


def _key(seed):
    return jax.random.key(int(seed) if seed is not None else 0)


def _dtype(dtype, like=None):
    if dtype is None:
        return jnp.float32 if like is None else jnp.asarray(like).dtype
    return onnx_dtype(dtype, jnp)


@op("RandomUniform", fold=False)
def RandomUniform(*, dtype=1, high=1.0, low=0.0, seed=None, shape):
    """Uniform values in [low, high) of ``shape``."""
    values = jax.random.uniform(_key(seed), tuple(shape), jnp.float32, low, high)
    return values.astype(_dtype(dtype))


@op("RandomNormal", fold=False)
def RandomNormal(*, dtype=1, mean=0.0, scale=1.0, seed=None, shape):
    """Normal values of ``mean`` and standard deviation ``scale``, of ``shape``."""
    values = mean + scale * jax.random.normal(_key(seed), tuple(shape), jnp.float32)
    return values.astype(_dtype(dtype))


@op("RandomUniformLike", fold=False)
def RandomUniformLike(input, *, dtype=None, high=1.0, low=0.0, seed=None):
    """Uniform values in [low, high) of input's shape (and dtype, unless given)."""
    values = jax.random.uniform(_key(seed), jnp.shape(input), jnp.float32, low, high)
    return values.astype(_dtype(dtype, input))


@op("RandomNormalLike", fold=False)
def RandomNormalLike(input, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    """Normal values of input's shape (and dtype, unless given)."""
    values = mean + scale * jax.random.normal(_key(seed), jnp.shape(input), jnp.float32)
    return values.astype(_dtype(dtype, input))


@op("Bernoulli", since=15, fold=False)
def Bernoulli(input, *, dtype=None, seed=None):
    """1 with probability input, else 0, per element."""
    p = jnp.asarray(input)
    draws = jax.random.uniform(_key(seed), p.shape, jnp.float32) < p.astype(jnp.float32)
    return draws.astype(_dtype(dtype, input))


@op("Multinomial", since=7, fold=False)
def Multinomial(input, *, dtype=6, sample_size=1, seed=None):
    """``sample_size`` class draws per row of the unnormalized log-probabilities input [B, C]."""
    logits = jnp.asarray(input).astype(jnp.float32)
    draws = jax.random.categorical(
        _key(seed), logits[:, None, :], axis=-1, shape=(logits.shape[0], sample_size)
    )
    return draws.astype(_dtype(dtype))
