"""The compiled token selection: logits in, ONE int32 array out.

The selection is a jitted function of its own, apart from the decoder step. It applies the
processors (transformers' order), then greedy argmax, or sampling with temperature, top-k and
top-p drawn with a key made from the row's seed and step, so a row's tokens do not depend on the
other rows of its batch. Its only output is int32: token ids as integers and log-probabilities as
the bits of their float32 values (see :func:`to_bits`), so one transfer per step carries all.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..runtime.jit import put
from ..runtime.stored import AutoStoredJit
from .options import Options
from .processors import LOWEST, Rows, process

QUIET_NAN = 0x7FC00000


def to_bits(value: Any) -> Any:
    """The int32 of the bits of ``value`` as float32 (element-wise on lists); NaN is the quiet
    NaN with sign bit 0."""
    if isinstance(value, (list, tuple)):
        return [to_bits(v) for v in value]
    value = float(value)
    if value != value:
        return QUIET_NAN
    return struct.unpack("<i", struct.pack("<f", value))[0]


def from_bits(bits: Any) -> Any:
    """The float32 value of the int32 ``bits`` (element-wise on lists): a float, nan or ±inf."""
    if isinstance(bits, (list, tuple)):
        return [from_bits(b) for b in bits]
    return struct.unpack("<f", struct.pack("<i", int(bits)))[0]


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
    drop = (cumulative <= 1 - p).at[..., -keep:].set(False)
    removed = jnp.zeros_like(drop).at[jnp.arange(scores.shape[0])[:, None], order].set(drop)
    return jnp.where(removed, LOWEST, scores)


def _best(scores: jax.Array, keep: int) -> jax.Array:
    """[B, V] whether a token is among the ``keep`` best of its row."""
    kth = jax.lax.top_k(scores, min(keep, scores.shape[-1]))[0][..., -1:]
    return scores >= kth


def _min_p(scores: jax.Array, p: float, keep: int) -> jax.Array:
    # drop tokens less probable than p times the most probable one
    probs = jax.nn.softmax(scores, axis=-1)
    drop = probs < p * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(drop & ~_best(scores, keep), LOWEST, scores)


def _typical(scores: jax.Array, mass: float, keep: int) -> jax.Array:
    # locally typical sampling: keep the tokens whose surprise is closest to the entropy until
    # their probability reaches ``mass`` (the token that crosses it included)
    logp = jax.nn.log_softmax(scores, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1, keepdims=True)
    distance = jnp.abs(-logp - entropy)
    order = jnp.argsort(distance, axis=-1, stable=True)
    ascending = jnp.take_along_axis(distance, order, axis=-1)
    cumulative = jnp.cumsum(
        jax.nn.softmax(jnp.take_along_axis(scores, order, axis=-1), axis=-1), axis=-1
    )
    last = jnp.minimum(jnp.sum(cumulative < mass, axis=-1), scores.shape[-1] - 1)
    drop = ascending > jnp.take_along_axis(ascending, last[:, None], axis=-1)
    drop = drop.at[..., :keep].set(False)
    rows = jnp.arange(scores.shape[0])[:, None]
    removed = jnp.zeros_like(drop).at[rows, order].set(drop)
    return jnp.where(removed, LOWEST, scores)


def _epsilon(scores: jax.Array, epsilon: jax.Array, keep: int) -> jax.Array:
    # drop tokens of probability below epsilon (a number, or [B, 1])
    drop = jax.nn.softmax(scores, axis=-1) < epsilon
    return jnp.where(drop & ~_best(scores, keep), LOWEST, scores)


def warp(scores: jax.Array, options: Options) -> jax.Array:
    """The sampling warpers in transformers' order: temperature, top-k, top-p, min-p,
    typical-p, epsilon and eta cutoffs."""
    keep = 1  # transformers 4.57 keeps one token when sampling (it reads no min_tokens_to_keep)
    if options.num_beams > 1:  # transformers keeps a non-eos token for each beam
        keep = len(options.eos_token_id) + 1 if options.eos_token_id else 2
    temperature = options.temperature
    if temperature is not None and temperature != 1.0:
        scores = jnp.maximum(scores / float(temperature), LOWEST)
    if options.top_k:
        scores = _top_k(scores, int(options.top_k), keep)
    if options.top_p is not None and options.top_p < 1.0:
        scores = _top_p(scores, float(options.top_p), keep)
    if options.min_p is not None:
        scores = _min_p(scores, float(options.min_p), keep)
    return cutoffs(scores, options, keep)


def argmax(scores: jax.Array) -> jax.Array:
    """``jnp.argmax(scores, axis=-1)`` as int32 (the first maximum; the first NaN where there is
    one), as two plain reductions: XLA:CPU runs argmax's (value, index) reduce one element at a
    time (150 us over a 49,152-token vocabulary, against about 30 us); on the CPU kernels, one
    custom call (:func:`kernels.argmax`)."""
    fast = kernels.argmax(scores)
    if fast is not None:
        return fast
    top = jnp.max(scores, axis=-1, keepdims=True)
    hit = (scores == top) | (jnp.isnan(scores) & jnp.isnan(top))
    iota = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    return jnp.min(jnp.where(hit, iota, scores.shape[-1]), axis=-1).astype(jnp.int32)


def cutoffs(scores: jax.Array, options: Options, keep: int = 1) -> jax.Array:
    """The warpers after min-p, in transformers' order: typical-p, epsilon and eta cutoffs
    (each off unless ``options`` set it), keeping the ``keep`` best tokens of each row."""
    if options.typical_p is not None and options.typical_p < 1.0:
        scores = _typical(scores, float(options.typical_p), keep)
    if options.epsilon_cutoff is not None and 0 < options.epsilon_cutoff < 1:
        scores = _epsilon(scores, jnp.float32(options.epsilon_cutoff), keep)
    if options.eta_cutoff is not None and 0 < options.eta_cutoff < 1:
        eta = jnp.float32(options.eta_cutoff)
        probs = jax.nn.softmax(scores, axis=-1)
        entropy = -jnp.sum(probs * jax.nn.log_softmax(scores, axis=-1), axis=-1, keepdims=True)
        scores = _epsilon(scores, jnp.minimum(eta, jnp.sqrt(eta) * jnp.exp(-entropy)), keep)
    return scores


def processed(
    logits: jax.Array,
    rows: Rows,
    processors: Sequence[Any],
    states: Sequence[jax.Array],
    options: Options,
    masks: Mapping[str, jax.Array],
) -> jax.Array:
    """The scores a step selects from: processors, then the sampling warpers, then
    renormalize_logits (transformers' LogitNormalization is always last)."""
    scores = process(jnp.asarray(logits, jnp.float32), rows, processors, states, options, masks)
    if options.do_sample:
        scores = warp(scores, options)
    if options.renormalize_logits:
        scores = jnp.maximum(jax.nn.log_softmax(scores, axis=-1), LOWEST)
    return scores


def selection(
    options: Options,
    processors: Sequence[Any],
    masks: Mapping[str, np.ndarray],
    **jit_options: Any,
):
    """The jitted ``(logits [B, V], seeds [B], steps [B], rows, states) -> int32``.

    The result is [B] token ids; with token_logprobs [B, 2] (token id, bits of its
    log-probability); with top_logprobs=k [B, 2 + 2k]: then k (id, bits) pairs of the k most
    probable tokens, best first. Log-probabilities are the log-softmax of the scores the step
    selected from.
    """
    sample = bool(options.do_sample)
    logprobs, top = options.logprobs, int(options.top_logprobs)
    device_masks = {k: put(v) for k, v in masks.items()}

    def bits(x):
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

    def select(logits, seeds, steps, rows: Rows, states):
        scores = processed(logits, rows, processors, states, options, device_masks)
        if sample:

            def draw(row_scores, seed, step):
                key = jax.random.fold_in(jax.random.key(seed), step)
                return jax.random.categorical(key, row_scores)

            tokens = jax.vmap(draw)(scores, seeds, steps).astype(jnp.int32)
        else:
            tokens = argmax(scores)
        if not logprobs:
            return tokens
        total = jax.nn.logsumexp(scores, axis=-1)  # [B]
        chosen = jnp.take_along_axis(scores, tokens[:, None], axis=-1)[:, 0]
        columns = [tokens, bits(chosen - total)]
        if top:
            values, ids = jax.lax.top_k(scores, top)  # [B, k]
            pairs = jnp.stack([ids.astype(jnp.int32), bits(values - total[:, None])], axis=-1)
            columns = [c[:, None] for c in columns] + [pairs.reshape(pairs.shape[0], -1)]
            return jnp.concatenate(columns, axis=-1)
        return jnp.stack(columns, axis=-1)

    return AutoStoredJit(select, _key("select", options, processors), **jit_options)


def beam_selection(
    options: Options,
    processors: Sequence[Any],
    masks: Mapping[str, np.ndarray],
    **jit_options: Any,
):
    """The jitted beam step ``(logits [P*k, V], running [P*k], seeds [P], steps [P], rows,
    states) -> int32 [P, K, 4]``.

    For each prompt, K = max(2, 1 + eos tokens) * k candidates of log-softmax, then the
    processors (and the warpers with do_sample), plus the beam's score: (token, source beam, bits
    of the accumulated score, bits of the token's log-probability of the processed scores).
    Greedy: the K best, best first. do_sample: K drawn without replacement from the softmax of
    the accumulated scores, in the order drawn (transformers' ``torch.multinomial``), by the
    Gumbel top-K of a key made from the prompt's seed and step; ``seeds`` and ``steps`` are
    read only then.
    """
    beams = int(options.num_beams)
    keep = max(2, 1 + len(options.eos_token_id)) * beams
    sample = bool(options.do_sample)
    device_masks = {k: put(v) for k, v in masks.items()}

    def select(logits, running, seeds, steps, rows: Rows, states):
        scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        scores = processed(scores, rows, processors, states, options, device_masks)
        token_logprobs = scores - jax.nn.logsumexp(scores, axis=-1, keepdims=True)
        vocab = scores.shape[-1]
        total = (scores + running[:, None]).reshape(-1, beams * vocab)  # [P, k*V]
        if sample:

            def draw(row, seed, step):  # [k*V] -> [K] indices, in the order drawn
                key = jax.random.fold_in(jax.random.key(seed), step)
                noisy = row + jax.random.gumbel(key, row.shape, jnp.float32)
                return jax.lax.top_k(noisy, keep)[1]

            index = jax.vmap(draw)(total, seeds, steps)
            top = jnp.take_along_axis(total, index, axis=1)
        else:
            top, index = jax.lax.top_k(total, keep)
        chosen = jnp.take_along_axis(token_logprobs.reshape(-1, beams * vocab), index, axis=1)
        bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
        return jnp.stack(
            [
                (index % vocab).astype(jnp.int32),
                (index // vocab).astype(jnp.int32),
                bits(top),
                bits(chosen),
            ],
            axis=-1,
        )

    return AutoStoredJit(select, _key("beam", options, processors), **jit_options)


def _key(kind: str, options: Options, processors: Sequence[Any]) -> tuple | None:
    """What a selection computes beyond its arguments' shapes; None (not stored) with a task's
    own processors, which have no stable name."""
    if not all(isinstance(p, str) for p in processors):
        return None
    return (kind, options.program_key, tuple(processors))
