"""Prompt lookup's drafts: the per-slot state of speculative decoding and the n-gram proposer.

A slot that speculates drafts up to ``lookup`` tokens each step by finding its last n tokens
(n from ``ngram`` down to 1) earlier in its own tokens (prompt and new ones) and copying what
followed them, as transformers' ``PromptLookupCandidateGenerator`` does (its first match). The
search runs on the device, traced inside the decode loop (see :mod:`.speculative`).

How many it drafts follows transformers' heuristic schedule (:func:`adapted`), except that,
where a step of two tokens costs more than one (a CPU), a prompt-lookup slot's k falls to 0:
paused (plain one-token steps) until its proposer's first token would have been the target's
(``guess``). A miss costs a verification longer than a plain step, and an open-ended text
misses nearly every time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.jit import filled
from ..runtime.stored import storable


@storable
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
    """Each slot's speculation, on the device ([B] int32).

    lookup: the most drafted tokens (prompt_lookup_num_tokens or num_assistant_tokens; 0: the
    slot does not speculate). ngram: the longest n-gram matched (max_matching_ngram_size).
    model: [B] bool the assistant model drafts (else prompt lookup). adaptive: [B] bool k
    follows the heuristic schedule. k: the drafted tokens of the next step (1 to lookup).
    drafted, accepted: tokens drafted and accepted so far. steps: verification steps so far.
    rate: [B] float32 how often the first draft was kept lately (each verification, or each
    step's guess where the slot drafted nothing, weighs half; 0.5 at first), which prices a
    longer step (:func:`worth`). cache: the assistant model's cache by input name (empty
    without one), its valid rows the slot's (the same tokens as the target's).
    """

    lookup: jax.Array
    ngram: jax.Array
    k: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    steps: jax.Array
    model: jax.Array
    adaptive: jax.Array
    rate: jax.Array
    cache: dict[str, jax.Array]


def empty(
    batch: int,
    lookup: int = 0,
    ngram: int = 0,
    model: bool = False,
    adaptive: bool = True,
    cache: dict[str, jax.Array] | None = None,
    host: bool = False,
) -> Drafts:
    """Drafts of ``batch`` slots that draft up to ``lookup`` tokens (from ``ngram``-grams, or
    with the assistant model whose cache is ``cache``); ``host``: numpy arrays (for one copy of
    a tree, :func:`~transmuter_jax.runtime.jit.put_all`)."""
    make = (lambda s, v, t: np.full(s, v, t)) if host else filled  # noqa: E731
    full = lambda v: make(batch, v, np.int32)  # noqa: E731
    flag = lambda v: make(batch, v, bool)  # noqa: E731
    return Drafts(full(lookup), full(ngram), full(lookup), full(0), full(0), full(0),
                  flag(model), flag(adaptive), make(batch, 0.5, np.float32),
                  dict(cache or {}))  # fmt: skip


def propose(history, length, drafts: Drafts, limit, width: int, longest: int):
    """Each slot's drafted tokens (traced).

    Args:
        history: [B, H] int32 each slot's tokens (prompt, then new ones), -1 after them.
        length: [B] int32 the slot's tokens (its last one is the next input).
        drafts: the slots' :class:`Drafts`.
        limit: [B] int32 the most tokens each slot may draft now.
        width: the drafted tokens' columns (static).
        longest: the longest n-gram of any slot (static).

    Returns:
        (tokens [B, width] int32, count [B] int32: the first ``count`` of a slot's tokens are
        drafts, the rest padding; guess [B] int32: the first token the n-grams propose whatever
        the slot's k, -1 where they propose none)
    """
    batch, columns = history.shape
    index = jnp.arange(columns)[None, :]
    start = jnp.zeros(batch, jnp.int32)
    have = jnp.zeros(batch, bool)
    for n in range(longest, 0, -1):  # the longest n-gram that occurs earlier wins
        match = (index + n < length[:, None]) & (n <= drafts.ngram)[:, None]
        for i in range(n):  # window [p, p + n) equals the last n tokens
            last = jnp.take_along_axis(history, jnp.maximum(length - n + i, 0)[:, None], axis=1)
            shifted = jnp.pad(history, ((0, 0), (0, i)), constant_values=-1)[:, i:]
            match = match & (shifted == last)
        found = jnp.any(match, axis=1) & (length > n)
        first = jnp.argmax(match, axis=1).astype(jnp.int32)  # transformers takes the first
        start = jnp.where(found & ~have, first + n, start)
        have = have | found
    at = start[:, None] + jnp.arange(width)[None, :]
    tokens = jnp.take_along_axis(history, jnp.minimum(at, columns - 1), axis=1)
    k = jnp.minimum(jnp.minimum(drafts.k, drafts.lookup), limit)
    valid = have[:, None] & (at < length[:, None]) & (jnp.arange(width)[None, :] < k[:, None])
    count = jnp.sum(valid, axis=1).astype(jnp.int32)  # valid columns are a prefix
    guess = jnp.where(have & (start < length), tokens[:, 0], -1).astype(jnp.int32)
    return jnp.where(valid, tokens, 0), count, guess


def adapted(drafts: Drafts, count, accepted, live, guessed, hit, pause: bool = True) -> Drafts:
    """The drafts after a verification: the counters, each slot's rate, and its next k by
    transformers' heuristic schedule (all drafts accepted: k + 2, at most lookup; else k - 1, at
    least 1), except that with ``pause`` (static) a prompt-lookup slot's k falls to 0 (paused),
    and ``hit`` ([B] bool: its proposer's guess, where ``guessed`` [B] it made one, was the
    token the target chose) takes a paused slot back to 1."""
    tried = live & (count > 0)
    grown = jnp.minimum(drafts.k + 2, drafts.lookup)
    lookup = ~drafts.model
    shrunk = jnp.maximum(drafts.k - 1, jnp.where(lookup & pause, 0, 1))
    k = jnp.where(tried & drafts.adaptive, jnp.where(accepted == count, grown, shrunk), drafts.k)
    paused = live & drafts.adaptive & lookup & (drafts.k == 0)
    k = jnp.where(paused & hit, jnp.minimum(drafts.lookup, 1), k)
    # the first draft kept, or (prompt lookup, nothing drafted) the guess right
    told = tried | (live & lookup & guessed)
    first = jnp.where(tried, accepted > 0, hit).astype(jnp.float32)
    rate = jnp.where(told, 0.5 * drafts.rate + 0.5 * first, drafts.rate)
    return dataclasses.replace(
        drafts,
        k=k.astype(jnp.int32),
        rate=rate.astype(jnp.float32),
        drafted=drafts.drafted + jnp.where(live, count, 0),
        accepted=drafts.accepted + jnp.where(live, accepted, 0),
        steps=drafts.steps + live.astype(jnp.int32),
    )


CONTINUE = 0.8  # the chance that a draft after a kept one is kept too (a copied run goes on)


def worth(drafts: Drafts, count, live, sizes, row_cost: float):
    """[N] each step length of ``sizes`` (static, [N]) priced: the tokens a verification of
    that length is expected to give the live slots (one each, and of m drafts rate x (1 +
    CONTINUE + ... + CONTINUE^(m-1)) kept) over its cost, ``row_cost`` + the rows it runs (live
    slots x length; ``row_cost``: a step's cost apart from its rows, in rows: reading the
    weights)."""
    width = int(max(sizes)) - 1
    runs = np.concatenate([[0.0], np.cumsum(CONTINUE ** np.arange(width))]).astype(np.float32)
    expected = drafts.rate[:, None] * jnp.asarray(runs)[None, :]  # [B, width + 1] by m
    n = jnp.sum(live)
    values = []
    for size in sizes:
        drafts_in = jnp.minimum(jnp.where(live, count, 0), size - 1)  # [B]
        gain = jnp.sum(jnp.take_along_axis(expected, drafts_in[:, None], axis=1))
        values.append((n + gain) / (row_cost + n * size))
    return jnp.stack(values)
