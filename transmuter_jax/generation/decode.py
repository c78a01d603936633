"""The one rule that ends a row, which every decode step follows (the slots' step, the host's).

generate()'s device chunks are the slots' step in a loop (:mod:`.chunk`); the state they run
over is :class:`DecodeState` (the slots' per-row arrays).
"""

from __future__ import annotations

import jax.numpy as jnp


def end_of_row(chosen, live, eos, count, max_new):
    """The one rule that ends a row (traced; the host's steps follow it too): a live row that
    takes an eos id ends without keeping it; one that keeps its ``max_new``-th token ends.

    Args:
        chosen: [B] the selected tokens. live: [B] rows that took a token. eos: [E] or [B, E]
            eos ids (-1: none). count: [B] tokens kept before. max_new: [B] the most new tokens.

    Returns:
        (ends [B] an eos, kept [B] the token kept, count [B] after, done [B] no more tokens)
    """
    ends = jnp.any(chosen[:, None] == eos, axis=-1) & live
    kept = live & ~ends
    count = count + kept.astype(jnp.int32)
    return ends, kept, count, ends | (kept & (count >= max_new))
