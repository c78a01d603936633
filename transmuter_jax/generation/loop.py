"""compile() and generate(): the host loop as verbs (prefill, decode, select) over the rows.

Where the slots run the specification, ``generate`` is a loop over their API
(:func:`through_slots`, :mod:`.slot_loop`). Elsewhere it runs each group of rows that share a
cache: ``prefill`` feeds the prompts in steps
of the prefill rule on the host (rows that finish their prompt early take tokens meanwhile),
then ``decode`` runs the rest with the slots' step (:mod:`.chunk`) in chunks of up to
``decode_steps`` (``decode_steps=1``: the same step with a limit of one) or, where the host
selects (beam search, a task's own processors) or the cache changes shape every step
(exact-length grow), one host step at a time. Host steps select with the slots' selection and
:func:`.decode.end_of_row`, or with a strategy of their own (:class:`Sampler` with a task's
processors, :class:`BeamSearch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..onnx.dtypes import device_dtype
from ..onnx.qkv import split_qkv
from ..parallel import sharding
from . import cache as cache_modes
from . import constraints, slot_loop, slots, speculative
from .beam import BeamPrompt
from .chunk import Decoder, choose
from .chunk import rows as device_rows
from .context import Context
from .decode import end_of_row
from .engine import Compiled, Engine
from .errors import GenerationError
from .processors import Rows, static_masks
from .programs import jit_key, program
from .select import beam_selection, selection
from .slot_inputs import axes as _position_axes
from .steps import Steps, pad_grow

OnToken = Callable[[dict[str, np.ndarray]], None]
RETURN_STRIDE = 0x9E3779B9  # 2**32 / golden ratio: the seeds of a prompt's sequences step by it


GROW_CACHES = cache_modes.GROW_CACHES


def compile(  # noqa: A001
    ctx: Context,
    batch_size: int,
    *,
    grow_cache: str = "padded",
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    shard_overrides: Mapping[str, PartitionSpec | None] | None = None,
    shard_small: int = sharding.SMALL,
    capacity: int = slots.CAPACITY,
    top_logprobs: int = 5,
    **jit_options: Any,
) -> Engine:
    """The engine of ``ctx`` for batches of ``batch_size`` prompts (or slots).

    Args:
        ctx: the specification, from :func:`context`.
        batch_size: the most prompts a call of :func:`generate` takes: the engine's slots.
        grow_cache: in grow mode, "padded" runs the decoder rewritten for a padded cache whose
            capacity is each group's prompt and new tokens rounded up to 64 (its prompt steps
            and one decode shape); "buckets" grows that cache 64 rows at a time as it fills (two
            decode shapes per 64 rows, fewer padding rows read); "exact" keeps exact lengths
            (one shape per length). A graph the rewrite does not understand keeps exact lengths
            (``compiled.unpadded`` says why).
        mesh: a mesh with axes "model" (weights and cache heads split, see
            :mod:`.sharding`) and/or "data" (batch rows; a batch it does not divide is
            padded with padding rows up to a multiple of it).
        devices: without ``mesh``, the devices of a mesh that puts them all on "model".
        shard_overrides: partition specs by initializer name that win over the sharding
            rules (None: replicated).
        shard_small: embeddings and LM heads of fewer elements stay replicated.
        capacity: the cache rows of each slot (prompt and new tokens; a multiple of 64, at most
            the model's positions) for the slots API (docs/engine.md).
        top_logprobs: the most top_logprobs a slot's request may ask for.
        **jit_options: options of ``jax.jit`` for the step and the selection.

    Returns:
        A frozen :class:`Engine`; its programs come from one cache shared by the engines that
        agree on what determines them. Call this in the serving process.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GenerationError(f"batch_size must be a positive integer, got {batch_size!r}")
    if grow_cache not in GROW_CACHES:
        raise GenerationError(f"grow_cache must be one of {GROW_CACHES}, got {grow_cache!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise GenerationError(f"top_logprobs must be a non-negative integer, got {top_logprobs!r}")
    if mesh is None and devices is not None:
        mesh = sharding.make_mesh(devices)
    if mesh is not None:  # padding rows up to a multiple of the "data" axis
        batch_size = sharding.padded_batch(mesh, batch_size)
    engine = Engine(ctx, batch_size, ctx.model, ctx.embed, tuple(sorted(jit_options.items())))
    engine = dataclasses.replace(
        engine, slot_capacity=slots.capacity_of(engine, capacity), slot_top_logprobs=top_logprobs
    )
    options = ctx.options
    select = _selection(ctx, jit_options)
    reorder = program(
        ("reorder", ctx.cache, jit_key(jit_options)),
        lambda: cache_modes.reorder_function(ctx.cache, **jit_options),
    )
    if mesh is not None and sharding.axis_size(mesh, sharding.MODEL) > 1:
        # fused q/k/v products as one each, so that they split by heads (see .qkv)
        engine = dataclasses.replace(engine, model=split_qkv(engine.model))
    probe = engine
    mode, padding, runs, reason = ctx.cache_mode.compiled(grow_cache, lambda: pad_grow(probe))
    if mesh is not None:  # the weights placed on the mesh (after the padded rewrite's probe)
        engine = sharding.apply(
            engine, mesh, batch_size, small=shard_small, overrides=shard_overrides
        )
    steps = Steps(engine, mode, padding)
    decoder = _decoder(engine, steps, select, options)
    compiled = Compiled(steps, select, reorder, runs, reason, decoder)
    assistant = None
    if ctx.assistant is not None:  # the draft model: slots of the same capacity
        assistant = compile(ctx.assistant, batch_size, capacity=capacity, top_logprobs=0,
                            mesh=mesh, **jit_options)  # fmt: skip
    return dataclasses.replace(engine, compiled=compiled, assistant=assistant)


def _selection(ctx: Context, jit_options: Mapping[str, Any]):
    """The compiled selection of ``ctx``'s options and processors, from the program cache
    (a task's own processors have no stable name: theirs is made for this engine)."""
    options = ctx.options
    make = beam_selection if options.num_beams > 1 else selection

    def build():
        masks = static_masks(options, ctx.vocab_size or 0)  # once, not every step
        return make(options, tuple(ctx.processors), masks, **jit_options)

    names = constraints.program_names(ctx.processors)  # a device constraint's table is input
    if any(not isinstance(p, str) for p in names):
        return build()
    key = ("select", make.__name__, options.program_key, names, ctx.vocab_size)
    return program(key + (jit_key(jit_options),), build)


def _decoder(ctx: Engine, steps: Steps, select, options) -> Decoder | None:
    """The decode programs: the slots' step in chunks of up to ``decode_steps`` (with
    ``decode_steps=1``, the same step with a limit of one); None where the host selects (beam
    search, a task's own processors) or the cache changes shape every step (exact-length grow)."""
    custom = any(not isinstance(p, str) for p in constraints.program_names(ctx.processors))
    size = steps.mode.chunk_size(options.decode_steps)
    if size < 1 or options.num_beams > 1 or custom:
        return None
    mask = constraints.device_mask(ctx.processors)  # a finite constraint: its table on device
    if isinstance(mask, constraints.HostMask) and ctx.placement is not None:
        return None  # host rows call back from one device: over a mesh, host steps
    return Decoder(size, int(options.top_logprobs), mask)


def on_device(ctx: Engine) -> bool:
    """Whether ``ctx`` decodes in chunks of several steps on the device (else one step at a time:
    the slots' step with a limit of one, or the host's selection)."""
    compiled = getattr(ctx, "compiled", None)
    if compiled is None:
        raise GenerationError("call generation.compile(ctx, batch_size) first")
    return compiled.decoder is not None and compiled.decoder.size > 1


@dataclasses.dataclass
class _Row:
    prompt: list[int]
    max_new: int
    seed: int = 0
    positions: np.ndarray | None = None  # [axes, len(prompt)] given prompt positions
    delta: int = 0  # position of a token after the prompt: its index + delta
    features: int = 0  # index of the row's first image feature
    fed: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    done: bool = False
    encoder: list[int] | None = None  # the encoder's input ids, where a processor reads them


def new_tokens(ctx: Context, prompt_length: int) -> int:
    """The most new tokens a prompt of ``prompt_length`` tokens gets: max_new_tokens, else
    max_length minus the prompt, else 256 when max_length is GenerationConfig's default."""
    options = ctx.options
    if options.max_new_tokens is not None:
        return int(options.max_new_tokens)
    if options.max_length is None or options.max_length == 20:
        return 256
    return max(int(options.max_length) - prompt_length, 0)


def generate(
    ctx: Engine,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    inputs: Mapping[str, Any] | None = None,
    on_token: OnToken | None = None,
    *,
    clamp: bool = False,
) -> list[list[int]]:
    """Generates tokens after each prompt.

    Args:
        ctx: from :func:`compile`.
        prompts: token ids of each prompt; an empty prompt is a padding row that gives no tokens.
        seeds: the sampling seed of each prompt (any integer: its low 32 bits are used); with
            num_return_sequences n > 1, sequence j of a prompt samples with
            :func:`return_seed` (seed, j), so sequence 0 is the one n = 1 gives.
        inputs: the inputs the context names in ``given`` (one row per prompt); also
            "image_features" [count, hidden] (the features of the image tokens of all rows, in
            order), "position_ids" (per prompt: positions per axis per token, or empty) and
            "encoder_input_ids" (per prompt: the encoder's input ids, which
            encoder_repetition_penalty and encoder_no_repeat_ngram_size read; required for an
            encoder-decoder, a decoder-only model's are its prompts).
        on_token: called after each step with "token" [rows] int32 (-1: no new token) and
            "finished" [rows] bool (and "logprob"; with top_logprobs "top_ids" and
            "top_logprobs" [rows, k]; in beam search "score", and with num_return_sequences
            n > 1 "scores" [prompts, n]); in order, one call per step, delivered as each decode
            chunk returns. When sampling with n > 1 the rows are the sequences: prompt p's
            sequence j is row p * n + j; in beam search they are the prompts.
        clamp: give a row no more new tokens than the model has positions left for
            (``ctx.position_limit``); without it, a row that would run past them is refused.

    Returns:
        The new tokens of each row, without the eos token; with the option token_logprobs,
        (token, log-probability) pairs; with top_logprobs=k, (token, log-probability, top)
        triples, ``top`` the k most probable (token, log-probability) pairs, best first.
        With num_return_sequences n > 1, each prompt's entry is the list of its n sequences
        (beam search: its n best hypotheses, best first).
    """
    inputs = dict(inputs or {})
    prompts = [list(p) for p in prompts]
    _validate(ctx, prompts, seeds, inputs)
    speculates = ctx.options.speculative or ctx.assistant is not None
    if speculates:  # docs/speculative.md: the slots must run it
        speculative.check(ctx, inputs)
    if speculates or through_slots(ctx, inputs):  # a loop over the slots' API
        returns = int(ctx.options.num_return_sequences)  # each sequence a row of its own
        rows = _returns(_rows(ctx, prompts, seeds, inputs, clamp)[: len(prompts)], returns)
        own = _row_inputs(ctx, rows, inputs, returns)
        each = [(r.prompt, r.max_new, r.seed, o) for r, o in zip(rows, own, strict=True)]
        kept = slot_loop.run(ctx, each, on_token)[0]
        return (
            kept if returns == 1 else [kept[i : i + returns] for i in range(0, len(kept), returns)]
        )
    run = _Run.start(ctx, prompts, seeds, inputs, on_token, clamp)
    for group in run.groups():
        state = run.prefill(group)
        run.decode(group, state)
    return run.strategy.results(run)


def through_slots(ctx: Engine, inputs: Mapping[str, Any]) -> bool:
    """Whether :func:`generate` runs as a loop over the slots' API (:mod:`.slot_loop`): where
    the slots run the specification (:func:`.slots.check`; sampling with n > 1 too: each
    sequence in a slot of its own), each row's inputs (an encoder's outputs, image features,
    M-RoPE positions) its request's. Elsewhere (beam search, a task's own processors, a
    processor that reads the encoder's ids, a mesh, a grow cache of exact lengths) it runs its
    rows on the host with the same step (the slots run on a mesh: docs/engine.md)."""
    if ctx.options.encoder_ids or ctx.placement is not None:
        return False
    try:
        slots.check(slot_loop.single(ctx))
    except GenerationError:
        return False
    return True


def _validate(ctx: Engine, prompts, seeds, inputs) -> None:
    if getattr(ctx, "compiled", None) is None:
        raise GenerationError("call generation.compile(ctx, batch_size) before generate")
    if len(prompts) > ctx.batch_size:
        raise GenerationError(
            f"{len(prompts)} prompts but the context is compiled for batches of {ctx.batch_size}"
        )
    if len(seeds) != len(prompts):
        raise GenerationError(f"seeds has {len(seeds)} values for {len(prompts)} prompts")
    for i, seed in enumerate(seeds):
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise GenerationError(f"seed {i} must be an integer, got {seed!r}")
    vocab, limit = ctx.vocab_size, ctx.position_limit
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < (vocab or 2**31)]
        if bad:
            raise GenerationError(
                f"prompt {i} has token ids outside the vocabulary of {vocab}: {bad}"
            )
        if limit is not None and len(prompt) > limit:
            raise GenerationError(
                f"prompt {i} has {len(prompt)} tokens, more than the model's {limit} positions"
            )
    encoder = inputs.get("encoder_input_ids")
    if encoder is not None and len(encoder) != len(prompts):
        raise GenerationError(
            f"encoder_input_ids has {len(encoder)} rows for {len(prompts)} prompts"
        )
    if ctx.options.encoder_ids and encoder is None and "encoder_hidden_states" in ctx.given:
        raise GenerationError(
            "encoder_repetition_penalty and encoder_no_repeat_ngram_size read the encoder's "
            'input ids: pass inputs["encoder_input_ids"]'
        )
    features = inputs.get("image_features")
    if features is not None and ctx.image_token is not None:
        count = sum(list(p).count(ctx.image_token) for p in prompts)
        if count > np.shape(features)[0]:
            raise GenerationError(
                f"the prompts have {count} image tokens but image_features has "
                f"{np.shape(features)[0]} rows"
            )
    for name in ctx.given:
        if name not in inputs:
            what = " (a cross-attention cache, which the encoder computes)"
            what = what if name in ctx.cache.given else ""
            raise GenerationError(f"missing input {name!r}{what}, which the context says is given")
        if np.shape(inputs[name])[0] != len(prompts):
            raise GenerationError(
                f"input {name!r} has {np.shape(inputs[name])[0]} rows for {len(prompts)} prompts"
            )


def _rows(ctx: Engine, prompts, seeds, inputs, clamp: bool) -> list[_Row]:
    """The rows of a call, padded to the batch; raises ValueError for a row that would run past
    the model's positions (unless ``clamp``: then it gets the tokens that fit)."""
    rows, features, limit = [], 0, ctx.position_limit
    positions = inputs.get("position_ids") or [None] * len(prompts)
    encoders = inputs.get("encoder_input_ids")
    if encoders is None:
        encoders = prompts  # a decoder-only model's encoder ids are its prompt (transformers)
    for prompt, seed, given, encoder in zip(prompts, seeds, positions, encoders, strict=True):
        prompt = [int(t) for t in prompt]
        row = _Row(prompt, new_tokens(ctx, len(prompt)) if prompt else 0, int(seed))
        if ctx.options.encoder_ids:
            row.encoder = [int(t) for t in np.asarray(encoder).reshape(-1)]
        row.features = features
        if given is not None and len(given):
            row.positions = np.asarray(given, np.int64).reshape(-1, len(prompt))
            row.delta = int(row.positions.max()) + 1 - len(prompt)
        if ctx.image_token is not None:
            features += sum(1 for t in prompt if t == ctx.image_token)
        room = None if limit is None else max(limit - len(prompt) - max(row.delta, 0), 0)
        if room is not None and row.max_new > room:
            if not clamp:
                raise GenerationError(
                    f"prompt {len(rows)} has {len(prompt)} tokens and asks for {row.max_new} "
                    f"new ones, more than the model's {limit} positions: ask for at most {room}"
                )
            row.max_new = room
        row.done = not prompt or row.max_new == 0
        rows.append(row)
    while len(rows) < ctx.batch_size:
        rows.append(_Row([], 0, done=True))
    return rows


def _given(ctx: Engine, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The given inputs padded to the batch with copies of their first row (ours, not theirs)."""
    padded = {}
    dtypes = {i.name: device_dtype(np.dtype(i.dtype)) for i in ctx.model.inputs}
    for name in ctx.given:
        value = jnp.asarray(inputs[name]).astype(dtypes[name])
        missing = ctx.batch_size - value.shape[0]
        if missing:
            value = jnp.concatenate([value, jnp.repeat(value[:1], missing, axis=0)])
        padded[name] = value
    return padded


@dataclasses.dataclass
class _Step:
    """The host arrays of one step: what each row feeds."""

    tokens: np.ndarray  # [B, S] int32, padding after each row's real tokens
    real: np.ndarray  # [B] real tokens of each row
    remaining: np.ndarray  # [B] prompt tokens each row had left before the step
    positions: np.ndarray  # [axes, B, S] position of each token
    image_mask: np.ndarray  # [B, S] image tokens to replace with features
    image_rows: np.ndarray  # [B, S] the feature row of each image token

    def taking(self) -> np.ndarray:
        """The rows that take a token after this step: those it fed their prompt's last
        tokens, or a new token."""
        return np.flatnonzero((self.real > 0) & (self.remaining <= self.real))


@dataclasses.dataclass
class _Run:
    """One call of generate: the rows, their given inputs, the selection strategy."""

    ctx: Engine
    rows: list[_Row]
    given: dict[str, jax.Array]
    features: np.ndarray | None
    strategy: Sampler | BeamSearch
    on_token: OnToken | None
    n: int  # the caller's rows (the others pad the batch); in beam search, the prompts
    members: np.ndarray = None  # [B] bool rows of the group that runs now
    width: int = 0  # columns of the processors' history of the group that runs now

    @classmethod
    def start(cls, ctx, prompts, seeds, inputs, on_token, clamp) -> _Run:
        features = inputs.get("image_features")
        features = None if features is None else np.asarray(features)
        rows = _rows(ctx, prompts, seeds, inputs, clamp)
        given = _given(ctx, inputs)
        n, returns = len(prompts), int(ctx.options.num_return_sequences)
        if ctx.options.num_beams > 1:
            strategy = BeamSearch(ctx, rows, n)
            rows, expand = strategy.rows, strategy.k
        else:
            strategy = Sampler(returns)
            rows, expand, n = _returns(rows, returns), returns, n * returns
        if expand > 1:
            given = {name: jnp.repeat(v, expand, axis=0) for name, v in given.items()}
        return cls(ctx, rows, given, features, strategy, on_token, n)

    def groups(self) -> list[list[int]]:
        """The rows that share a cache: all of them, or in grow those with prompts of one
        length."""
        rows = self.rows
        active = {i: len(row.prompt) for i, row in enumerate(rows) if not row.done}
        return self.ctx.compiled.cache.groups(active)

    def live(self) -> bool:
        """Whether a row of the group that runs now takes more tokens."""
        return any(not self.rows[i].done for i in np.flatnonzero(self.members))

    def remaining(self) -> np.ndarray:
        """[B] prompt tokens each live row of the group has still to feed."""
        return np.array(
            [
                len(r.prompt) - r.fed if self.members[i] and not r.done else 0
                for i, r in enumerate(self.rows)
            ]
        )

    # -- the verbs --------------------------------------------------------------------------

    def prefill(self, group: list[int]) -> cache_modes.State:
        """A new cache for ``group``, fed every prompt of the group in steps of the prefill rule
        (``ctx.spec.prefill``: buckets, or powers of two)."""
        ctx, rows = self.ctx, self.rows
        self.members = np.zeros(len(rows), bool)
        self.members[group] = True
        longest = max(len(rows[i].prompt) + rows[i].max_new for i in group)
        mode = ctx.compiled.cache
        prompt = max(len(rows[i].prompt) for i in group)
        first = mode.prompt_step(prompt, ctx.spec.prefill)
        states = self.given.get("encoder_hidden_states")
        encoder = 0 if states is None else int(states.shape[1])
        capacity = mode.capacity(longest, first, prompt)
        alone = mode.first_rows(first, prompt)  # the first step in a buffer of its own rows
        alone = alone if alone is not None and alone < capacity else None
        state = cache_modes.State(mode, ctx.cache, len(rows), alone or capacity, encoder)
        if ctx.placement is not None:
            state.arrays = ctx.placement.place_cache(state.arrays)
        self.width = cache_modes.bucket(longest)
        while self.live() and self.remaining().max() > 0:
            self.step(state)
        if alone is not None and self.live():  # its rows first, then zeros the mask hides
            state.arrays = slots._resized_cache(ctx, state.arrays, capacity)
            if ctx.placement is not None:
                state.arrays = ctx.placement.place_cache(state.arrays)
            state.rows = capacity
        return state

    def decode(self, group: list[int], state: cache_modes.State) -> None:
        """Runs the group's rows until each is done: in chunks on the device where it can."""
        decoder = self.ctx.compiled.decoder
        mode = self.ctx.compiled.cache
        while self.live():
            room = 0
            if decoder is not None:  # a padded grow bucket may hold fewer more tokens
                room = mode.room(decoder.size, state.capacity, int(state.lengths.max()))
            if room < 1:  # the host's selection, or a full grow bucket that grows
                self.step(state)
            else:  # the slots' step: up to ``room`` of them in one program
                self.chunk(decoder, state, room)

    def step(self, state: cache_modes.State) -> None:
        """One step on the host: the next part of each prompt, or each row's last new token."""
        ctx = self.ctx
        mode = ctx.compiled.cache
        step = self.plan(state.lengths)
        size = step.tokens.shape[1]
        # room for this step's tokens (padded grow buckets grow 64 rows at a time)
        state.capacity = mode.grown(state.capacity, int(state.lengths.max()), size)
        feed = _feed(ctx, step.tokens, step.positions, state, self.given, _position_axes(ctx))
        if step.image_mask.any() and self.features is not None:
            feed["image_mask"] = step.image_mask
            feed["image_features"] = self.features[step.image_rows]
        last = np.maximum(step.real - 1, 0).astype(np.int32)  # each row's last real token
        logits, state.arrays = ctx.compiled.steps(
            state.arrays, feed, state.lengths, last, state.capacity, step.real
        )
        order = self.strategy.select(self, logits, step)
        logits.delete()
        if order is not None:
            state.arrays = ctx.compiled.reorder(state.arrays, np.asarray(order, np.int32))
        state.advance(step.real, size)

    def chunk(self, decoder: Decoder, state: cache_modes.State, room: int) -> None:
        """Up to ``room`` decode steps on the device; then the host takes their tokens."""
        rows, members, ctx = self.rows, self.members, self.ctx
        live = np.array([members[i] and not r.done for i, r in enumerate(rows)])
        constraint = None
        if decoder.mask is not None:  # each row's state of the constraint (a table's, a handle)
            given = [
                (r.prompt, r.generated) if on else None for r, on in zip(rows, live, strict=True)
            ]
            constraint = decoder.mask.start(given)
        device = self.device_rows(live, state.lengths.astype(np.int32), state.arrays, constraint)
        state.arrays = None  # donated
        try:
            result, out = decoder(ctx, device, self.given, room, state.capacity)
        finally:
            if constraint is not None:
                decoder.mask.release(constraint)
        state.arrays = result.cache
        options = ctx.options
        for i in range(out.token.shape[0]):
            token = out.token[i]
            if not (token >= 0).any():  # a step the loop did not run
                break
            logprob, top = _columns(out, i, options)
            shown = token.copy()  # a row a stop string ended takes no more of the chunk's tokens
            for b in np.flatnonzero(token >= 0):
                row = rows[b]
                if row.done:
                    shown[b] = -1
                    continue
                if not out.ends[i, b]:  # decode.end_of_row's verdict, in the step
                    _keep(row, int(token[b]), logprob, top, b)
                row.done = bool(out.done[i, b]) or _stopped(ctx, row)
            self.emit(shown, logprob, top)
            state.advance((token >= 0).astype(np.int32), 1)
            if not self.live():  # stop strings ended every row before the chunk's end
                break

    def device_rows(
        self, live: np.ndarray, lengths: np.ndarray, cache, constraint: np.ndarray | None = None
    ) -> Any:
        """The rows as the slots' per-row arrays (:func:`.chunk.rows`); ``live``: [B] the rows
        that take a token; ``constraint``: [B] their states in a constraint's table, or None."""
        rows, ctx = self.rows, self.ctx
        delta = np.array([r.delta for r in rows], np.int32)
        return device_rows(
            ctx,
            token=np.array([r.generated[-1] if r.generated else 0 for r in rows], np.int32),
            lengths=lengths,
            history=_history(rows, self.width),
            prompt=np.array([len(r.prompt) for r in rows], np.int32),
            count=np.array([len(r.generated) for r in rows], np.int32),
            max_new=np.array([r.max_new for r in rows], np.int32),
            seeds=_seeds(rows),
            done=~live,
            delta=delta if _position_axes(ctx) and delta.any() else None,
            encoder=_encoder(rows, ctx),
            cache=cache,
            constraint=constraint,
        )

    def emit(self, token: np.ndarray, logprob: np.ndarray | None, top: np.ndarray | None) -> None:
        """Calls on_token with one step's event of the caller's rows."""
        if self.on_token is None:
            return
        n, options = self.n, self.ctx.options
        event = {"token": token[:n], "finished": np.array([r.done for r in self.rows[:n]])}
        if logprob is None and options.logprobs:  # a step of prompts only
            logprob = np.full(len(token), np.nan, np.float32)
        if logprob is not None:
            event["logprob"] = np.where(token[:n] >= 0, logprob[:n], np.nan)
        if options.top_logprobs:
            k = options.top_logprobs
            if top is None:
                top = np.zeros((len(token), 2 * k), np.int32)
            pairs = top[:n].reshape(n, k, 2)
            event["top_ids"] = np.where(token[:n, None] >= 0, pairs[..., 0], -1)
            values = pairs[..., 1].copy().view(np.float32)
            event["top_logprobs"] = np.where(token[:n, None] >= 0, values, np.nan)
        self.on_token(event)

    # -- the host step's arrays -------------------------------------------------------------

    def plan(self, start: np.ndarray) -> _Step:
        """What each row of the group feeds next, after ``start`` [B] cached tokens."""
        ctx, rows, members = self.ctx, self.rows, self.members
        remaining = self.remaining()
        batch, axes = len(rows), _position_axes(ctx)
        mode = ctx.compiled.cache
        size = (
            mode.prompt_step(int(remaining.max()), ctx.spec.prefill) if remaining.max() > 0 else 1
        )
        step = _Step(
            tokens=np.full((batch, size), _pad(ctx), np.int32),
            real=np.zeros(batch, np.int32),
            remaining=remaining,
            positions=np.broadcast_to(
                np.arange(size) + start[:, None].astype(np.int64), (axes or 1, batch, size)
            ).copy(),
            image_mask=np.zeros((batch, size), bool),
            image_rows=np.zeros((batch, size), np.int64),
        )
        for i, row in enumerate(rows):
            if not members[i] or row.done:
                continue
            if remaining[i] > 0:  # the next part of the prompt
                n = min(size, int(remaining[i]))
                part = row.prompt[row.fed : row.fed + n]
                step.tokens[i, :n] = part
                if row.positions is not None:
                    step.positions[:, i, :n] = row.positions[:, row.fed : row.fed + n]
                if ctx.image_token is not None:
                    hits = np.flatnonzero(np.asarray(part) == ctx.image_token)
                    used = row.prompt[: row.fed].count(ctx.image_token)
                    step.image_mask[i, hits] = True
                    step.image_rows[i, hits] = row.features + used + np.arange(len(hits))
            else:  # the last new token
                n = 1
                step.tokens[i, 0] = row.generated[-1]
                step.positions[:, i] += row.delta
            step.real[i] = n
        return step

    def views(self) -> Rows:
        """What the processors read of each row."""
        rows = self.rows
        return Rows(
            _history(rows, self.width),
            np.array([len(r.prompt) for r in rows], np.int32),
            np.array([len(r.prompt) + len(r.generated) for r in rows], np.int32),
            np.array([len(r.prompt) + r.max_new for r in rows], np.int32),
            _encoder(rows, self.ctx),
        )

    def states(self) -> tuple[np.ndarray, ...]:
        """The [B, ...] state of each of the task's own processors."""
        custom = [p for p in self.ctx.processors if not isinstance(p, str)]
        return tuple(_states(p, self.rows, self.ctx.vocab_size) for p in custom)


class Sampler:
    """Greedy or sampled selection: one token per row per step; with ``returns`` > 1 (sampling
    with num_return_sequences), rows p*returns ... p*returns + returns - 1 are prompt p's."""

    def __init__(self, returns: int = 1):
        self.returns = returns

    def select(self, run: _Run, logits, step: _Step) -> None:
        """Gives each row that finished its prompt, or is generating, its selected token."""
        ctx, rows = run.ctx, run.rows
        token = np.full(len(rows), -1, np.int32)
        chosen = logprob = top = ends = done = None
        taking = np.zeros(len(rows), bool)
        taking[step.taking()] = True
        taking &= run.members & np.array([not r.done for r in rows])
        if taking.any() and not run.states():  # the slots' selection and end-of-row rule
            lengths = np.zeros(len(rows), np.int32)
            out = choose(ctx, logits, run.device_rows(taking, lengths, {}))
            chosen, ends, done = out.token, out.ends, out.done
            logprob, top = _columns(out, None, ctx.options)
        elif taking.any():  # a task's own processors, whose state the host computes
            counts = np.array([len(r.generated) for r in rows], np.int32)
            views, states = run.views(), run.states()
            out = np.asarray(ctx.compiled.select(logits, _seeds(rows), counts, views, states))
            chosen = out[:, 0] if out.ndim == 2 else out
            logprob = out[:, 1].view(np.float32) if out.ndim == 2 else None
            top = out[:, 2:] if out.ndim == 2 and out.shape[1] > 2 else None
            max_new = np.array([r.max_new for r in rows], np.int32)
            eos = np.array(ctx.eos or (-1,), np.int64)
            ends, _, _, done = end_of_row(chosen, taking, eos, counts, max_new, xp=np)
        # else a step of prompts only: nothing to select
        for i, row in enumerate(rows):
            if not run.members[i] or row.done:
                continue
            if step.remaining[i] > 0:
                row.fed += int(step.real[i])
                if row.fed < len(row.prompt):
                    continue
            token[i] = int(chosen[i])
            if not ends[i]:  # decode.end_of_row's verdict, then the stop strings
                _keep(row, int(chosen[i]), logprob, top, i)
            row.done = bool(done[i]) or (not ends[i] and _stopped(ctx, row))
        run.emit(token, logprob, top)
        return None

    def results(self, run: _Run) -> list:
        rows, options = run.rows[: run.n], run.ctx.options
        if options.top_logprobs:
            out = [list(zip(r.generated, r.logprobs, r.tops, strict=True)) for r in rows]
        elif options.token_logprobs:
            out = [list(zip(r.generated, r.logprobs, strict=True)) for r in rows]
        else:
            out = [row.generated for row in rows]
        r = self.returns
        return out if r == 1 else [out[i : i + r] for i in range(0, len(out), r)]


class BeamSearch:
    """Beam search: the beams of prompt p are rows p*k ... p*k + k - 1; host bookkeeping in
    :class:`BeamPrompt`, candidates from the compiled beam selection."""

    def __init__(self, ctx: Engine, base: list[_Row], n: int):
        options = ctx.options
        self.k = k = int(options.num_beams)
        self.rows = [
            dataclasses.replace(r, generated=[], logprobs=[]) for r in base for _ in range(k)
        ]
        self.beams = {
            p: BeamPrompt(
                len(r.prompt),
                len(r.prompt) + r.max_new,
                k,
                float(options.length_penalty),
                options.early_stopping,
                ctx.eos,
                _stop_of(ctx, r.prompt),
            )
            for p, r in enumerate(base[:n])
            if not r.done
        }

    def select(self, run: _Run, logits, step: _Step) -> np.ndarray | None:
        """Extends each prompt's beams; returns the new order of the cache rows, or None."""
        rows, beams, k, n = run.rows, self.beams, self.k, run.n
        running = np.zeros(len(rows), np.float32)
        for p, beam in beams.items():
            running[p * k : (p + 1) * k] = beam.scores
        heads = rows[::k]  # each prompt's first beam: its seed and its new tokens so far
        seeds = _seeds(heads)
        steps = np.array([len(r.generated) for r in heads], np.int32)
        select = run.ctx.compiled.select
        out = np.asarray(select(logits, running, seeds, steps, run.views(), run.states()))
        order = np.arange(len(rows))
        token = np.full(n, -1, np.int32)
        for p, beam in beams.items():
            first = p * k
            if not run.members[first] or beam.done:
                continue
            if step.remaining[first] > 0:
                for i in range(first, first + k):
                    rows[i].fed += int(step.real[i])
                if rows[first].fed < len(rows[first].prompt):
                    continue
            cand = out[p]
            sources = beam.step(
                cand[:, 0], cand[:, 1], cand[:, 2].view(np.float32), cand[:, 3].view(np.float32)
            )
            order[first : first + k] = first + sources
            for i in range(k):
                rows[first + i].generated = list(beam.tokens[i])
                rows[first + i].done = beam.done
            token[p] = beam.tokens[0][-1]
        if run.on_token is not None:
            done = np.array([p not in beams or beams[p].done for p in range(n)])
            r = int(run.ctx.options.num_return_sequences)
            best = [beams[p].hypotheses[:r] if p in beams else [None] * r for p in range(n)]
            scores = np.array(
                [[h.score if h and h.finished else np.nan for h in b] for b in best], np.float32
            )
            event = {"token": token, "finished": done, "score": scores[:, 0]}
            if r > 1:
                event["scores"] = scores
            run.on_token(event)
        return order if (order != np.arange(len(rows))).any() else None

    def results(self, run: _Run) -> list:
        """Each prompt's best hypothesis; with num_return_sequences r > 1, its r best."""
        r = int(run.ctx.options.num_return_sequences)
        results = []
        for p in range(run.n):
            best = self.beams[p].results(r) if p in self.beams else [([], [], 0.0)] * r
            if run.ctx.options.token_logprobs:
                out = [list(zip(t, lp, strict=False)) for t, lp, _ in best]
            else:
                out = [list(t) for t, _, _ in best]
            results.append(out if r > 1 else out[0])
        return results


def _columns(out, i: int | None, options) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The log-probabilities [B] float32 (None unless asked) and top_logprobs pairs [B, 2k]
    int32 (id, bits of the log-probability; None unless asked) of step ``i`` of a host StepOut
    (``i`` None: a StepOut of one step)."""
    at = (lambda a: a) if i is None else (lambda a: a[i])  # noqa: E731
    logprob = at(out.logprob).astype(np.float32) if options.logprobs else None
    k, top = options.top_logprobs, None
    if k:
        ids, values = at(out.top_ids), at(out.top_logprobs).astype(np.float32).view(np.int32)
        top = np.stack([ids, values], axis=-1).reshape(len(ids), 2 * k)
    return logprob, top


def _keep(row: _Row, token: int, logprob, top, i: int) -> None:
    """Adds a new token to ``row``, with its log-probability and its top pairs when selected."""
    row.generated.append(token)
    if logprob is not None:
        row.logprobs.append(float(logprob[i]))
    if top is not None:
        pairs = top[i].reshape(-1, 2)
        values = pairs[:, 1].copy().view(np.float32)
        row.tops.append([(int(t), float(v)) for t, v in zip(pairs[:, 0], values, strict=True)])


def return_seed(seed: int, j: int) -> int:
    """The sampling seed of sequence ``j`` of a prompt of seed ``seed`` with num_return_sequences
    above 1: ``seed`` for j = 0, else ``(seed + j * 0x9E3779B9) mod 2**32``."""
    return int(seed) if j == 0 else (int(seed) + j * RETURN_STRIDE) & 0xFFFFFFFF


def _row_inputs(
    ctx: Engine, rows: list[_Row], inputs: Mapping[str, Any], returns: int
) -> list[dict[str, Any] | None]:
    """Each row's own inputs, as its slots' request takes them (:mod:`.slot_inputs`): row i of
    each given input (of prompt i // ``returns``), its image tokens' features, its positions."""
    features = inputs.get("image_features")
    token = ctx.image_token
    out = []
    for i, row in enumerate(rows):
        own: dict[str, Any] = {n: np.asarray(inputs[n])[i // returns][None] for n in ctx.given}
        count = row.prompt.count(token) if token is not None and features is not None else 0
        if count:
            own["image_features"] = np.asarray(features)[row.features : row.features + count]
        if row.positions is not None and _position_axes(ctx) == 3:
            own["position_ids"] = row.positions
        out.append(own or None)
    return out


def _returns(rows: list[_Row], returns: int) -> list[_Row]:
    """Each row as ``returns`` adjacent rows (transformers' repeat_interleave), with the seeds of
    :func:`return_seed`."""
    if returns == 1:
        return rows
    return [
        dataclasses.replace(r, seed=return_seed(r.seed, j), generated=[], logprobs=[], tops=[])
        for r in rows
        for j in range(returns)
    ]


def _stopped(ctx: Engine, row: _Row) -> bool:
    """Whether the row's tokens now end in one of the stop strings."""
    stops = ctx.stops
    return stops is not None and stops.hit(
        row.prompt[-stops.window :] + row.generated[-stops.window :]
    )


def _stop_of(ctx: Engine, prompt: list[int]) -> Callable[[list[int]], bool] | None:
    """Whether new tokens after ``prompt`` end in one of the stop strings (None: no strings)."""
    stops = ctx.stops
    if stops is None:
        return None
    head = prompt[-stops.window :]
    return lambda tokens: stops.hit(head + tokens[-stops.window :])


def _seeds(rows: list[_Row]) -> np.ndarray:
    """[B] int32 the low 32 bits of each row's seed."""
    return np.array([r.seed & 0xFFFFFFFF for r in rows], np.uint32).view(np.int32)


def _pad(ctx: Engine) -> int:
    """The token of padding positions: pad_token_id when it is in the vocabulary, else the first
    eos token, else 0 (its value never reaches a real token's result)."""
    vocab = ctx.vocab_size or 2**31
    for token in (ctx.options.pad_token_id, *ctx.eos, 0):
        if token is not None and 0 <= token < vocab:
            return int(token)
    return 0


def _history(rows: list[_Row], width: int) -> np.ndarray:
    """[B, width] each row's prompt and new tokens, -1 after them."""
    history = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        tokens = row.prompt + row.generated
        history[i, : len(tokens)] = tokens
    return history


def _encoder(rows: list[_Row], ctx: Engine) -> np.ndarray | None:
    """[B, E] int32 each row's encoder ids, -1 after them (E a bucket of the longest); None
    where no processor reads them."""
    if not ctx.options.encoder_ids:
        return None
    ids = [r.encoder or [] for r in rows]
    out = np.full((len(rows), cache_modes.bucket(max(len(e) for e in ids) or 1)), -1, np.int32)
    for i, e in enumerate(ids):
        out[i, : len(e)] = e
    return out


def _states(processor, rows, vocab) -> np.ndarray:
    """The state of a task's processor for each row: [B, ...]."""
    make = processor[0]
    return np.stack(
        [
            np.asarray(make({"prompt": r.prompt, "generated": r.generated[::-1], "vocab": vocab}))
            for r in rows
        ]
    )


def _feed(ctx, tokens, positions, state, given, axes) -> dict[str, Any]:
    """The inputs of one step other than the cache (host arrays: the jitted step moves them)."""
    names = {i.name for i in ctx.model.inputs}
    feed: dict[str, Any] = {"tokens": tokens}
    if "attention_mask" in names:
        feed["attention_mask"] = state.mask(tokens.shape[1])
    if axes:
        feed["position_ids"] = (positions if axes == 3 else positions[0]).astype(np.int32)
    return feed | given
