"""The logits processors of transformers 4.57, applied in the compiled selection.

``ctx.processors`` is the ordered list. A built-in processor is named by a string (its order
follows transformers' ``_get_logits_processor``); "bad_words" and "suppress_tokens" stand for two
masks that do not change between steps. A task's own processor is a pair ``(state, process)``:
``state(row)`` gives an array of the same shape every step from ``{"prompt", "generated" (last
first), "vocab"}``, and ``process(logits, state)`` changes one row's logits in the compiled
selection.

Removed tokens get the smallest finite float32 (LOWEST), never -inf, and no score goes below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.stored import storable
from .options import Options

LOWEST = float(np.finfo(np.float32).min)

# transformers' order, before the task's processors (the warpers come after them: select.py).
ORDER = (
    "sequence_bias",
    "encoder_repetition_penalty",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words",
    "min_length",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
)
HIGHEST = float(np.finfo(np.float32).max)
# Built-in processors that only set scores to LOWEST: scores clamped to LOWEST before stay so.
KEEPS_CLAMPED = frozenset({"min_length", "suppress_tokens", "begin_suppress_tokens"})


def clamped(scores: jax.Array, processor: Any, before: bool) -> jax.Array:
    """The scores after ``processor``, clamped to LOWEST: as they are where the scores before it
    were clamped (``before``) and it keeps them so (a [B, V] pass less a step)."""
    if before and isinstance(processor, str) and processor in KEEPS_CLAMPED:
        return scores
    return jnp.maximum(scores, LOWEST)


@storable
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows:
    """What the processors read of each row, on the device.

    Attributes:
        history: [B, H] int32 the row's tokens (prompt, then new ones), -1 after them.
        prompt: [B] int32 prompt length (the decoder prompt of an encoder-decoder).
        length: [B] int32 tokens of the row: prompt + new tokens, as input_ids' columns.
        max_length: [B] int32 prompt length + max_new_tokens.
        encoder: [B, E] int32 the encoder's input ids (a decoder-only model's: the prompt), -1
            after them; None where no processor reads them.
    """

    history: jax.Array
    prompt: jax.Array
    length: jax.Array
    max_length: jax.Array
    encoder: jax.Array | None = None


def from_options(options: Options) -> list[Any]:
    """The built-in processors that ``options`` switch on, in transformers' order."""
    eos = options.eos_token_id
    on = {
        "sequence_bias": options.sequence_bias is not None,
        "remove_invalid_values": options.remove_invalid_values is True,
        "exponential_decay_length_penalty": options.exponential_decay_length_penalty is not None,
        "repetition_penalty": options.repetition_penalty not in (None, 1.0),
        "encoder_repetition_penalty": options.encoder_repetition_penalty not in (None, 1.0),
        "no_repeat_ngram_size": (options.no_repeat_ngram_size or 0) > 0,
        "encoder_no_repeat_ngram_size": (options.encoder_no_repeat_ngram_size or 0) > 0,
        "bad_words": options.bad_words_ids is not None,
        "min_length": bool(eos)
        and ((options.min_length or 0) > 0 or (options.min_new_tokens or 0) > 0),
        "forced_bos_token_id": options.forced_bos_token_id is not None,
        "forced_eos_token_id": options.forced_eos_token_id is not None,
        "suppress_tokens": options.suppress_tokens is not None,
        "begin_suppress_tokens": options.begin_suppress_tokens is not None,
    }
    return [name for name in ORDER if on[name]]


def static_masks(options: Options, vocab: int) -> dict[str, np.ndarray]:
    """The two masks that do not change between steps: one-token bad words and suppress_tokens."""
    eos = set(options.eos_token_id)
    bad = np.zeros(vocab, bool)
    for words in options.bad_words_ids or ():
        if len(words) == 1 and words[0] not in eos:  # transformers never bans a lone eos token
            bad[words[0]] = True
    suppress = np.zeros(vocab, bool)
    suppress[list(options.suppress_tokens or [])] = True
    return {"bad_words": bad, "suppress_tokens": suppress}


def _only(scores: jax.Array, tokens: Sequence[int], when: jax.Array) -> jax.Array:
    """Rows where ``when``: every score LOWEST but ``tokens``, which get 0."""
    keep = jnp.zeros(scores.shape[-1], bool).at[jnp.asarray(tokens)].set(True)
    forced = jnp.where(keep, 0.0, LOWEST)
    return jnp.where(when[:, None], forced, scores)


def _remove(scores: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask, LOWEST, scores)


def _seen(history: jax.Array, vocab: int) -> jax.Array:
    """[B, V] whether each token occurs in the row's history."""
    rows = jnp.arange(history.shape[0])[:, None]
    ids = jnp.where(history < 0, vocab, history)  # -1 padding lands out of range: dropped
    return jnp.zeros((history.shape[0], vocab), bool).at[rows, ids].set(True, mode="drop")


def _no_repeat(scores: jax.Array, rows: Rows, n: int) -> jax.Array:
    """Bans each token that would complete an n-gram already in the row."""
    history, length = rows.history, rows.length
    b, h = history.shape
    if h < n:
        return scores
    starts = jnp.arange(h - n + 1)  # n-gram i covers history[i : i + n]
    last = length[:, None] - (n - 1) + jnp.arange(n - 1)[None, :]  # [B, n-1] positions
    prefix = jnp.take_along_axis(history, jnp.clip(last, 0, h - 1), axis=1)  # [B, n-1]
    match = starts[None, :] + n - 1 < length[:, None]  # the n-gram lies in the row
    for k in range(n - 1):
        match &= history[:, k : h - n + 1 + k] == prefix[:, k : k + 1]
    match &= (length + 1 >= n)[:, None]
    banned_ids = jnp.where(match, history[:, n - 1 :], scores.shape[-1])
    rows_index = jnp.arange(b)[:, None]
    banned = jnp.zeros(scores.shape, bool).at[rows_index, banned_ids].set(True, mode="drop")
    return _remove(scores, banned)


def _encoder_no_repeat(scores: jax.Array, rows: Rows, n: int) -> jax.Array:
    """Bans each token that follows, in the encoder's ids, the row's last n - 1 tokens."""
    encoder, history, length = rows.encoder, rows.history, rows.length
    b, e = encoder.shape
    if e < n:
        return scores
    h = history.shape[1]
    last = length[:, None] - (n - 1) + jnp.arange(n - 1)[None, :]  # [B, n-1] positions
    prefix = jnp.take_along_axis(history, jnp.clip(last, 0, h - 1), axis=1)
    follows = encoder[:, n - 1 :]  # [B, e-n+1] the token after each encoder (n-1)-gram
    match = (follows >= 0) & (length >= n - 1)[:, None]  # shorter rows match nothing
    for k in range(n - 1):
        match &= encoder[:, k : e - n + 1 + k] == prefix[:, k : k + 1]
    banned_ids = jnp.where(match, follows, scores.shape[-1])
    rows_index = jnp.arange(b)[:, None]
    banned = jnp.zeros(scores.shape, bool).at[rows_index, banned_ids].set(True, mode="drop")
    return _remove(scores, banned)


def _after(rows: Rows, prefix: Sequence[int]) -> jax.Array:
    """[B] whether each row's tokens end with ``prefix`` (empty: every row)."""
    history, length = rows.history, rows.length
    match = jnp.ones(history.shape[0], bool)
    for k, token in enumerate(prefix):  # prefix[k] at position length - len(prefix) + k
        at = jnp.clip(length - len(prefix) + k, 0, history.shape[1] - 1)
        match &= jnp.take_along_axis(history, at[:, None], axis=1)[:, 0] == token
    return match & (length >= len(prefix) + 1)  # transformers: the sequence fits the row


def _sequence_bias(scores: jax.Array, rows: Rows, pairs) -> jax.Array:
    """Adds each (ids, bias) to the score of its last id where the row ends with the others."""
    single = np.zeros(scores.shape[-1], np.float32)
    for ids, bias in pairs:
        if len(ids) == 1:
            single[ids[0]] += bias
    bias = jnp.broadcast_to(jnp.asarray(single), scores.shape)
    for ids, value in pairs:
        if len(ids) > 1:
            hit = jnp.where(_after(rows, ids[:-1]), jnp.float32(value), jnp.float32(0))
            bias = bias.at[:, ids[-1]].add(hit)
    return scores + bias


def _banned_sequences(scores: jax.Array, rows: Rows, sequences) -> jax.Array:
    """Bans the last id of each multi-token bad word where the row ends with its other ids."""
    for ids in sequences:
        if len(ids) > 1:
            column = jnp.where(_after(rows, ids[:-1]), LOWEST, scores[:, ids[-1]])
            scores = scores.at[:, ids[-1]].set(column)
    return scores


def _decay(scores: jax.Array, rows: Rows, options: Options) -> jax.Array:
    """exponential_decay_length_penalty: raises the eos scores after start + the prompt."""
    start, factor = options.exponential_decay_length_penalty
    eos = jnp.asarray(list(options.eos_token_id), jnp.int32)
    if eos.size == 0:
        return scores
    past = rows.length - (start + rows.prompt)  # [B]
    grow = jnp.power(jnp.float32(factor), past.astype(jnp.float32)) - 1
    columns = scores[:, eos]
    raised = columns + jnp.abs(columns) * grow[:, None]
    return scores.at[:, eos].set(jnp.where((past > 0)[:, None], raised, columns))


def apply_builtin(
    name: str,
    scores: jax.Array,
    rows: Rows,
    options: Options,
    masks: Mapping[str, jax.Array],
) -> jax.Array:
    """One built-in processor on scores [B, V]."""
    vocab = scores.shape[-1]
    eos = list(options.eos_token_id)
    if name == "repetition_penalty":
        penalty = float(options.repetition_penalty)
        penalized = jnp.where(scores < 0, scores * penalty, scores / penalty)
        return jnp.where(_seen(rows.history, vocab), penalized, scores)
    if name == "encoder_repetition_penalty":
        # transformers keeps 1 / penalty and multiplies negative scores by it, divides others
        inverse = jnp.float32(1 / float(options.encoder_repetition_penalty))
        changed = jnp.where(scores < 0, scores * inverse, scores / inverse)
        return jnp.where(_seen(rows.encoder, vocab), changed, scores)
    if name == "encoder_no_repeat_ngram_size":
        return _encoder_no_repeat(scores, rows, int(options.encoder_no_repeat_ngram_size))
    if name == "no_repeat_ngram_size":
        return _no_repeat(scores, rows, int(options.no_repeat_ngram_size))
    if name == "sequence_bias":
        return _sequence_bias(scores, rows, options.sequence_bias)
    if name == "bad_words":
        scores = _remove(scores, masks[name][None, :])
        return _banned_sequences(scores, rows, options.bad_words_ids)
    if name == "suppress_tokens":
        return _remove(scores, masks[name][None, :])
    if name == "remove_invalid_values":
        return jnp.clip(jnp.where(jnp.isnan(scores), 0.0, scores), LOWEST, HIGHEST)
    if name == "exponential_decay_length_penalty":
        return _decay(scores, rows, options)
    if name == "min_length":
        if (options.min_new_tokens or 0) > 0:
            short = rows.length - rows.prompt < int(options.min_new_tokens)
        else:
            short = rows.length < int(options.min_length)
        # the eos columns alone (a [B, V] select was ~0.3 ms a step at batch 8): an id below
        # -V or from V on names no column, as the mask's scatter dropped it
        ids = sorted({e % vocab for e in eos if -vocab <= e < vocab})
        if not ids:
            return scores
        at = jnp.asarray(ids, jnp.int32)
        return scores.at[:, at].set(jnp.where(short[:, None], LOWEST, scores[:, at]))
    if name == "forced_bos_token_id":
        return _only(scores, [int(options.forced_bos_token_id)], rows.length == 1)
    if name == "forced_eos_token_id":
        forced = list(options.forced_eos_token_id)
        return _only(scores, forced, rows.length == rows.max_length - 1)
    if name == "begin_suppress_tokens":
        begin = rows.prompt
        if options.forced_bos_token_id is not None:
            begin = jnp.where(rows.prompt > 1, begin, begin + 1)
        tokens = (
            jnp.zeros(vocab, bool).at[jnp.asarray(list(options.begin_suppress_tokens))].set(True)
        )
        return jnp.where((rows.length == begin)[:, None] & tokens[None, :], LOWEST, scores)
    raise ValueError(f"unknown processor {name!r}")


def process(
    scores: jax.Array,
    rows: Rows,
    processors: Sequence[Any],
    states: Sequence[jax.Array],
    options: Options,
    masks: Mapping[str, jax.Array],
) -> jax.Array:
    """Applies ``processors`` in order; ``states`` holds the [B, ...] state of each custom one."""
    custom = iter(states)
    for i, processor in enumerate(processors):
        if isinstance(processor, str):
            scores = apply_builtin(processor, scores, rows, options, masks)
        else:
            scores = jax.vmap(processor[1])(scores, next(custom))
        scores = clamped(scores, processor, before=i > 0)
    return scores
