"""Speculative decoding on the slots' step: draft, verify and accept inside one compiled loop.

Each step of a speculating slot drafts up to K tokens by prompt lookup (:mod:`.drafts`, on the
device), runs the target over its last token and the drafts as ONE step of length K + 1, and
selects a token at every position with the slot's own processors and warpers (the history of
position j holds the first j drafts, as transformers' ``_assisted_decoding``). It keeps the
longest prefix of drafts equal to the selected tokens, plus the selected token after them.

Greedy, every kept token is the target's argmax: the tokens are plain greedy decoding's. Sampled,
position j draws with the key of new token ``count + j``, as plain sampling does; a draft is kept
when the draw equals it, which is the speculative rule min(1, p/q) for a point-mass draft (with
the residual draw on rejection), so the tokens are plain sampling's for the same seed.

The cache is written for all K + 1 tokens; the slot's length advances by the kept ones, and the
mask hides the rejected rows until they are overwritten. This needs a cache whose rows a mask
hides (in_place, append): the slots' modes. A step runs at one of a few lengths (1, 2, 4, 8,
K + 1), the shortest that holds every slot's drafts, so a step without drafts costs one token;
live slots × length stays within :data:`STEP_TOKENS` (a large batch drafts less, or not at all).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..runtime.jit import jit_options
from . import drafts as drafting
from . import slots
from .decode import end_of_row
from .errors import GenerationError
from .processors import Rows
from .programs import program
from .select import argmax, cutoffs
from .steps import LIVE

if TYPE_CHECKING:
    from .engine import Engine


@dataclasses.dataclass(frozen=True)
class Stats:
    """What speculation did in a call.

    Attributes:
        tokens: new tokens of the steps after the prompts (eos ids included).
        steps: steps of the target after the prompts (each gives one token or more).
        drafted: drafted tokens verified.
        accepted: drafted tokens kept.
    """

    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def steps_saved(self) -> int:
        """Target steps plain decoding would have run in addition (accepted drafts)."""
        return self.accepted

    @property
    def acceptance(self) -> float:
        """Accepted over drafted tokens (NaN when none was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")


STEP_TOKENS = 16
"""The most tokens a verify step runs over its live slots (slots × step length): past it a step
is no longer bound by reading the weights, and drafting costs more than it saves. At batch 1 a
slot drafts up to 15 tokens, at batch 8 one each, from 16 slots on none."""

ROW_COST = {"cpu": 16.0}
"""By backend: a step's cost apart from its token rows, in rows (reading the weights against
computing one more row), which prices a verification's length (:func:`.drafts.worth`). Measured
on the default model on a 2-core AVX2 CPU: a step of 1 row 26 ms, of 16 rows 47-52 ms. Where the
kernels use 512-bit vectors and a step's rows fit one pass of the float32 product kernel
(:data:`WIDE_ROWS`), a row's products take half the cycles: :data:`WIDE_VECTORS` times it (the
default model's products on 2 AVX-512 cores: 8-11 rows 1.27-1.31x one row, about 30; 16 rows,
past one pass, 1.76x: about 19). Elsewhere :data:`ROW_COST_OTHER` (an accelerator's step stays
bound by the weights for far more rows; not measured here)."""
ROW_COST_OTHER = 256.0
WIDE_VECTORS = 2.0  # ROW_COST's factor where the CPU kernels' vectors hold 16 floats
WIDE_ROWS = 12  # rows of one pass of the float32 product kernel on 512-bit vectors (gemm.cc)


def row_cost(rows: int | None = None) -> float:
    """:data:`ROW_COST` of the default backend; times :data:`WIDE_VECTORS` on a CPU with 512-bit
    kernels where a step runs at most ``rows`` <= :data:`WIDE_ROWS` token rows (a single slot's
    verifications). Grounded prompts on AVX-512, 16 against 32: 1.92-1.93x against 2.00-2.09x
    plain greedy's speed (three runs each), open-ended prompts at least 0.96x either way; a
    batch of 8 slots (up to 16 rows a step) lost 8% at 32, and keeps 16."""
    backend = jax.default_backend()
    cost = float(ROW_COST.get(backend, ROW_COST_OTHER))
    wide = backend == "cpu" and kernels.build.vector_lanes() == 16
    if wide and rows is not None and rows <= WIDE_ROWS:
        cost *= WIDE_VECTORS
    return cost


def pauses(cost: float) -> bool:
    """Whether a prompt-lookup slot whose drafts keep failing pauses (:func:`.drafts.adapted`):
    where a step of two tokens costs over 1% more than one (``cost``: :func:`row_cost`)."""
    return (cost + 2) / (cost + 1) > 1.01


def lengths_of(width: int) -> tuple[int, ...]:
    """The step lengths of a chunk whose slots draft at most ``width`` tokens."""
    return tuple(sorted({n for n in (1, 2, 4, 8) if n <= width} | {width + 1}))


def speculating(engine: Engine, state: slots.SlotState) -> tuple[int, int]:
    """(the most drafted tokens, the longest n-gram) of the live slots of ``state``."""
    width = longest = 0
    for s in state.live_slots:
        r = slots._resolved(engine, state.hosts[s].request)
        if r["lookup"]:
            width, longest = max(width, r["lookup"]), max(longest, r["ngram"])
    return width, longest


# -- the device program -------------------------------------------------------------------------


# the tags of the keys a sampled slot's speculation draws with, beside the plain draw's
_UNIFORM, _RESIDUAL, _DRAFT = 1, 2, 3


def _key(seed, step, tag: int):
    """The key of ``tag``'s draw for the new token ``step`` of the slot of ``seed``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), tag)


def draft_draws(scores, seeds, steps):
    """Traced: the draft model's tokens [B] drawn from ``scores`` [B, V] (its warped scores)
    with the draft key of each slot's ``seeds`` [B] and new token index ``steps`` [B]."""

    def one(row, seed, step):
        return jax.random.categorical(_key(seed, step, _DRAFT), row)

    return jax.vmap(one)(scores, seeds, steps).astype(jnp.int32)


def speculative_sampling(p, q, drafts, seeds, steps):
    """Traced: the speculative sampling rule over a draft model's own distribution.

    Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); where it is rejected, the
    token is drawn from the normalised max(0, p_j - q_j). Kept up to the first rejection, the
    tokens are distributed as the target's (Leviathan et al.; transformers'
    ``_speculative_sampling``). The uniform and the residual's draw of position j use the keys
    of the slot's seed and new token index ``steps + j``, so the tokens are reproducible with
    the seed and independent of the other slots.

    Args:
        p: [B, D, V] the target's probabilities at the D draft positions (position j after the
            first j drafts).
        q: [B, D, V] the draft model's probabilities each draft was drawn from.
        drafts: [B, D] int32 the drafted tokens.
        seeds: [B] the slots' sampling seeds.
        steps: [B] int32 the new token index of position 0 (the slot's new tokens so far).

    Returns:
        (accepted [B, D] bool: draft j passes its test, tokens [B, D] int32: the draft where
        accepted, else the residual's draw)
    """
    batch, d = drafts.shape
    at = steps[:, None] + jnp.arange(d, dtype=steps.dtype)[None, :]  # [B, D]
    each = jnp.broadcast_to(seeds[:, None], (batch, d))
    p_d = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(jax.vmap(lambda seed, step: jax.random.uniform(_key(seed, step, _UNIFORM))))
    accepted = uniform(each, at) * q_d <= p_d  # u <= p / q, without dividing by q
    residual = jnp.maximum(p - q, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
    logits = jnp.where(residual > 0, jnp.log(residual), -jnp.inf)
    draw = jax.vmap(
        jax.vmap(lambda row, seed, step: jax.random.categorical(_key(seed, step, _RESIDUAL), row))
    )
    tokens = jnp.where(accepted, drafts, draw(logits, each, at).astype(jnp.int32))
    return accepted, tokens


def _q_width(engine: Engine) -> int:
    """The columns of the draft model's q: its vocabulary size (0: no draft model, or a size
    unknown, and a sampled slot's drafts are the draft's argmax, kept by equality)."""
    if engine.assistant is None:
        return 0
    return engine.assistant.vocab_size or engine.vocab_size or 0


def _fit(q, vocab: int):
    """``q`` [..., V] with ``vocab`` columns: zeros after V, or its first ``vocab``."""
    extra = vocab - q.shape[-1]
    if extra > 0:
        return jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, extra)])
    return q[..., :vocab]


def _verify_function(engine: Engine, capacity: int, k: int, length: int, width: int, pause: bool):
    """The pure ``verify(params, rows, tokens [B, width], count [B], q [B, width, V], guess [B])
    -> (rows, StepOut [B, W], accepted [B])`` of steps of ``length`` tokens (W = width + 1);
    ``q``: the draft model's probabilities of its drafts (a sampled slot it drafts for),
    [B, width, 0] without an assistant model; ``guess``: the n-grams' first proposal
    (:func:`.drafts.propose`), which takes a paused slot back to drafting where it is right;
    ``pause``: whether failing prompt-lookup slots pause (:func:`pauses`)."""
    spec, mode = engine.spec, engine.cache_mode
    step = engine.compiled.steps.function(True, None)
    masks = slots._device_masks(spec)
    names = {i.name for i in engine.model.inputs}
    axes, pad = slots._axes(engine), slots._pad_token(engine)
    drafted = length - 1
    sampled = _q_width(engine) > 0 and drafted > 0

    def verify(params, rows: slots.Rows_, tokens, count, q, guess):
        batch, columns = rows.history.shape
        live = ~rows.done
        count = jnp.where(live, jnp.minimum(count, drafted), 0)
        drafts = tokens[:, :drafted]  # [B, L - 1]
        fed = jnp.concatenate([rows.token[:, None], drafts], axis=1)  # [B, L]
        feed = {"tokens": jnp.where(live[:, None], fed, pad).astype(jnp.int32)}
        if "attention_mask" in names:
            feed["attention_mask"] = mode.mask(rows.lengths, length, capacity, xp=jnp)
        if axes:
            positions = (rows.lengths[:, None] + jnp.arange(length)[None, :]).astype(jnp.int32)
            feed["position_ids"] = (
                jnp.broadcast_to(positions, (3, batch, length)) if axes == 3 else positions
            )
        feed[LIVE] = live  # the products skip the rows of done slots
        last = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
        logits, cache = step(params, {}, rows.cache, feed, rows.lengths, last)  # logits [B, L, V]
        # position j selects after the slot's tokens and the first j drafts
        have = rows.prompt + rows.count  # [B]
        at = have[:, None] + jnp.arange(drafted)[None, :]
        full = rows.history.at[jnp.arange(batch)[:, None], at].set(drafts, mode="drop")
        seen = have[:, None] + jnp.arange(length)[None, :]  # [B, L] tokens each position sees
        visible = jnp.arange(columns)[None, None, :] < seen[..., None]  # [B, L, H]
        history = jnp.where(visible, full[:, None, :], -1).reshape(batch * length, columns)
        each = dataclasses.replace(rows, cache={}, history=rows.history[:, :0])
        each = jax.tree.map(lambda a: jnp.repeat(a, length, axis=0), each)
        steps = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
        each = dataclasses.replace(each, history=history, count=each.count + steps)
        views = Rows(history, each.prompt, each.prompt + each.count, each.prompt + each.max_new)
        scores = logits.reshape(batch * length, logits.shape[-1])
        chosen, logprob, top_ids, top_values, scores, total = slots._scored(
            spec, masks, k, scores, each, views
        )
        chosen = chosen.reshape(batch, length)
        agree = drafts == chosen[:, :drafted]  # greedy, or a point-mass draft: the same token
        drafting_ = jnp.arange(drafted)[None, :] < count[:, None]  # [B, L - 1]
        if sampled:  # a sampled slot the draft model drafts for: the p/q rule
            rule = live & rows.sample & rows.drafts.model  # [B]

            def by_rule(_):
                p = jax.nn.softmax(scores.reshape(batch, length, -1)[:, :drafted], axis=-1)
                q_ = _fit(q[:, :drafted], p.shape[-1])
                return speculative_sampling(p, q_, drafts, rows.seeds, rows.count)

            def none(_):
                return jnp.zeros(drafts.shape, bool), drafts

            kept, redrawn = jax.lax.cond(jnp.any(rule & (count > 0)), by_rule, none, None)
            use = rule[:, None] & drafting_
            agree = jnp.where(rule[:, None], kept, agree)
            chosen = chosen.at[:, :drafted].set(jnp.where(use, redrawn, chosen[:, :drafted]))
            logprob = (
                jnp.take_along_axis(scores, chosen.reshape(-1, 1), axis=-1)[:, 0] - total
            )  # the target's log-probability of the token kept
        agree = agree & drafting_
        accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)  # [B]
        # keep positions 0..accepted in order: eos or max_new_tokens may end the slot first
        history, token, counted, ended = rows.history, rows.token, rows.count, rows.done
        alive, out_token, out_done, out_ends = live, [], [], []
        for j in range(length):
            take = alive & (j <= accepted)
            ends, kept, after, done = end_of_row(
                chosen[:, j], take, rows.eos, counted, rows.max_new
            )
            where = jnp.where(kept, rows.prompt + counted, columns)
            history = history.at[jnp.arange(batch), where].set(chosen[:, j], mode="drop")
            token = jnp.where(kept, chosen[:, j], token)
            counted, ended, alive = after, ended | done, alive & ~done
            out_token.append(jnp.where(take, chosen[:, j], -1))
            out_done.append(ended | ~live)
            out_ends.append(ends)
        lengths = mode.advance(rows.lengths, jnp.where(live, accepted + 1, 0), length)
        pad_to = (
            lambda a, fill: jnp.concatenate(  # noqa: E731
                [a, jnp.full((batch, width + 1 - length) + a.shape[2:], fill, a.dtype)], axis=1
            )
        )
        out = slots.StepOut(
            pad_to(jnp.stack(out_token, axis=1), -1),
            pad_to(logprob.reshape(batch, length), 0.0),
            pad_to(top_ids.reshape(batch, length, k), 0),
            pad_to(top_values.reshape(batch, length, k), 0.0),
            pad_to(jnp.stack(out_done, axis=1), True),
            pad_to(jnp.stack(out_ends, axis=1), False),
        )
        rows = dataclasses.replace(
            rows,
            token=token,
            lengths=lengths.astype(jnp.int32),
            history=history,
            count=counted,
            done=ended,
            cache=cache,
            drafts=drafting.adapted(
                rows.drafts, count, accepted, live, guess >= 0, guess == chosen[:, 0], pause
            ),
        )
        return rows, out, jnp.where(live, count, 0)

    return verify


def _draft_function(engine: Engine, capacity: int, width: int):
    """The pure ``draft(params, rows, feeds) -> (tokens [B, width], cache, q [B, width, V])``:
    the assistant model's tokens after each slot's last token, ``feeds`` steps of one token into
    its cache from the slot's length (so that the cache holds the tokens the target verifies).
    A greedy slot's drafts are the draft model's argmax; a sampled slot's are drawn from its
    scores warped by the slot's temperature, top-k, top-p and min-p (and the specification's
    typical, epsilon and eta), ``q`` those probabilities (any q keeps the target's
    distribution; a closer one is accepted more often)."""
    assistant = engine.assistant
    step = assistant.compiled.steps.function(True, None)
    mode = assistant.cache_mode
    names = {i.name for i in assistant.model.inputs}
    axes, pad = slots._axes(assistant), slots._pad_token(assistant)

    options = engine.spec.options
    vocab = _q_width(engine)

    def draft(params, rows: slots.Rows_, feeds):
        batch = rows.token.shape[0]
        live = ~rows.done & rows.drafts.model
        drawing = live & rows.sample & (vocab > 0)  # else argmax drafts, verified as point masses

        def body(carry):
            i, token, cache, tokens, qs = carry
            at = (rows.lengths + i).astype(jnp.int32)
            feed = {"tokens": jnp.where(live, token, pad)[:, None].astype(jnp.int32)}
            feed[LIVE] = live  # the products skip the slots that do not draft with it
            if "attention_mask" in names:
                feed["attention_mask"] = mode.mask(at, 1, capacity, xp=jnp)
            if axes:
                feed["position_ids"] = (
                    jnp.broadcast_to(at[:, None], (3, batch, 1)) if axes == 3 else at[:, None]
                )
            logits, cache = step(params, {}, cache, feed, at, jnp.zeros(batch, jnp.int32))
            logits = jnp.asarray(logits, jnp.float32)
            chosen = argmax(logits)

            def drawn(qs):
                warped = cutoffs(slots._warp(logits, rows), options)
                q = jnp.where(drawing[:, None], jax.nn.softmax(warped, axis=-1), 0.0)
                q = _fit(q, vocab)
                token = draft_draws(warped, rows.seeds, rows.count + i)
                return jnp.where(drawing, token, chosen), qs.at[:, i].set(q, mode="drop")

            chosen, qs = jax.lax.cond(jnp.any(drawing), drawn, lambda qs: (chosen, qs), qs)
            tokens = tokens.at[:, i].set(chosen, mode="drop")  # the last feed's token: dropped
            return i + 1, chosen, cache, tokens, qs

        qs = jnp.zeros((batch, width, vocab), jnp.float32)
        tokens = jnp.zeros((batch, width), jnp.int32)
        start = (jnp.int32(0), rows.token, rows.drafts.cache, tokens, qs)
        _, _, cache, tokens, qs = jax.lax.while_loop(lambda c: c[0] < feeds, body, start)
        return tokens, cache, qs

    return draft


def _assistant_key(engine: Engine) -> tuple | None:
    helper = engine.assistant
    return None if helper is None else helper.compiled.steps.key("slots", True, None)


def _chunk(engine: Engine, capacity: int, k: int, size: int, width: int, longest: int):
    """The jitted ``(params, assistant params, rows, limit) -> (rows, StepOut [size, B,
    width + 1], drafted [size, B])``: up to ``limit`` speculative steps in a
    ``lax.while_loop``, the cache donated."""
    lengths = lengths_of(width)
    cost = row_cost()
    key = (
        "slots-speculative",
        engine.compiled.steps.key("slots", True, None),
        engine.spec.options.program_key,
        engine.spec.processors,
        capacity,
        k,
        size,
        width,
        longest,
        engine.compiled.steps.local(),
        _assistant_key(engine),
        cost,
    )

    def make():
        branches = [_verify_function(engine, capacity, k, n, width, pauses(cost)) for n in lengths]
        sizes = jnp.asarray(lengths, jnp.int32)
        draft = None if engine.assistant is None else _draft_function(engine, capacity, width)

        def run(params, helper, rows: slots.Rows_, limit):
            batch, w = rows.token.shape[0], width + 1
            out = slots.StepOut(
                jnp.full((size, batch, w), -1, jnp.int32),
                jnp.zeros((size, batch, w)),
                jnp.zeros((size, batch, w, k), jnp.int32),
                jnp.zeros((size, batch, w, k)),
                jnp.ones((size, batch, w), bool),
                jnp.zeros((size, batch, w), bool),
            )
            drafted = jnp.zeros((size, batch), jnp.int32)

            def more(carry):
                i, r, _, _ = carry
                return (i < limit) & ~jnp.all(r.done)

            def body(carry):
                i, r, out, drafted = carry
                live = ~r.done
                room = capacity - r.lengths  # the most tokens a step may write
                most = jnp.minimum(r.max_new - r.count - 1, room - 1)
                # the cost model: live slots × step length within STEP_TOKENS
                longest_step = STEP_TOKENS // jnp.maximum(jnp.sum(live), 1)
                most = jnp.minimum(most, longest_step - 1)
                most = jnp.where(live & (r.drafts.lookup > 0), jnp.maximum(most, 0), 0)
                have = r.prompt + r.count
                tokens, count, guess = drafting.propose(
                    r.history, have, r.drafts, most, width, longest
                )
                q = jnp.zeros((batch, width, 0), jnp.float32)  # no draft model: no q
                if draft is not None:  # the assistant model's slots
                    model = live & r.drafts.model
                    wanted = jnp.minimum(jnp.minimum(r.drafts.k, r.drafts.lookup), most)
                    wanted = jnp.where(model, wanted, 0)
                    feeds = jnp.where(jnp.any(model), jnp.max(wanted) + 1, 0)
                    drafted_by, cache, q = draft(helper, r, feeds)
                    r = dataclasses.replace(r, drafts=dataclasses.replace(r.drafts, cache=cache))
                    tokens = jnp.where(model[:, None], drafted_by, tokens)
                    count = jnp.where(model, wanted, count)
                want = jnp.max(count) + 1
                fits = jnp.min(jnp.where(live, room, capacity))
                shortest = jnp.sum(sizes < want)  # the shortest length that holds every draft
                longest_fit = jnp.sum(sizes <= fits) - 1
                top = jnp.clip(jnp.minimum(shortest, longest_fit), 0, len(lengths) - 1)
                # the length worth most (prompt lookup's drafts may be cut: they never change
                # the tokens; a draft model's are not, its sampled draws would)
                modeled = jnp.max(jnp.where(live & r.drafts.model, count, 0)) + 1
                least = jnp.minimum(jnp.sum(sizes < modeled), top)
                rows = live.shape[0] * lengths[-1]  # the most token rows of a step
                values = drafting.worth(r.drafts, count, live, lengths, row_cost(rows))
                at = jnp.arange(len(lengths))
                index = jnp.argmax(jnp.where((at >= least) & (at <= top), values, -jnp.inf))
                r, o, d = jax.lax.switch(index, branches, params, r, tokens, count, q, guess)
                out = jax.tree.map(lambda a, b: a.at[i].set(b.astype(a.dtype)), out, o)
                return i + 1, r, out, drafted.at[i].set(d)

            start = (jnp.int32(0), rows, out, drafted)
            _, rows, out, drafted = jax.lax.while_loop(more, body, start)
            return rows, out, drafted

        return jax.jit(run, donate_argnums=(2,), **jit_options(dict(engine.jit_options)))

    return program(key, make, engine.compiled.steps.held)


# -- the slots' verb ----------------------------------------------------------------------------


def generate(
    engine: Engine, state: slots.SlotState, steps: int, program_steps: int | None = None
) -> tuple[slots.SlotState, list[slots.Token]]:
    """:func:`.slots.generate` where some live slot speculates: up to ``steps`` steps, each of
    which gives a slot one token or more. The tokens come in order (slot order within a step's
    position). ``program_steps``: as :func:`.slots.generate`'s."""
    size = slots.chunk_size(steps, program_steps)
    width, longest = speculating(engine, state)
    if not width or state.live_table is not None:
        # no slot speculates, or a live slot is constrained (the verify step reads no constraint
        # table): plain steps, which give a speculating slot the same tokens, one at a time
        return slots.generate(engine, state, steps, program_steps)
    state = slots.resized(engine, state, state.capacity)  # its steps read the whole capacity
    engine.compiled.steps.shapes.add((width, state.capacity, True))  # its verify steps' widest
    run = _chunk(engine, state.capacity, state.top_logprobs, size, width, longest)
    helper = {} if engine.assistant is None else engine.assistant.model.params
    rows, out, _ = run(engine.model.params, helper, state.rows, np.int32(steps))
    out = jax.tree.map(_positions_in_order, jax.device_get(out))
    return slots.read(state, rows, out)


def _positions_in_order(a: np.ndarray) -> np.ndarray:
    """[size, B, W, ...] -> [size * W, B, ...]: the positions of a step one after another."""
    return np.swapaxes(a, 1, 2).reshape((a.shape[0] * a.shape[2], a.shape[1]) + a.shape[3:])


def stats(state: slots.SlotState, slot: int) -> Stats:
    """What speculation did for the request in ``slot`` so far: its new tokens after the first,
    the target's steps, the drafted and the accepted tokens."""
    d, count = jax.device_get((state.rows.drafts, state.rows.count))
    tokens = max(int(count[slot]) - 1, 0)
    return Stats(tokens, int(d.steps[slot]), int(d.drafted[slot]), int(d.accepted[slot]))


# -- generate() ---------------------------------------------------------------------------------


def check(engine: Engine, inputs: dict[str, Any]) -> None:
    """Raises GenerationError when ``engine`` cannot decode speculatively, saying why."""
    refusal = engine.cache_mode.slot_refusal() or engine.cache_mode.draft_refusal()
    if refusal:
        raise GenerationError(
            f"prompt_lookup_num_tokens (speculative decoding) needs a cache whose rejected rows "
            f"a mask hides (in_place or append), and {engine.spec.model.path!r} has a grow "
            f"cache: {refusal}. Generate without prompt_lookup_num_tokens"
        )
    if engine.placement is not None:
        raise GenerationError(
            "prompt_lookup_num_tokens (speculative decoding) runs on one device: generate "
            "without it on a mesh"
        )
    try:
        slots.check(engine)
    except GenerationError as error:
        raise GenerationError(
            f"prompt_lookup_num_tokens (speculative decoding) runs on the slots' step, which "
            f"refuses this: {error}. Generate without prompt_lookup_num_tokens"
        ) from None
    extra = sorted(set(inputs) - {"encoder_input_ids"})
    if extra:
        raise GenerationError(
            f"prompt_lookup_num_tokens (speculative decoding) takes token prompts only, not {extra}"
        )
