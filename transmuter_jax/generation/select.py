"""The compiled token selection: logits in, one int32 array out.

The selection is a jitted function of its own, apart from the decoder step. Greedy selection
takes the argmax; sampling applies temperature, top-k and top-p (transformers' order) and draws
with a key derived from the row's seed and its step, so a row's tokens do not depend on the other
rows of its batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The smallest finite float32: removed tokens get it, never -inf.
LOWEST = float(np.finfo(np.float32).min)


def _top_k(scores: jax.Array, k: int, keep: int) -> jax.Array:
    k = min(max(k, keep), scores.shape[-1])
    threshold = jax.lax.top_k(scores, k)[0][..., -1:]
    return jnp.where(scores < threshold, LOWEST, scores)


def _top_p(scores: jax.Array, p: float, keep: int) -> jax.Array:
    # transformers: sort ascending, drop the tokens whose cumulative probability is <= 1 - p,
    # but always keep the last ``keep``.
    order = jnp.argsort(scores, axis=-1)
    ascending = jnp.take_along_axis(scores, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = cumulative <= 1 - p
    drop = drop.at[..., -keep:].set(False)
    removed = jnp.zeros_like(drop).at[jnp.arange(scores.shape[0])[:, None], order].set(drop)
    return jnp.where(removed, LOWEST, scores)


def selection(options: Mapping[str, Any], **jit_options: Any):
    """The jitted selection ``(logits [B, V], seeds [B], steps [B]) -> tokens [B] int32``."""
    sample = bool(options.get("do_sample"))
    temperature = float(options.get("temperature") or 1.0)
    top_k = int(options.get("top_k") or 0)
    top_p = float(options["top_p"]) if options.get("top_p") is not None else 1.0
    keep = int(options.get("min_tokens_to_keep") or 1)

    def select(logits, seeds, steps):
        scores = logits.astype(jnp.float32)
        if not sample:
            return jnp.argmax(scores, axis=-1).astype(jnp.int32)
        if temperature != 1.0:
            scores = scores / temperature
        if top_k > 0:
            scores = _top_k(scores, top_k, keep)
        if top_p < 1.0:
            scores = _top_p(scores, top_p, keep)

        def draw(row_scores, seed, step):
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.categorical(key, row_scores)

        return jax.vmap(draw)(scores, seeds, steps).astype(jnp.int32)

    return jax.jit(select, **jit_options)
