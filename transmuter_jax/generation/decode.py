"""The one rule that ends a row, which every decode step follows: the slots' step (and so
generate()'s device chunks, :mod:`.chunk`), the host's selection, speculative verification.

The state the steps run over is :class:`~.slots.DecodeRows` (``generation.DecodeState``).
"""

from __future__ import annotations

import jax.numpy as jnp


def end_of_row(chosen, live, eos, count, max_new, xp=jnp):
    """The one rule that ends a row: a live row that takes an eos id ends without keeping it;
    one that keeps its ``max_new``-th token ends.

    Args:
        chosen: [B] the selected tokens. live: [B] rows that took a token. eos: [E] or [B, E]
            eos ids (-1: none). count: [B] tokens kept before. max_new: [B] the most new tokens.
        xp: jax.numpy (traced, the default) or numpy (the host's selection of a task's own
            processors).

    Returns:
        (ends [B] an eos, kept [B] the token kept, count [B] after, done [B] no more tokens)
    """
    ends = xp.any(chosen[:, None] == eos, axis=-1) & live
    kept = live & ~ends
    count = count + kept.astype(xp.int32)
    return ends, kept, count, ends | (kept & (count >= max_new))
