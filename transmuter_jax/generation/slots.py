"""Slots: requests join and leave a running batch (JetStream's prefill / insert / generate).

An engine of batch B has B slots. :func:`prefill` runs one request's prompt alone (one step
padded to a bucket of 64 tokens, chunks of the largest bucket past it) and selects its first
token; :func:`insert` puts that prefix into a slot of a :class:`SlotState`; :func:`generate` runs
up to ``steps`` decode steps of every live slot in one compiled ``lax.while_loop``;
:func:`free` empties a slot. Each request carries its own options, run in ONE program as
per-slot arrays: rows never read each other, so a request gets the same tokens and
log-probabilities whichever slots run beside it (the sampling key is made from the request's
seed and its own step count).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import hub
from ..runtime import compile_cache
from ..runtime.jit import jit_options, put, put_all
from ..runtime.stored import AutoStoredJit, StoredJit, signature, storable
from . import constraints, slot_inputs
from . import drafts as drafting
from .cache import PREFILL_CAP, bucket
from .cache import zeros as cache_zeros
from .decode import end_of_row
from .errors import GenerationError
from .options import MAX_DRAFT, MAX_NGRAM, NGRAM_DEFAULT
from .processors import LOWEST, ORDER, Rows, apply_builtin, clamped, static_masks
from .programs import jit_key, program
from .select import argmax, cutoffs
from .slot_inputs import axes as _axes
from .steps import LIVE
from .stops import StopStrings

if TYPE_CHECKING:
    from .engine import Engine

EOS_WIDTH = 4  # the most eos ids of a request (more: a clear error)
BIAS_WIDTH = 300  # the most logit_bias entries of a request (OpenAI's bound)
CAPACITY = 1024  # default cache rows of a slot (prompt and new tokens)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: its prompt and its own options (None: the specification's value).

    Attributes:
        prompt: token ids.
        max_new_tokens: the most new tokens.
        eos_token_id: the ids that end it (a tuple; empty: none).
        do_sample: sample (else greedy).
        temperature, top_k, top_p, min_p: the sampling warpers (transformers' meaning; top_k
            0 and top_p 1.0 switch them off).
        repetition_penalty: transformers' (over the prompt and the new tokens).
        presence_penalty: subtracted once from the score of every token already generated.
        seed: the sampling seed (its low 32 bits).
        stop_strings: strings that end it (as transformers' StopStringCriteria).
        logprobs: give each token's log-probability.
        top_logprobs: give the k most probable tokens of each step (k at most the state's).
        prompt_lookup_num_tokens, max_matching_ngram_size: speculative decoding by prompt
            lookup (docs/speculative.md); 0 switches off the specification's.
        num_assistant_tokens: with an engine of an assistant model, its drafted tokens (0: the
            request does not speculate).
        frequency_penalty: subtracted from the score of every token, times its count among the
            generated tokens (OpenAI's meaning).
        logit_bias: (token id, bias) pairs added to the scores first (as a one-token
            sequence_bias; at most :data:`BIAS_WIDTH`).
        min_new_tokens: the eos ids are masked until this many new tokens.
        constraint: structured output (docs/structured-output.md): a
            :class:`~.constraints.Constraint` or a mapping of one option (``{"regex": ...}``,
            ``{"choice": [...]}``, ``{"json_schema": ...}``); a finite one whose device table
            equals llguidance's masks (a regex, a choice), or None.
        inputs: the request's own inputs, one row each, as generate()'s (docs/engine.md):
            an encoder-decoder's given inputs (``encoder_hidden_states`` [1, rows, H], ...),
            ``image_features`` [image tokens, H], M-RoPE ``position_ids`` [3, prompt]; kept
            as read-only copies.
    """

    prompt: tuple[int, ...]
    max_new_tokens: int | None = None
    eos_token_id: tuple[int, ...] | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    num_assistant_tokens: int | None = None
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_new_tokens: int = 0
    constraint: Any = None
    inputs: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.inputs is not None:
            if not isinstance(self.inputs, Mapping):
                raise GenerationError(
                    f"inputs must be a mapping of input names to arrays, got "
                    f"{type(self.inputs).__name__}"
                )
            frozen = {str(k): _frozen(v) for k, v in self.inputs.items()}
            fix("inputs", types.MappingProxyType(frozen))
        fix("constraint", constraints.of(self.constraint))
        fix("prompt", tuple(int(t) for t in self.prompt))
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            fix("eos_token_id", (int(eos),) if isinstance(eos, int) else tuple(map(int, eos)))
        if isinstance(self.stop_strings, str):
            fix("stop_strings", (self.stop_strings,))
        fix("stop_strings", tuple(self.stop_strings))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        fix("logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if len(self.logit_bias) > BIAS_WIDTH:
            raise GenerationError(f"logit_bias takes at most {BIAS_WIDTH} tokens")
        if self.min_new_tokens < 0:
            raise GenerationError("min_new_tokens must not be negative")
        if not self.prompt:
            raise GenerationError("a request needs a prompt of at least one token")
        if self.top_logprobs < 0 or (self.max_new_tokens is not None and self.max_new_tokens < 0):
            raise GenerationError("max_new_tokens and top_logprobs must not be negative")


def _frozen(value: Any) -> np.ndarray:
    """A read-only copy of ``value`` (the caller's array is neither kept nor changed)."""
    array = np.array(value)
    if array.dtype == object:
        raise GenerationError(f"a request's input must be a numeric array, got {value!r:.60}")
    array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True)
class Token:
    """One new token of a slot.

    Attributes:
        slot: the slot.
        token: the token id (an eos id when ``eos``).
        logprob: its log-probability (NaN unless the request asked for logprobs).
        top: the request's top_logprobs (id, log-probability) pairs, best first.
        eos: the token is an eos id (not part of the text).
        done: the slot takes no more tokens.
        finish_reason: when done, "stop" (eos or stop string) or "length"; else None.
    """

    slot: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    eos: bool
    done: bool
    finish_reason: str | None


@storable
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows_:  # noqa: N801 - the per-slot device arrays (a pytree)
    """The per-slot arrays on the device ([B] unless said).

    token: the last token (the next input). lengths: valid cached tokens. history [B, H]: the
    prompt then the new tokens, -1 after. prompt: prompt length. count: new tokens so far (the
    sampling key's step). max_new: the most new tokens. seeds: sampling seeds. done: slots that
    take no more tokens (empty ones too). eos [B, E]: eos ids, -1 padding. sample: sampling
    rows. temperature, top_k (the vocabulary when off), top_p_drop (1 - top_p, computed in
    float64), top_p_on, min_p, repetition, presence: the warpers' and penalties' values.
    cache: the cache arrays by input name [B, heads, rows, head_size]. frequency: OpenAI's
    frequency penalty. bias_ids, bias_values [B, BIAS_WIDTH]: logit_bias (ids -1 after them).
    min_new: eos ids are masked before this many new tokens. logprob: the slot's request wants
    log-probabilities (its token's or top ones: else the step skips the log-sum-exp over the
    vocabulary when no slot wants them). constraint: the state in the
    slots' constraint table (-1: no constraint). drafts: speculative decoding's per-slot state
    (:class:`.drafts.Drafts`). delta (or None: 0): a new token's position minus its index in
    the row (M-RoPE positions). encoder [B, E] (or None): the encoder's input ids, -1 after
    them, where a processor reads them.
    """

    token: jax.Array
    lengths: jax.Array
    history: jax.Array
    prompt: jax.Array
    count: jax.Array
    max_new: jax.Array
    seeds: jax.Array
    done: jax.Array
    eos: jax.Array
    sample: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p_drop: jax.Array
    top_p_on: jax.Array
    min_p: jax.Array
    repetition: jax.Array
    presence: jax.Array
    cache: dict[str, jax.Array]
    frequency: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    min_new: jax.Array
    logprob: jax.Array
    constraint: jax.Array
    drafts: drafting.Drafts
    delta: jax.Array | None = None
    encoder: jax.Array | None = None


DecodeRows = Rows_


@storable
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOut:
    """What one step gives each slot (the named fields of JetStream's ResultTokens).

    token [B] int32 (-1: the slot took none), logprob [B] float32, top_ids [B, K] int32,
    top_logprobs [B, K] float32, done [B] bool (after the step), ends [B] bool (an eos).
    """

    token: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    done: jax.Array
    ends: jax.Array


@dataclasses.dataclass(frozen=True)
class _Host:
    """What the host keeps of a slot: its request, the stop strings' window of its tokens."""

    request: Request
    tail: tuple[int, ...]
    stops: StopStrings | None
    done: bool = False
    table: constraints.TokenTable | None = None  # the request's own constraint table
    offset: int = 0  # where it starts in the slots' table


@dataclasses.dataclass(frozen=True, eq=False)
class Prefix:
    """A request after its prompt: its cache (one row), its first token, ready to insert.

    Attributes:
        request: the request.
        rows: the slot's device arrays, batch 1.
        first: the first new token (None when the request asks for none, or is unread).
        table: the request's constraint table, or None.
        given: the request's given inputs (batch 1).
        unread: its first token is chosen on the device, not read (:func:`.prefill.select`):
            a slot takes it and runs; :func:`settle` gives the slot its first token.
        length: the valid rows of its cache, where the host knows them (None: read them).
    """

    request: Request
    rows: Rows_
    first: Token | None
    table: constraints.TokenTable | None = None
    given: dict[str, jax.Array] = dataclasses.field(default_factory=dict)  # batch 1
    unread: bool = False
    length: int | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class SlotState:
    """The slots of an engine: the device arrays and what the host keeps of each slot.

    Attributes:
        rows: the device arrays (:class:`DecodeRows`).
        hosts: per slot, None when empty.
        capacity: the most cache rows a slot takes (the rows it holds now: :func:`held`).
        top_logprobs: the most top_logprobs a request may ask for.
    """

    rows: Rows_
    hosts: tuple[_Host | None, ...]
    capacity: int
    top_logprobs: int
    table: constraints.TokenTable | None = None  # the live slots' constraint tables, joined
    given: dict[str, jax.Array] = dataclasses.field(default_factory=dict)  # [B, ...] per slot

    @property
    def live_table(self) -> constraints.TokenTable | None:
        """The table a step reads: None when no live slot has a constraint."""
        live = [h for h in self.hosts if h is not None and not h.done and h.table is not None]
        return self.table if live else None

    @property
    def free_slots(self) -> list[int]:
        """The slots that hold no request, or one that is done."""
        return [i for i, h in enumerate(self.hosts) if h is None or h.done]

    @property
    def live_slots(self) -> list[int]:
        """The slots whose request takes more tokens."""
        return [i for i, h in enumerate(self.hosts) if h is not None and not h.done]


# -- checks -----------------------------------------------------------------------------------


def check(engine: Engine) -> None:
    """Raises GenerationError when ``engine`` cannot run slots, saying why."""
    spec, mode = engine.spec, engine.cache_mode
    refusal = mode.slot_refusal()
    if refusal:
        unpadded = engine.compiled.unpadded if engine.compiled is not None else ""
        why = f" (exact lengths because {unpadded})" if unpadded else ""
        raise GenerationError(
            f"{spec.model.path!r} cannot run slots: {refusal}{why}; use generate()"
        )
    options = spec.options
    if options.num_beams > 1:
        raise GenerationError("beam search needs a program of its own: use generate()")
    if spec.constraint:
        raise GenerationError(
            "the specification's constraint (json_schema, regex, choice, ...) is generate()'s; "
            "slots take one per request: Request(constraint=...)"
        )
    if any(not isinstance(p, str) for p in spec.processors):
        raise GenerationError("a task's own processors need a program of their own: generate()")
    if options.encoder_ids:
        raise GenerationError(
            "encoder_repetition_penalty and encoder_no_repeat_ngram_size read the encoder's ids "
            "on the host: use generate()"
        )
    if options.num_return_sequences > 1:
        raise GenerationError("num_return_sequences > 1 needs generate()")
    if engine.placement is not None and engine.placement.processes > 1:
        raise GenerationError(
            "slots run on a mesh of one process (the host reads every slot's tokens): use "
            "generate() on a mesh that spans processes"
        )
    if engine.assistant is not None:
        for who, one in (("model", engine), ("assistant model", engine.assistant)):
            refusal = one.cache_mode.slot_refusal() or one.cache_mode.draft_refusal()
            if refusal:
                path = one.spec.model.path
                raise GenerationError(f"the {who} {path!r} cannot decode speculatively: {refusal}")


# -- the per-slot selection --------------------------------------------------------------------


def _choose(spec, masks, k: int, logits, rows: Rows_, views: Rows, table=None) -> tuple:
    """Each slot's token, log-probability and top k, from logits [B, V] (the processors, then
    the per-slot penalties, the constraint's mask and the warpers, as transformers orders
    them)."""
    return _scored(spec, masks, k, logits, rows, views, table, need_total=False)[:4]


def _scored(
    spec, masks, k: int, logits, rows: Rows_, views: Rows, table=None, need_total: bool = True
) -> tuple:
    """:func:`_choose`'s (token, log-probability, top ids, top values), then the final scores
    [B, V] the token was drawn from and their logsumexp [B] (speculative sampling's p; without
    ``need_total``, computed only when a slot wants log-probabilities, else NaN)."""
    options = spec.options
    scores = jnp.asarray(logits, jnp.float32)
    vocab = scores.shape[-1]
    scores = _requested(scores, rows, vocab)
    # the specification's order (generate()'s; a finite constraint's DeviceMask, the last
    # processor, is ``table``: restricted below), and where it has no repetition penalty, the
    # per-slot one in transformers' order
    names = [p for p in spec.processors if isinstance(p, str)]
    if "repetition_penalty" not in names:  # has none, the per-slot penalty in transformers'
        names = sorted([*names, "repetition_penalty"], key=ORDER.index)
    same = lambda s: s  # noqa: E731 - a branch that changes nothing
    for i, name in enumerate(names):
        if name == "repetition_penalty":  # per slot (1.0 changes nothing: skipped then)

            def repeat(scores):
                penalty = rows.repetition[:, None]
                changed = jnp.where(scores < 0, scores * penalty, scores / penalty)
                return jnp.where(_seen(views.history, vocab), changed, scores)

            scores = jax.lax.cond(jnp.any(rows.repetition != 1.0), repeat, same, scores)
        else:
            scores = apply_builtin(name, scores, views, options, masks)
        scores = clamped(scores, name, before=i > 0)
    generated = jnp.where(
        jnp.arange(views.history.shape[1])[None, :] >= rows.prompt[:, None], views.history, -1
    )

    # each clamped to LOWEST in its branch: scores that neither changes are clamped already (a
    # pass over [B, V] less a step)
    def presence(scores):
        return jnp.maximum(scores - rows.presence[:, None] * _seen(generated, vocab), LOWEST)

    def frequency(scores):
        return jnp.maximum(scores - rows.frequency[:, None] * _counts(generated, vocab), LOWEST)

    scores = jax.lax.cond(jnp.any(rows.presence != 0.0), presence, same, scores)
    scores = jax.lax.cond(jnp.any(rows.frequency != 0), frequency, same, scores)
    scores = constraints.restrict(scores, table, rows.constraint)  # after every processor
    sampling = jnp.any(rows.sample)

    def warp(scores):  # typical, epsilon and eta are the specification's
        return jnp.where(rows.sample[:, None], cutoffs(_warp(scores, rows), options), scores)

    scores = jax.lax.cond(sampling, warp, same, scores)
    if options.renormalize_logits:
        scores = jnp.maximum(jax.nn.log_softmax(scores, axis=-1), LOWEST)

    def draw(row_scores, seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row_scores)

    def drawn(scores):
        return jax.vmap(draw)(scores, rows.seeds, rows.count).astype(jnp.int32)

    none = lambda s: jnp.zeros(s.shape[0], jnp.int32)  # noqa: E731 - greedy rows only
    drawn = jax.lax.cond(sampling, drawn, none, scores)
    tokens = jnp.where(rows.sample, drawn, argmax(scores))
    if need_total:  # speculative sampling's p
        total = jax.nn.logsumexp(scores, axis=-1)
    else:  # NaN where no slot wants log-probabilities (the host reports NaN then)
        nan = lambda s: jnp.full(s.shape[:1], jnp.nan, jnp.float32)  # noqa: E731
        total = jax.lax.cond(
            jnp.any(rows.logprob), lambda s: jax.nn.logsumexp(s, axis=-1), nan, scores
        )
    chosen = jnp.take_along_axis(scores, tokens[:, None], axis=-1)[:, 0] - total
    if k:
        values, ids = jax.lax.top_k(scores, k)
        top_ids, top_values = ids.astype(jnp.int32), values - total[:, None]
    else:
        top_ids = jnp.zeros((scores.shape[0], 0), jnp.int32)
        top_values = jnp.zeros((scores.shape[0], 0), jnp.float32)
    return tokens, chosen, top_ids, top_values, scores, total


def _requested(scores, rows: Rows_, vocab: int):
    """A request's logit_bias (first, as transformers' sequence_bias) and its min_new_tokens
    (eos masked before them)."""
    at = jnp.arange(scores.shape[0])[:, None]

    def bias(scores):
        ids = jnp.where(rows.bias_ids < 0, vocab, rows.bias_ids)
        return scores.at[at, ids].add(rows.bias_values, mode="drop")

    def short(scores):
        eos = jnp.where(rows.eos < 0, vocab, rows.eos)
        masked = jnp.zeros(scores.shape, bool).at[at, eos].set(True, mode="drop")
        return jnp.where(masked & (rows.count < rows.min_new)[:, None], LOWEST, scores)

    same = lambda s: s  # noqa: E731 - no slot asks for it: [B, V] work skipped
    scores = jax.lax.cond(jnp.any(rows.bias_ids >= 0), bias, same, scores)
    return jax.lax.cond(jnp.any(rows.count < rows.min_new), short, same, scores)


def _counts(history, vocab):
    rows = jnp.arange(history.shape[0])[:, None]
    ids = jnp.where(history < 0, vocab, history)
    return jnp.zeros((history.shape[0], vocab), jnp.float32).at[rows, ids].add(1.0, mode="drop")


def _seen(history, vocab):
    rows = jnp.arange(history.shape[0])[:, None]
    ids = jnp.where(history < 0, vocab, history)
    return jnp.zeros((history.shape[0], vocab), bool).at[rows, ids].set(True, mode="drop")


def _warp(scores, rows: Rows_):
    """temperature, top-k, top-p, min-p per slot, as :func:`.select.warp` (keep = 1)."""
    scores = jnp.maximum(scores / rows.temperature[:, None], LOWEST)
    vocab = scores.shape[-1]

    def top_k(scores):
        ascending = jnp.sort(scores, axis=-1)
        k = jnp.clip(rows.top_k, 1, vocab)
        threshold = jnp.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)
        return jnp.where(scores < threshold, LOWEST, scores)

    scores = jax.lax.cond(jnp.any(rows.sample & (rows.top_k < vocab)), top_k, lambda s: s, scores)

    def top_p(scores):
        order = jnp.argsort(scores, axis=-1)
        ascending = jnp.take_along_axis(scores, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        drop = (cumulative <= rows.top_p_drop[:, None]).at[..., -1:].set(False)
        removed = jnp.zeros_like(drop).at[jnp.arange(scores.shape[0])[:, None], order].set(drop)
        return jnp.where(removed & rows.top_p_on[:, None], LOWEST, scores)

    scores = jax.lax.cond(jnp.any(rows.sample & rows.top_p_on), top_p, lambda s: s, scores)
    probs = jax.nn.softmax(scores, axis=-1)
    drop = probs < rows.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    kth = jax.lax.top_k(scores, 1)[0][..., -1:]
    return jnp.where(drop & ~(scores >= kth), LOWEST, scores)


# -- the step -----------------------------------------------------------------------------------


def _step_function(
    engine: Engine, capacity: int | None, k: int, branch: bool = True, padded: int | None = None
):
    """The pure ``step(params, rows, table=None, embed_params=None, given=None) -> (rows,
    StepOut)``: one new token of every live slot (``table``: the constraint table the rows'
    ``constraint`` states index, or None). ``capacity``: the cache's rows (None: read from its
    shape); ``branch``: the cache branch; ``padded``: a padded grow cache's rows (generate()
    groups)."""
    spec, mode = engine.spec, engine.cache_mode
    if padded is None and engine.compiled.padded:  # the slots' grow cache: its rows
        padded = capacity
    step = engine.compiled.steps.function(branch, padded)
    masks = _device_masks(spec)
    names = {i.name for i in engine.model.inputs}
    axes = _axes(engine)
    pad = _pad_token(engine)
    first = next(e.input for e in engine.cache.entries if not e.cross)

    def one(params, rows: Rows_, table=None, embed_params=None, given=None):
        batch = rows.token.shape[0]
        live = ~rows.done
        feed = {"tokens": jnp.where(live, rows.token, pad)[:, None].astype(jnp.int32)}
        if "attention_mask" in names:
            width = padded or capacity or rows.cache[first].shape[2]
            feed["attention_mask"] = mode.mask(rows.lengths, 1, width, xp=jnp)
        if axes:
            at = rows.lengths
            if rows.delta is not None:  # M-RoPE: a new token's position minus its index
                at = at + jnp.where(live, rows.delta, 0)
            positions = at[:, None].astype(jnp.int32)
            feed["position_ids"] = (
                jnp.broadcast_to(positions, (3, batch, 1)) if axes == 3 else positions
            )
        feed |= given or {}
        feed[LIVE] = live  # the products skip the rows of slots that take no token
        logits, cache = step(
            params, embed_params or {}, rows.cache, feed, rows.lengths, jnp.zeros(batch, jnp.int32)
        )
        views = Rows(
            rows.history,
            rows.prompt,
            rows.prompt + rows.count,
            rows.prompt + rows.max_new,
            rows.encoder,
        )
        chosen, logprob, top_ids, top_values = _choose(spec, masks, k, logits, rows, views, table)
        ends, kept, count, done = end_of_row(chosen, live, rows.eos, rows.count, rows.max_new)
        at = jnp.where(kept, rows.prompt + rows.count, rows.history.shape[1])
        history = rows.history.at[jnp.arange(batch), at].set(chosen, mode="drop")
        lengths = mode.advance(rows.lengths, live.astype(jnp.int32), 1).astype(jnp.int32)
        out = StepOut(jnp.where(live, chosen, -1), logprob, top_ids, top_values, done | ~live, ends)
        rows = dataclasses.replace(
            rows,
            token=jnp.where(kept, chosen, rows.token),
            lengths=lengths,
            history=history,
            count=count,
            done=rows.done | done,
            cache=cache,
            constraint=constraints.advance(table, rows.constraint, chosen, kept),
        )
        return rows, out

    return one


def run_steps(one, size: int, k: int, params, rows: Rows_, limit, **extra):
    """Traced: up to ``limit`` (at most ``size``) calls of the step ``one`` in a
    ``lax.while_loop`` that stops when every slot is done. Returns the rows after them and the
    StepOut of each step, [size, B] (steps not run: token -1, done)."""
    batch = rows.token.shape[0]
    out = StepOut(
        jnp.full((size, batch), -1, jnp.int32),
        jnp.zeros((size, batch)),
        jnp.zeros((size, batch, k), jnp.int32),
        jnp.zeros((size, batch, k)),
        jnp.ones((size, batch), bool),
        jnp.zeros((size, batch), bool),
    )

    def more(carry):
        i, r, _ = carry
        return (i < limit) & ~jnp.all(r.done)

    def body(carry):
        i, r, out = carry
        r, o = one(params, r, **extra)
        out = jax.tree.map(lambda a, b: a.at[i].set(b.astype(a.dtype)), out, o)
        return i + 1, r, out

    _, rows, out = jax.lax.while_loop(more, body, (jnp.int32(0), rows, out))
    return rows, out


def window_of(need: int, capacity: int) -> int:
    """The cache rows a decode chunk reads: the smallest of 64, 128, 256, ... that holds
    ``need`` rows (the longest live slot's length plus the chunk's steps), at most
    ``capacity``."""
    window = 64
    while window < need:
        window *= 2
    return min(window, capacity)


def windows(capacity: int) -> list[int]:
    """Every window a chunk of slots of ``capacity`` cache rows may read (:func:`window_of`)."""
    found, window = [], 64
    while window < capacity:
        found.append(window)
        window *= 2
    return [*found, capacity]


def program_size(steps: int) -> int:
    """The steps a decode chunk of at most ``steps`` steps is compiled for: a power of two."""
    return 1 << (max(int(steps), 1) - 1).bit_length()


def chunk_size(steps: int, program_steps: int | None = None) -> int:
    """The steps of the program a chunk of ``steps`` steps runs: :func:`program_size` of
    ``program_steps`` (at least ``steps``: the loop stops after ``steps``), else of ``steps``;
    raises GenerationError for a bad value."""
    _positive("steps", steps)
    if program_steps is None:
        return program_size(steps)
    _positive("program_steps", program_steps)
    if program_steps < steps:
        raise GenerationError(f"program_steps {program_steps} is fewer than steps {steps}")
    return program_size(program_steps)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GenerationError(f"{name} must be a positive integer, got {value!r}")


def _chunk(engine: Engine, rows: int, k: int, size: int):
    """The jitted ``(params, rows, limit, table) -> (rows, StepOut [size, B])``: up to ``limit``
    steps in a ``lax.while_loop`` that stops when every slot is done; the cache donated.
    ``rows``: the self-attention cache rows the slots hold (a decode window, :func:`held`)."""
    steps, spec = engine.compiled.steps, engine.spec
    names = constraints.program_names(spec.processors)
    stored = steps.key(
        "slots",
        True,
        rows if engine.compiled.padded else None,
        spec.options.program_key,
        names,
        spec.vocab_size,
        _pad_token(engine),
        _axes(engine),
        spec.image_token,
        rows,
        k,
        size,
    )

    def make(key):
        def made():
            one = _step_function(engine, rows, k)

            def run(params, embed_params, state_rows: Rows_, given, limit, table):
                extra = {"table": table, "embed_params": embed_params, "given": given}
                return run_steps(one, size, k, params, state_rows, limit, **extra)

            options = jit_options(dict(engine.jit_options))
            return StoredJit(run, key, donate_argnums=(2,), **options)

        return made

    # stored on disk (a new process skips tracing it), unless a task's own processors (which
    # have no stable name) are among them, or a constraint table (a host matcher's callback
    # cannot be stored) is read
    names_kept = all(isinstance(p, str) for p in names)
    kept = program(("slots", stored, steps.local()), make(stored if names_kept else None),
                   steps.held)  # fmt: skip
    plain = program(("slots", stored, steps.local(), "table"), make(None), steps.held)

    def call(params, embed_params, state_rows, given, limit, table):
        chunk = kept if table is None else plain
        # the weights, alike in every call, are left out of the signature
        key = signature((state_rows, given, limit, table))
        return chunk(key, params, embed_params, state_rows, given, limit, table)

    return call


def _embed_params(engine: Engine) -> dict:
    return engine.embed.params if engine.embed is not None else {}


def _own(engine: Engine) -> frozenset[str]:
    """The self-attention cache inputs (the rows a window cuts; cross-attention keeps its own)."""
    return frozenset(e.input for e in engine.cache.entries if not e.cross)


def held(engine: Engine, state: SlotState) -> int:
    """The self-attention cache rows each slot holds now: a decode window (:func:`window_of`)
    or the capacity. A slot's valid rows are its first ``lengths``; the mask hides the rest."""
    return _rows_of(engine, state.rows.cache, state.capacity)


def _rows_of(engine: Engine, cache: dict[str, jax.Array], default: int) -> int:
    """The self-attention rows of ``cache`` (``default`` where it has none)."""
    own = _own(engine)
    return next((a.shape[2] for n, a in cache.items() if n in own), default)


_RESIZE: dict[tuple, Any] = {}  # (rows, inputs, jit options) -> the compiled resize


def _resized_cache(engine: Engine, cache: dict[str, jax.Array], rows: int) -> dict:
    """``cache`` with ``rows`` self-attention rows, its valid ones kept (the cache mode's
    :meth:`~.cache.Mode.resize`: the first rows then zeros; in grow zeros then the last)."""
    return _resize_program(engine, rows)(cache)


def _resize_program(engine: Engine, rows: int):
    """The compiled ``cache -> cache`` of :func:`_resized_cache` to ``rows`` rows."""
    own, mode = _own(engine), engine.cache_mode
    key = (rows, own, type(mode).__name__, jit_key(engine.jit_options))
    if key not in _RESIZE:

        def resize(cache):
            return {n: mode.resize(a, rows) if n in own else a for n, a in cache.items()}

        stored = ("slots.resize", rows, tuple(sorted(own)), repr(mode), key[-1])
        _RESIZE[key] = AutoStoredJit(resize, stored, **jit_options(dict(engine.jit_options)))
    return _RESIZE[key]


def resized(engine: Engine, state: SlotState, rows: int) -> SlotState:
    """``state`` whose slots hold ``rows`` self-attention cache rows (a window of the capacity):
    each slot's first rows, then zeros. A step reads and writes every row it holds, so the slots
    hold the smallest window their live requests need (:func:`generate` resizes them; a copy
    of the cache when the window changes, where cutting a window out of the whole capacity and
    writing it back cost a copy every chunk)."""
    if not 0 < rows <= state.capacity:
        raise GenerationError(f"rows must be in 1..{state.capacity}, got {rows!r}")
    if held(engine, state) == rows:
        return state
    cache = _resized_cache(engine, state.rows.cache, rows)
    return dataclasses.replace(state, rows=dataclasses.replace(state.rows, cache=cache))


_MASKS: dict[tuple, dict[str, jax.Array]] = {}  # (options' program key, vocab) -> masks


def _device_masks(spec: Any) -> dict[str, jax.Array]:
    """The specification's static token masks (:func:`.processors.static_masks`) on the
    device, for the programs that close over them: one copy for every program of the options
    (a program per window must not hold copies of its own)."""
    key = (spec.options.program_key, spec.vocab_size)
    if key not in _MASKS:
        masks = static_masks(spec.options, spec.vocab_size)
        _MASKS[key] = {n: put(v) for n, v in masks.items()}
    return _MASKS[key]


def _first(engine: Engine, k: int):
    """The jitted ``(logits [B, V], rows, table) -> (rows, StepOut)``: the selection of the
    slots' step alone (a prefix's first token; generate()'s tokens on the host)."""
    spec = engine.spec
    key = (
        "slots-first",
        spec.options.program_key,
        constraints.program_names(spec.processors),
        spec.vocab_size,
        k,
        jit_key(engine.jit_options),
    )

    def make():
        masks = _device_masks(spec)

        def first(logits, rows: Rows_, table):
            views = Rows(
                rows.history,
                rows.prompt,
                rows.prompt + rows.count,
                rows.prompt + rows.max_new,
                rows.encoder,
            )
            chosen, logprob, ids, values = _choose(spec, masks, k, logits, rows, views, table)
            live = ~rows.done
            ends, kept, count, done = end_of_row(chosen, live, rows.eos, rows.count, rows.max_new)
            at = jnp.where(kept, rows.prompt + rows.count, rows.history.shape[1])
            history = rows.history.at[jnp.arange(rows.token.shape[0]), at].set(chosen, mode="drop")
            rows = dataclasses.replace(
                rows,
                token=jnp.where(kept, chosen, rows.token),
                history=history,
                count=count,
                done=rows.done | done,
                constraint=constraints.advance(table, rows.constraint, chosen, kept),
            )
            return rows, StepOut(chosen, logprob, ids, values, rows.done, ends)

        # stored on disk (a new process skips tracing it) unless a task's own processors,
        # which have no stable name, are among them
        names = key[2]
        stored = key if all(isinstance(p, str) for p in names) else None
        return AutoStoredJit(first, stored)

    return program(key, make, engine.compiled.steps.held)


# -- the verbs ----------------------------------------------------------------------------------


def capacity_of(engine: Engine, capacity: int) -> int:
    """The cache rows of a slot: ``capacity`` (a positive multiple of 64), at most the model's
    positions rounded up to 64."""
    if (
        isinstance(capacity, bool)
        or not isinstance(capacity, int)
        or capacity < 64
        or capacity % 64
    ):
        raise GenerationError(f"capacity must be a positive multiple of 64, got {capacity!r}")
    limit = engine.position_limit
    return min(capacity, bucket(limit)) if limit is not None else capacity


def init(engine: Engine) -> SlotState:
    """Empty slots: ``engine.batch_size`` of them, each taking up to the engine's
    ``slot_capacity`` cache rows and holding the smallest window (64 rows, :func:`held`), or
    the whole capacity where the engine reads no windows (its chunks would resize them to it)."""
    check(engine)
    capacity = engine.slot_capacity
    rows = _empty(
        engine,
        engine.batch_size,
        capacity,
        window_of(1, capacity) if engine.slot_windows else capacity,
    )
    if engine.placement is not None:  # the cache split over the mesh, as generate() places it
        rows = dataclasses.replace(rows, cache=engine.placement.place_cache(rows.cache))
    return SlotState(rows, (None,) * engine.batch_size, capacity, engine.slot_top_logprobs)


def _empty(engine: Engine, batch: int, capacity: int, held: int | None = None) -> Rows_:
    assistant = engine.assistant.cache if engine.assistant is not None else None
    held = capacity if held is None else held
    vocab, delta = engine.vocab_size, _axes(engine) == 3
    return _empty_program(engine.cache, assistant, batch, capacity, held, vocab, delta)()


@functools.cache
def _empty_program(layout, assistant, batch: int, capacity: int, held: int, vocab, delta: bool):
    """The compiled ``() -> Rows_`` of empty slots (``assistant``: the draft model's cache
    layout, or None; ``delta``: the rows carry M-RoPE position offsets): one program, read from
    the compilation cache in a new process (putting the host's arrays and making the cache's
    zeros apart took 1.2 ms of the host's time a call, the program 0.5 ms)."""

    def make() -> Rows_:
        full = lambda v, t, shape=batch: np.full(shape, v, t)  # noqa: E731
        i = lambda v: full(v, np.int32)  # noqa: E731
        f = lambda v: full(v, np.float32)  # noqa: E731
        drafted = {} if assistant is None else cache_zeros(assistant, batch, capacity)
        return Rows_(
            token=i(0),
            lengths=i(0),
            history=full(-1, np.int32, (batch, capacity)),
            prompt=i(0),
            count=i(0),
            max_new=i(0),
            seeds=i(0),
            done=full(True, bool),
            eos=full(-1, np.int32, (batch, EOS_WIDTH)),
            sample=full(False, bool),
            temperature=f(1.0),
            top_k=i(vocab),
            top_p_drop=f(0.0),
            top_p_on=full(False, bool),
            min_p=f(0.0),
            repetition=f(1.0),
            presence=f(0.0),
            cache=cache_zeros(layout, batch, held),
            frequency=f(0.0),
            bias_ids=full(-1, np.int32, (batch, BIAS_WIDTH)),
            bias_values=full(0.0, np.float32, (batch, BIAS_WIDTH)),
            min_new=i(0),
            logprob=full(False, bool),
            constraint=i(-1),
            drafts=drafting.empty(batch, cache=drafted, host=True),
            delta=i(0) if delta else None,
        )

    program = jax.jit(make)  # its outputs uncommitted, as put_all's

    def run() -> Rows_:
        with compile_cache.scope():  # the program read from the compilation cache
            return program()

    return run


def _assistant_cache(engine: Engine, batch: int, capacity: int) -> dict[str, jax.Array]:
    assistant = engine.assistant
    return {} if assistant is None else assistant.cache.empty(batch, capacity)


def _resolved(engine: Engine, request: Request) -> dict[str, Any]:
    """The request's options, the specification's where it gives None."""
    o = engine.spec.options
    pick = lambda v, d: d if v is None else v  # noqa: E731
    max_new = request.max_new_tokens
    if max_new is None:
        max_new = o.max_new_tokens if o.max_new_tokens is not None else 256
    eos = pick(request.eos_token_id, o.eos_token_id)
    if len(eos) > EOS_WIDTH:
        raise GenerationError(f"a request takes at most {EOS_WIDTH} eos ids, got {len(eos)}")
    sample = bool(pick(request.do_sample, o.do_sample))
    temperature = pick(request.temperature, o.temperature)
    temperature = 1.0 if temperature is None or not sample else float(temperature)
    top_k = pick(request.top_k, o.top_k) or 0
    top_p = pick(request.top_p, o.top_p)
    top_p = 1.0 if top_p is None else float(top_p)
    min_p = pick(request.min_p, o.min_p) or 0.0
    repetition = pick(request.repetition_penalty, o.repetition_penalty) or 1.0
    if sample and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0 and 0 <= min_p <= 1):
        raise GenerationError(
            f"bad sampling options: temperature {temperature}, top_k {top_k}, top_p {top_p}, "
            f"min_p {min_p}"
        )
    if repetition <= 0:
        raise GenerationError(f"repetition_penalty must be positive, got {repetition}")
    lookup = pick(request.prompt_lookup_num_tokens, o.prompt_lookup_num_tokens) or 0
    assisted = engine.assistant is not None and not lookup
    if assisted:
        lookup = pick(request.num_assistant_tokens, o.num_assistant_tokens)
    ngram = pick(request.max_matching_ngram_size, o.max_matching_ngram_size)
    ngram = NGRAM_DEFAULT if ngram is None else ngram
    refusal = engine.cache_mode.draft_refusal() if lookup else ""
    if lookup and (slot_inputs.takes(engine) or engine.spec.embed is not None):
        refusal = (
            "it takes given inputs, images, M-RoPE positions or an embedding model, which the "
            "drafts' steps do not"
        )
    if lookup and engine.placement is not None:
        refusal = "it runs on a mesh, and drafts run on one device"
    if refusal:
        raise GenerationError(
            f"speculative decoding (prompt_lookup_num_tokens, num_assistant_tokens) cannot run "
            f"on {engine.spec.model.path!r}: {refusal}; ask for 0 drafted tokens"
        )
    if not (0 <= lookup <= MAX_DRAFT and 1 <= ngram <= MAX_NGRAM):
        raise GenerationError(
            f"prompt_lookup_num_tokens and num_assistant_tokens must be in [0, {MAX_DRAFT}] and "
            f"max_matching_ngram_size in [1, {MAX_NGRAM}], got {lookup} and {ngram}"
        )
    return dict(
        lookup=int(lookup),
        assisted=bool(assisted and lookup),
        adaptive=not assisted or o.num_assistant_tokens_schedule == "heuristic",
        ngram=int(ngram),
        max_new=int(max_new),
        eos=tuple(eos),
        sample=sample,
        temperature=temperature,
        top_k=int(top_k),
        top_p=top_p,
        min_p=float(min_p),
        repetition=float(repetition),
    )


def _admit(
    engine: Engine, request: Request
) -> tuple[dict[str, Any], StopStrings | None, slot_inputs.Inputs]:
    """``request``'s resolved options, stop strings and inputs; raises GenerationError for a
    request the engine cannot take (bad ids, options, top_logprobs, logit_bias, stop strings
    without texts, inputs it does not take or lacks)."""
    check(engine)
    if not isinstance(request, Request):
        raise GenerationError(f"prefill takes a Request, got {type(request).__name__}")
    r = _resolved(engine, request)
    vocab = engine.vocab_size or 2**31
    bad = [t for t in request.prompt if not 0 <= t < vocab]
    if bad:
        raise GenerationError(f"the prompt has token ids outside the vocabulary of {vocab}: {bad}")
    for token, _ in request.logit_bias:
        if not 0 <= token < vocab:
            raise GenerationError(f"logit_bias: token id {token} is outside the vocabulary")
    if request.top_logprobs > engine.slot_top_logprobs:
        raise GenerationError(
            f"top_logprobs {request.top_logprobs} is more than the engine's "
            f"{engine.slot_top_logprobs} (compile(..., top_logprobs=))"
        )
    stops = None
    if request.stop_strings:
        if engine.spec.token_texts is None:
            raise GenerationError("stop strings need token texts: context(tokenizer=...)")
        stops = StopStrings(request.stop_strings, engine.spec.token_texts)
    inputs = slot_inputs.NONE
    if request.inputs or engine.given:
        inputs = slot_inputs.of(engine, request.prompt, request.inputs)
    return r, stops, inputs


def prefill(
    engine: Engine, request: Request, past: tuple[dict[str, jax.Array], int] | None = None
) -> Prefix:
    """Runs ``request``'s prompt alone and selects its first token.

    The prompt runs as one step padded to a bucket (chunks of :data:`~.cache.PREFILL_CAP` past
    it), into a cache of the state's capacity. ``past``: a cache (batch 1, the slots' capacity
    rows, donated) whose first n rows hold the keys and values of the prompt's first n tokens
    (0 < n < the prompt's length); only the rest of the prompt runs (see :mod:`.prefixes`).
    """
    capacity = engine.slot_capacity
    r, stops, inputs = _admit(engine, request)
    if inputs is not slot_inputs.NONE:
        raise GenerationError(
            "a request with inputs of its own (an encoder's, images) runs through "
            "engine.prefill or prefill_many, and takes no past"
        )
    prompt = list(request.prompt)
    start = 0 if past is None else int(past[1])
    if not 0 <= start < len(prompt):
        raise GenerationError(f"past holds {start} rows of a prompt of {len(prompt)} tokens")
    need = max(len(prompt) + r["max_new"], written(start, len(prompt)))
    if need > capacity:
        raise GenerationError(
            f"the request needs {need} cache rows (a prompt of {len(prompt)} tokens, padded, and "
            f"{r['max_new']} new ones): more than the slots' capacity of {capacity}"
        )
    table = _table_of(engine, request, r["eos"])
    cache = None if past is None else past[0]
    logits, cache, lengths = _prompt(engine, prompt, capacity, cache, start, own=past is None)
    drafted = _drafted(engine, prompt, r["assisted"])
    rows = _request_rows(engine, request, r, put(lengths), cache, table, drafted)
    if r["max_new"] == 0:
        logits.delete()
        return Prefix(request, rows, None, table, length=int(lengths[0]))
    rows, out = _first(engine, engine.slot_top_logprobs)(logits, rows, table)
    logits.delete()
    out = jax.device_get(out)
    token = _tokens(out, request, [0], 0, None)[0]
    if stops is not None and not token.done and not token.eos:
        if stops.hit([*prompt, token.token]):
            token = dataclasses.replace(token, done=True, finish_reason="stop")
            rows = dataclasses.replace(rows, done=jnp.ones(1, bool))
    return Prefix(request, rows, token, table, length=int(lengths[0]))


def _drafted(engine: Engine, prompt: Sequence[int], assisted: bool) -> dict[str, jax.Array]:
    """The draft model's cache of the whole prompt (empty without an assistant model). A request
    that does not draft with it (``assisted`` False) gets an empty cache of batch 1: its slot
    never drafts, so the draft model does not run its prompt."""
    if engine.assistant is None:
        return {}
    if not assisted:
        return _assistant_cache(engine, 1, engine.slot_capacity)
    last, drafted, _ = _prompt(engine.assistant, list(prompt), engine.slot_capacity)
    last.delete()
    return drafted


def _request_rows(
    engine: Engine,
    request: Request,
    r: dict[str, Any],
    lengths,
    cache,
    table: constraints.TokenTable | None = None,
    drafted: dict[str, jax.Array] | None = None,
    *,
    host: bool = False,
    delta: int = 0,
) -> Rows_:
    """The device rows (batch 1) of ``request`` after its prompt: ``r`` its resolved options,
    ``lengths`` [1] its cached tokens, ``cache`` its cache, ``table`` its constraint's table
    (its state 0; None: no constraint), ``drafted`` the draft model's cache of the prompt,
    ``delta`` its M-RoPE positions' offset.
    ``host``: the host arrays as they are (numpy), for a jitted call that copies them itself
    (its own copy of ~30 small arrays is ~1.5 ms faster than ``device_put``'s)."""
    capacity, prompt = engine.slot_capacity, request.prompt
    vocab = engine.vocab_size or 2**31
    history = np.full((1, capacity), -1, np.int32)
    history[0, : len(prompt)] = prompt
    eos = np.full((1, EOS_WIDTH), -1, np.int32)
    eos[0, : len(r["eos"])] = r["eos"]
    bias_ids = np.full((1, BIAS_WIDTH), -1, np.int32)
    bias_values = np.zeros((1, BIAS_WIDTH), np.float32)
    for j, (token, value) in enumerate(request.logit_bias):  # checked by _admit
        bias_ids[0, j], bias_values[0, j] = token, value
    one = lambda v, t: np.array([v], t)  # noqa: E731
    seed = np.array([request.seed & 0xFFFFFFFF], np.uint32).view(np.int32)
    rows = Rows_(
        token=one(0, np.int32),
        lengths=lengths,
        history=history,
        prompt=one(len(prompt), np.int32),
        count=one(0, np.int32),
        max_new=one(r["max_new"], np.int32),
        seeds=seed,
        done=one(r["max_new"] == 0, bool),
        eos=eos,
        sample=one(r["sample"], bool),
        temperature=one(r["temperature"], np.float32),
        top_k=one(r["top_k"] if r["top_k"] > 0 else vocab, np.int32),
        top_p_drop=one(np.float32(1 - r["top_p"]), np.float32),
        top_p_on=one(r["top_p"] < 1.0, bool),
        min_p=one(r["min_p"], np.float32),
        repetition=one(r["repetition"], np.float32),
        presence=one(float(request.presence_penalty), np.float32),
        cache=cache,
        frequency=one(float(request.frequency_penalty), np.float32),
        bias_ids=bias_ids,
        bias_values=bias_values,
        min_new=one(int(request.min_new_tokens), np.int32),
        logprob=one(bool(request.logprobs or request.top_logprobs), bool),
        constraint=one(_start_state(engine, request, r, table), np.int32),
        drafts=drafting.empty(
            1,
            r["lookup"],
            r["ngram"],
            r["assisted"],
            r["adaptive"],
            cache=drafted or {},
            host=True,
        ),  # fmt: skip
        delta=one(delta, np.int32) if _axes(engine) == 3 else None,
    )
    return rows if host else put_all(rows)  # one copy of the host arrays


def written(start: int, length: int) -> int:
    """Cache rows a prefill writes for a prompt of ``length`` tokens whose first ``start`` are
    cached (its steps padded)."""
    rest = length - start
    return start + (bucket(rest) if rest <= PREFILL_CAP else _chunks_end(rest))


def _prompt(
    engine: Engine,
    prompt: list[int],
    capacity: int,
    cache: Any = None,
    start: int = 0,
    own: bool = False,
) -> tuple[Any, dict, Any]:
    """(the last token's logits, the cache, its lengths) of ``prompt`` alone, in steps of the
    engine's prefill rule into a cache of ``capacity`` rows (``cache``: one whose first
    ``start`` rows hold the prompt's first tokens; ``own``: a prompt of one step runs in a
    cache of that step's rows, as :func:`.prefill.begin` runs it)."""
    spec, mode = engine.spec, engine.cache_mode
    if cache is None:  # grow: the first step's present is the cache, padded to ``capacity``
        rows = mode.start_rows(capacity)
        first = mode.prompt_step(len(prompt), spec.prefill)
        alone = mode.first_rows(first, len(prompt)) if own else None
        cache = engine.cache.empty(1, alone if alone is not None and alone < rows else rows)
    rows = _rows_of(engine, cache, capacity)
    lengths, fed, logits = np.full(1, start, np.int32), start, None
    axes = _axes(engine)
    names = {i.name for i in engine.model.inputs}
    while fed < len(prompt):
        size = mode.prompt_step(len(prompt) - fed, spec.prefill)
        part = prompt[fed : fed + size]
        tokens = np.full((1, size), _pad_token(engine), np.int32)
        tokens[0, : len(part)] = part
        feed: dict[str, Any] = {"tokens": tokens}
        if "attention_mask" in names:
            feed["attention_mask"] = mode.mask(lengths, size, rows)
        if axes:
            positions = (np.arange(size) + fed)[None, :].astype(np.int32)
            feed["position_ids"] = (
                np.broadcast_to(positions, (3, 1, size)) if axes == 3 else positions
            )
        last = np.array([len(part) - 1], np.int32)
        if logits is not None:
            logits.delete()
        real = np.array([len(part)], np.int32)
        logits, cache = engine.compiled.steps(cache, feed, lengths, last, capacity, real)
        lengths = mode.advance(lengths, real, size).astype(np.int32)
        rows = _rows_of(engine, cache, capacity)
        fed += len(part)
    return logits, cache, lengths


def _chunks_end(length: int) -> int:
    """Cache rows a prompt longer than the largest bucket writes (its last chunk padded)."""
    whole = (length // PREFILL_CAP) * PREFILL_CAP
    rest = length - whole
    return whole + (bucket(rest) if rest else 0)


def _tokens(out, request: Request, slots: Sequence[int], i: int, ran: Any) -> list[Token]:
    """The Tokens of step ``i`` of ``out`` (host arrays [B] or [steps, B]) for ``slots``."""
    at = (lambda a, s: a[s]) if ran is None else (lambda a, s: a[i, s])
    result = []
    for s in slots:
        token = int(at(out.token, s))
        done, ends = bool(at(out.done, s)), bool(at(out.ends, s))
        k = request.top_logprobs
        ids, values = at(out.top_ids, s)[:k], at(out.top_logprobs, s)[:k]
        logprob = float(at(out.logprob, s)) if request.logprobs or k else float("nan")
        reason = ("stop" if ends else "length") if done else None
        top = tuple((int(a), float(b)) for a, b in zip(ids, values, strict=True))
        result.append(Token(s, token, logprob, top, ends, done, reason))
    return result


INSERT_ROWS = 2
"""The most prefixes one program of :func:`insert_many` puts: each puts ~90 arrays of the
default model, and XLA:CPU holds a loaded program's ops at tens of KB apiece. At batch 8 of the
default int4 model, programs of 4 or 8 raised the peak resident memory by ~30 MiB against
programs of one; programs of two by none measurable, with half the dispatches."""


@functools.cache
def _insert_function(jit: str, stored: bool):
    """The program that puts requests' rows (a tuple of batch-1 rows) into the slots' rows
    (donated) at ``slots`` ([n] int32), stored on disk unless the slots are on a mesh (stored
    programs keep no shardings): it compiles in about a second, on the way to a new process's
    first token. One program a number of rows (at most :data:`INSERT_ROWS`): each put
    dispatched apart cost ~1.5 ms of the host's time (12 ms before the first decode chunk at
    batch 8)."""

    def insert(rows: Rows_, ones: tuple[Rows_, ...], slots):
        for i, one in enumerate(ones):
            rows = jax.tree.map(
                lambda a, b, i=i: jax.lax.dynamic_update_slice_in_dim(
                    a, b.astype(a.dtype), slots[i], axis=0
                ),
                rows,
                one,
            )
        return rows

    return AutoStoredJit(insert, ("slots.insert", 2) if stored else None, donate_argnums=(0,))


def insert(engine: Engine, prefix: Prefix, state: SlotState, slot: int) -> SlotState:
    """``state`` with ``prefix`` in slot ``slot`` (a free one); the state's arrays are donated."""
    return insert_many(engine, [(prefix, slot)], state)


def insert_many(engine: Engine, pairs: Sequence[tuple[Prefix, int]], state: SlotState) -> SlotState:
    """``state`` with each ``(prefix, slot)`` of ``pairs`` inserted, in order, as :func:`insert`
    one at a time gives it; the state's arrays are donated. The rows go in together, at most
    :data:`INSERT_ROWS` a program; where a prefix changes the slots' other rows (encoder inputs
    of another width, a constraint's table joined, a larger window held), the rows before it go
    in first."""
    put_in = _insert_function(jit_key(engine.jit_options), engine.placement is None)
    waiting: list[tuple[Rows_, int]] = []  # rows not yet put, and their slots

    def flushed(state: SlotState) -> SlotState:
        rows = state.rows
        for i in range(0, len(waiting), INSERT_ROWS):
            group = waiting[i : i + INSERT_ROWS]
            ones, at = tuple(w[0] for w in group), np.array([w[1] for w in group], np.int32)
            rows = put_in(rows, ones, at)
        waiting.clear()
        return state if rows is state.rows else dataclasses.replace(state, rows=rows)

    _check_pairs(state, pairs)
    for prefix, slot in pairs:
        if any(s == slot for _, s in waiting):  # a finished one before it: put that first
            state = flushed(state)
        request = prefix.request
        stops = (
            StopStrings(request.stop_strings, engine.spec.token_texts)
            if request.stop_strings
            else None
        )
        window = stops.window if stops is not None else 0
        tokens = list(request.prompt)
        done = not prefix.unread and (prefix.first is None or prefix.first.done)
        if prefix.first is not None and not prefix.first.eos:
            tokens.append(prefix.first.token)
        one, own_given = prefix.rows, prefix.given
        if own_given or state.given:  # one encoder width for the slots' given inputs and cache
            state = flushed(state)
            given, cache, own_given, own_cache = slot_inputs.fitted(
                engine, state.given, state.rows.cache, own_given, one.cache, len(state.hosts)
            )
            rows = dataclasses.replace(state.rows, cache=cache)
            state = dataclasses.replace(state, rows=rows, given=given)
            one = dataclasses.replace(one, cache=own_cache)
        if prefix.table is not None:  # the live slots' states move with their tables
            state = flushed(state)
        state, offset = _joined(state, slot, prefix.table)
        if prefix.table is not None:  # its state in the slots' table (a host row's: its handle)
            c = one.constraint
            one = dataclasses.replace(one, constraint=jnp.where(c >= 0, c + offset, c))
        have, given = held(engine, state), _rows_of(engine, one.cache, state.capacity)
        if given != have:  # the slots hold the window its rows need; it gives no more rows
            length = prefix.length
            if length is None:
                length = int(jax.device_get(one.lengths)[0])
            target = max(have, window_of(max(length, 1), state.capacity))
            if target != have:
                state = resized(engine, flushed(state), target)
            # a shorter prefix goes into the slot's first rows as it is, unless its valid rows
            # come last (a padded grow cache): then it is resized to the window too
            if given > target or (given < target and engine.cache_mode.padded):
                one = dataclasses.replace(one, cache=_resized_cache(engine, one.cache, target))
        _release(state, slot)
        if done:  # put with the slot's rows: it takes no token
            one = dataclasses.replace(one, done=np.ones(1, bool))
        waiting.append((one, slot))
        if own_given:
            state = flushed(state)
            state = dataclasses.replace(
                state, given=put_in(state.given, (own_given,), np.array([slot], np.int32))
            )
        window = tuple(tokens[-window:]) if window else ()
        host = _Host(request, window, stops, done, prefix.table, offset)
        hosts = state.hosts[:slot] + (host,) + state.hosts[slot + 1 :]
        state = dataclasses.replace(state, hosts=hosts)
    return flushed(state)


def _check_pairs(state: SlotState, pairs: Sequence[tuple[Prefix, int]]) -> None:
    """Raises where a pair of :func:`insert_many` could not go in (before any goes in)."""
    running = [h is not None and not h.done for h in state.hosts]
    for prefix, slot in pairs:
        _slot(state, slot)
        if running[slot]:
            raise GenerationError(f"slot {slot} holds a running request: free it first")
        if prefix.rows.history.shape[1] != state.capacity:
            raise GenerationError("the prefix was made for slots of another capacity")
        running[slot] = prefix.unread or (prefix.first is not None and not prefix.first.done)


def _mask_of(engine: Engine, request: Request, eos: tuple[int, ...]):
    """The DeviceMask or HostMask of the request's constraint (None without one)."""
    if request.constraint is None:
        return None
    if not eos:
        raise GenerationError("structured output needs an eos token (eos_token_id is empty)")
    folder = hub.folder(engine.spec.repo, hub.SMALL_FILES)
    path = os.path.join(folder, "tokenizer.json")
    return constraints.processor(request.constraint, path, engine.vocab_size or 0, eos)


def _table_of(engine: Engine, request: Request, eos: tuple[int, ...]):
    """The table of the request's constraint (None without one): its device table, or a
    table of host rows (llguidance's matcher, called back from the step)."""
    mask = _mask_of(engine, request, eos)
    return None if mask is None else mask.table


def _start_state(engine: Engine, request: Request, r: dict[str, Any], table) -> int:
    """The request's first state in its table: -1 (none), 0, or a host row's handle."""
    if table is None:
        return -1
    if not table.host:
        return 0
    return int(_mask_of(engine, request, tuple(r["eos"])).start([(request.prompt, [])])[0])


def discard(prefix: Prefix) -> None:
    """Releases the host matcher of a prefix that will not be inserted, if it has one."""
    if prefix.table is not None and prefix.table.host:
        constraints.release(np.asarray(prefix.rows.constraint))


def _release(state: SlotState, slot: int) -> None:
    """Releases the host matcher of slot ``slot``'s request, if it has one."""
    host = state.hosts[slot]
    if host is not None and host.table is not None and host.table.host:
        constraints.release(np.asarray(state.rows.constraint[slot : slot + 1]))


def _joined(state: SlotState, slot: int, own) -> tuple[SlotState, int]:
    """``state`` whose table holds ``own`` (a TokenTable, or None) beside the tables of the
    other live slots, and where ``own`` starts in it (the live slots' states move with their
    tables)."""
    if own is None:
        return state, 0
    hosts = state.hosts
    live = [
        (i, h) for i, h in enumerate(hosts)
        if i != slot and h is not None and not h.done and h.table is not None
    ]  # fmt: skip
    for _, h in live:
        if h.table is own:
            return state, h.offset
    tables: list = []
    for t in [h.table for _, h in live] + [own]:
        if not any(t is u for u in tables):
            tables.append(t)
    table, starts = constraints.join(tables)

    def start(t) -> int:
        return next(o for u, o in zip(tables, starts, strict=True) if u is t)

    delta, keep, new_hosts = np.zeros(len(hosts), np.int32), np.zeros(len(hosts), bool), [*hosts]
    for i, h in live:
        delta[i], keep[i] = start(h.table) - h.offset, True
        new_hosts[i] = dataclasses.replace(h, offset=start(h.table))
    c = state.rows.constraint
    moved = jnp.where(jnp.asarray(keep) & (c >= 0), c + jnp.asarray(delta), -1)
    moved = jnp.where(c <= constraints.HOST_STATE, c, moved)  # host rows keep their handles
    rows = dataclasses.replace(state.rows, constraint=moved)
    return dataclasses.replace(state, rows=rows, hosts=tuple(new_hosts), table=table), start(own)


# ``done`` with row ``slot`` set, compiled once (an eager ``.at[slot].set`` compiles its
# scatter in each new process; this one is read from the compilation cache).
_finished = AutoStoredJit(lambda done, slot: done.at[slot].set(True), ("slots.finished", 1))


def free(state: SlotState, slot: int) -> SlotState:
    """``state`` with slot ``slot`` empty (it takes no more tokens; a new prefix may go there)."""
    _slot(state, slot)
    _release(state, slot)
    rows = dataclasses.replace(state.rows, done=_finished(state.rows.done, np.int32(slot)))
    hosts = state.hosts[:slot] + (None,) + state.hosts[slot + 1 :]
    return dataclasses.replace(state, rows=rows, hosts=hosts)


def settle(state: SlotState, firsts: Sequence[tuple[int, Token]]) -> SlotState:
    """``state`` with the first token of each ``(slot, token)`` of ``firsts`` given to its slot,
    which took an unread prefix (:attr:`Prefix.unread`): the stop strings' window holds it, and
    a slot that it ends is done (its tokens of a chunk launched before are dropped when read)."""
    hosts, ended = list(state.hosts), []
    for slot, token in firsts:
        _slot(state, slot)
        host = hosts[slot]
        if host is None or host.done:
            raise GenerationError(f"slot {slot} holds no running request to settle")
        tail = host.tail
        if host.stops is not None and not token.eos:
            tail = (tail + (token.token,))[-host.stops.window :]
        hosts[slot] = dataclasses.replace(host, tail=tail, done=token.done)
        if token.done:
            ended.append(slot)
    rows = state.rows
    if ended:  # the device's own for eos and max_new_tokens; a stop string's the host's
        rows = dataclasses.replace(rows, done=rows.done.at[jnp.asarray(ended)].set(True))
    return dataclasses.replace(state, rows=rows, hosts=tuple(hosts))


def generate(
    engine: Engine, state: SlotState, steps: int, program_steps: int | None = None
) -> tuple[SlotState, list[Token]]:
    """Up to ``steps`` decode steps of every live slot, in one compiled loop.

    Returns the state after them and the new tokens, step by step (slot order within a step).
    A stop string ends its slot on the host: the slot's later tokens of the chunk are dropped.
    ``program_steps``: run the program of chunks of that many steps (:func:`chunk_size`), so that
    chunks of other lengths share one program.
    """
    state, chunk = launch(engine, state, steps, program_steps)
    return finish(state, chunk)


@dataclasses.dataclass(frozen=True, eq=False)
class Chunk:
    """A decode chunk :func:`launch` dispatched, its tokens not read yet.

    Attributes:
        out: the device's StepOut of its steps, [size, B].
        longest: the most cache rows a live slot can hold after it (an upper bound).
    """

    out: StepOut
    longest: int


def launch(
    engine: Engine,
    state: SlotState,
    steps: int,
    program_steps: int | None = None,
    longest: int | None = None,
) -> tuple[SlotState, Chunk | None]:
    """Dispatches :func:`generate`'s chunk and returns without waiting for the device: the
    state holds the rows after the chunk (its arrays donated from ``state``'s), and
    :func:`finish` reads the chunk's tokens. A chunk may be launched on the rows of another
    that is not read yet: the device runs them in order. ``longest``: an upper bound on the
    live slots' lengths (:attr:`Chunk.longest` of the chunk before), where the slots read a
    window of the cache; None reads them (which waits for the rows). None: no live slot."""
    size = chunk_size(steps, program_steps)
    live = state.live_slots
    if not live:
        return state, None
    window = state.capacity
    if engine.slot_windows:
        if longest is None:
            longest = int(np.max(np.asarray(state.rows.lengths)[list(live)]))
        window = window_of(longest + steps, state.capacity)
    state = resized(engine, state, window)
    engine.compiled.steps.shapes.add(_decode_shape(engine, window))  # the decode shape it runs
    run = _chunk(engine, window, state.top_logprobs, size)
    params, embed = engine.model.params, _embed_params(engine)
    rows, out = run(params, embed, state.rows, state.given, np.int32(steps), state.live_table)
    bound = (longest if longest is not None else window) + steps
    return dataclasses.replace(state, rows=rows), Chunk(out, bound)


def _decode_shape(engine: Engine, window: int) -> tuple:
    """The shape :func:`launch` records in ``engine.compiled.steps.shapes`` for a window."""
    return (1, window, True) + ((window,) if engine.compiled.padded else ())


def ran(engine: Engine, window: int) -> bool:
    """Whether ``engine`` has launched a decode chunk over ``window`` rows in this process (its
    programs are loaded: a launch now neither compiles nor reads one)."""
    return _decode_shape(engine, window) in engine.compiled.steps.shapes


def finish(state: SlotState, chunk: Chunk | None) -> tuple[SlotState, list[Token]]:
    """The tokens of ``chunk`` (:func:`launch`; None: none), read as :func:`read` does, onto
    ``state``'s rows (those after ``chunk``, or after a chunk launched on them since): a slot
    that a stop string ends is marked done there, and its tokens of a later chunk dropped."""
    if chunk is None:
        return state, []
    return read(state, state.rows, jax.device_get(chunk.out))


def warm(engine: Engine, state: SlotState, steps: int) -> SlotState:
    """Compiles the decode chunks :func:`generate` runs for ``steps`` steps, one per window of
    the cache (:func:`windows`), running none of their steps; returns the state (its arrays
    were donated)."""
    size = program_size(steps)
    for window in windows(state.capacity):
        state = resized(engine, state, window)
        run = _chunk(engine, window, state.top_logprobs, size)
        params, embed = engine.model.params, _embed_params(engine)
        rows, _ = run(params, embed, state.rows, state.given, np.int32(0), state.live_table)
        state = dataclasses.replace(state, rows=rows)
    return state


def warm_moves(engine: Engine, state: SlotState, prefixes: Sequence[Prefix]) -> None:
    """Compiles, without running them, the moves between windows that requests make as they
    come and go: the slots' cache resized from each window of :func:`windows` to each other,
    and each of ``prefixes`` (one of each prefill window) put into the slots at each window
    (:func:`insert`: as it is where the window holds it, else cut to the window)."""
    own = _own(engine)

    def like(a: Any, shape: tuple | None = None) -> jax.ShapeDtypeStruct:
        # a committed array's program is another one than an uncommitted array's: keep which
        sharding = a.sharding if getattr(a, "committed", False) else None
        return jax.ShapeDtypeStruct(np.shape(a) if shape is None else shape, a.dtype,
                                    sharding=sharding)  # fmt: skip

    def shaped(tree: Any, rows: int) -> Any:
        """``tree``'s shapes, dtypes and placement, its self-attention cache at ``rows`` rows."""
        cache = {
            n: like(a, (*a.shape[:2], rows, *a.shape[3:])) if n in own else like(a)
            for n, a in tree.cache.items()
        }
        return dataclasses.replace(jax.tree.map(like, tree), cache=cache)

    sizes = windows(state.capacity)
    slots_at = {rows: shaped(state.rows, rows) for rows in sizes}
    for a in sizes:
        for b in sizes:
            if a != b:
                _resize_program(engine, b).warm(slots_at[a].cache)
    insert_ = _insert_function(jit_key(engine.jit_options), engine.placement is None)
    slot = jax.ShapeDtypeStruct((1,), jnp.int32)
    for prefix in prefixes:
        given = _rows_of(engine, prefix.rows.cache, state.capacity)
        whole = shaped(prefix.rows, given)
        for rows in sizes:
            moved = rows < given or (rows > given and engine.cache_mode.padded)  # as insert
            if moved:
                _resize_program(engine, rows).warm(whole.cache)
            one = shaped(prefix.rows, rows) if moved else whole
            insert_.warm(slots_at[rows], (one,), slot)


def read(state: SlotState, rows: Rows_, out: StepOut) -> tuple[SlotState, list[Token]]:
    """The host's part of a chunk: ``state`` with the device's ``rows`` after it, and the new
    tokens of ``out`` (host arrays [n, B]: n positions in order, token -1 where a slot took
    none), position by position (slot order within one). A stop string ends its slot on the
    host: the slot's later tokens are dropped and its row is marked done."""
    hosts = list(state.hosts)
    tokens: list[Token] = []
    ended = []
    live = state.live_slots
    for i in range(out.token.shape[0]):
        taking = [s for s in live if out.token[i, s] >= 0 and not hosts[s].done]
        for s in taking:
            token, host = _tokens(out, hosts[s].request, [s], i, True)[0], hosts[s]
            if host.stops is not None and not token.eos:
                tail = (host.tail + (token.token,))[-host.stops.window :]
                if host.stops.hit(list(tail)) and not token.done:
                    token = dataclasses.replace(token, done=True, finish_reason="stop")
                    ended.append(s)
                host = dataclasses.replace(host, tail=tail)
            hosts[s] = dataclasses.replace(host, done=token.done)
            tokens.append(token)
    if ended:
        rows = dataclasses.replace(rows, done=rows.done.at[jnp.asarray(ended)].set(True))
    return dataclasses.replace(state, rows=rows, hosts=tuple(hosts)), tokens


def _slot(state: SlotState, slot: int) -> None:
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(state.hosts):
        raise GenerationError(f"slot must be an integer in [0, {len(state.hosts)}), got {slot!r}")


def _pad_token(engine: Engine) -> int:
    vocab = engine.vocab_size or 2**31
    for token in (engine.options.pad_token_id, *engine.eos, 0):
        if token is not None and 0 <= token < vocab:
            return int(token)
    return 0
