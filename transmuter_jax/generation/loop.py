"""generate(): the host loop over steps, rows, groups, padding rows and on_token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..onnx.dtypes import device_dtype
from . import cache as cache_modes
from .beam import BeamPrompt
from .context import Context
from .processors import Rows, static_masks
from .select import beam_selection, selection
from .steps import Steps, chunk, pad_grow


@dataclasses.dataclass
class Compiled:
    """What compile() prepares: the steps (owning the compiled shapes) and the selection."""

    steps: Steps
    select: Any
    reorder: Any
    grow_cache: str = ""  # in grow, what runs: "padded", "buckets" or "exact"
    unpadded: str = ""  # in grow, why the cache keeps exact lengths ("" when it is padded)

    @property
    def shapes(self) -> int:
        """How many step shapes have been compiled."""
        return len(self.steps.shapes)

    @property
    def padded(self) -> bool:
        """Whether grow steps run on a padded cache (a few shapes) rather than exact lengths."""
        return self.steps.padding is not None


GROW_CACHES = ("padded", "buckets", "exact")


def compile(  # noqa: A001
    ctx: Context, batch_size: int, *, grow_cache: str = "padded", **jit_options: Any
) -> Context:
    """Prepares ``ctx`` for batches of ``batch_size`` prompts.

    Args:
        ctx: from :func:`context`.
        batch_size: the most prompts a call of :func:`generate` takes.
        grow_cache: in grow mode, "padded" runs the decoder rewritten for a padded cache whose
            capacity is each group's prompt and new tokens rounded up to 64 (its prompt steps
            and one decode shape); "buckets" grows that cache 64 rows at a time as it fills (two
            decode shapes per 64 rows, fewer padding rows read); "exact" keeps exact lengths
            (one shape per length). A graph the rewrite does not understand keeps exact lengths
            (``compiled.unpadded`` says why).
        **jit_options: options of ``jax.jit`` for the step and the selection.

    Returns:
        A context that owns the cache of compiled shapes: call this in the serving process.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if grow_cache not in GROW_CACHES:
        raise ValueError(f"grow_cache must be one of {GROW_CACHES}, got {grow_cache!r}")
    ready = dataclasses.replace(ctx, batch_size=batch_size, jit_options=dict(jit_options))
    masks = static_masks(ctx.options, ctx.vocab_size or 0)  # once, not every step
    make = beam_selection if ctx.options["num_beams"] > 1 else selection
    select = make(ready.options, tuple(ready.processors), masks, **jit_options)
    reorder = cache_modes.reorder_function(ctx.cache, **jit_options)
    padding, reason, runs = None, "", ""
    if ctx.mode == "grow":
        padding, reason = pad_grow(ctx) if grow_cache != "exact" else (None, "grow_cache='exact'")
        runs = grow_cache if padding is not None else "exact"
    ready.compiled = Compiled(Steps(ready, padding), select, reorder, runs, reason)
    return ready


@dataclasses.dataclass
class _Row:
    prompt: list[int]
    max_new: int
    positions: np.ndarray | None = None  # [axes, len(prompt)] given prompt positions
    delta: int = 0  # position of a token after the prompt: its index + delta
    features: int = 0  # index of the row's first image feature
    fed: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    done: bool = False


def new_tokens(ctx: Context, prompt_length: int) -> int:
    """The most new tokens a prompt of ``prompt_length`` tokens gets: max_new_tokens, else
    max_length minus the prompt, else 256 when max_length is GenerationConfig's default."""
    options = ctx.options
    if options["max_new_tokens"] is not None:
        return int(options["max_new_tokens"])
    if options["max_length"] is None or options["max_length"] == 20:
        return 256
    return max(int(options["max_length"]) - prompt_length, 0)


def _limit(ctx: Context) -> int | None:
    text = ctx.config.get("text_config", ctx.config)
    for key in ("max_position_embeddings", "max_target_positions", "n_positions"):
        if text.get(key):
            return int(text[key])
    return None


def _validate(ctx: Context, prompts, seeds, inputs) -> None:
    if ctx.batch_size is None or ctx.compiled is None:
        raise ValueError("call generation.compile(ctx, batch_size) before generate")
    if len(prompts) > ctx.batch_size:
        raise ValueError(
            f"{len(prompts)} prompts but the context is compiled for batches of {ctx.batch_size}"
        )
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds has {len(seeds)} values for {len(prompts)} prompts")
    vocab, limit = ctx.vocab_size, _limit(ctx)
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < (vocab or 2**31)]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary of {vocab}: {bad}")
        if limit is not None and len(prompt) > limit:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens, more than the cache holds ({limit})"
            )
    features = inputs.get("image_features")
    if features is not None and ctx.image_token is not None:
        count = sum(list(p).count(ctx.image_token) for p in prompts)
        if count > np.shape(features)[0]:
            raise ValueError(
                f"the prompts have {count} image tokens but image_features has "
                f"{np.shape(features)[0]} rows"
            )
    for name in ctx.given:
        if name not in inputs:
            raise ValueError(f"missing input {name!r}, which the context says is given")
        if np.shape(inputs[name])[0] != len(prompts):
            raise ValueError(
                f"input {name!r} has {np.shape(inputs[name])[0]} rows for {len(prompts)} prompts"
            )


def _rows(ctx: Context, prompts, inputs) -> list[_Row]:
    rows, features = [], 0
    positions = inputs.get("position_ids") or [None] * len(prompts)
    for prompt, given in zip(prompts, positions, strict=True):
        prompt = [int(t) for t in prompt]
        row = _Row(prompt, new_tokens(ctx, len(prompt)) if prompt else 0, features=features)
        if given is not None and len(given):
            row.positions = np.asarray(given, np.int64).reshape(-1, len(prompt))
            row.delta = int(row.positions.max()) + 1 - len(prompt)
        if ctx.image_token is not None:
            features += sum(1 for t in prompt if t == ctx.image_token)
        row.done = not prompt or row.max_new == 0
        rows.append(row)
    while len(rows) < ctx.batch_size:
        rows.append(_Row([], 0, done=True))
    return rows


def _given(ctx: Context, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
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


def generate(
    ctx: Context,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    inputs: Mapping[str, Any] | None = None,
    on_token: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> list[list[int]]:
    """Generates tokens after each prompt.

    Args:
        ctx: from :func:`compile`.
        prompts: token ids of each prompt; an empty prompt is a padding row that gives no tokens.
        seeds: the sampling seed of each row.
        inputs: the inputs the context names in ``given`` (one row per prompt); also
            "image_features" [count, hidden] (the features of the image tokens of all rows, in
            order) and "position_ids" (per prompt: positions per axis per token, or empty).
        on_token: called after each step with "token" [rows] int32 (-1: no new token) and
            "finished" [rows] bool.

    Returns:
        The new tokens of each row, without the eos token; with the option token_logprobs,
        (token, log-probability) pairs.
    """
    inputs = dict(inputs or {})
    prompts = [list(p) for p in prompts]
    _validate(ctx, prompts, seeds, inputs)
    features = inputs.get("image_features")
    features = None if features is None else np.asarray(features)
    if ctx.options["num_beams"] > 1:
        return _beam_search(ctx, prompts, inputs, features, on_token)
    rows = _rows(ctx, prompts, inputs)
    given = _given(ctx, inputs)
    seeds_array = np.zeros(ctx.batch_size, np.int32)
    seeds_array[: len(seeds)] = np.asarray(seeds, np.int64).astype(np.uint32).view(np.int32)
    n = len(prompts)

    def choose(logits, views, states, remaining, step, members):
        counts = np.array([len(r.generated) for r in rows], np.int32)
        out = np.asarray(ctx.compiled.select(logits, seeds_array, counts, views, states))
        chosen, logprob = (out[:, 0], out[:, 1].view(np.float32)) if out.ndim == 2 else (out, None)
        token = np.full(n, -1, np.int32)
        _take(ctx, rows, members, remaining, step, chosen, logprob, token)
        if on_token is not None:
            event = {"token": token, "finished": np.array([r.done for r in rows[:n]])}
            if logprob is not None:
                event["logprob"] = np.where(token >= 0, logprob[:n], np.nan)
            on_token(event)
        return None

    for group in _groups(ctx, rows):
        _run_group(ctx, rows, group, given, features, choose)
    if ctx.options["token_logprobs"]:
        return [list(zip(r.generated, r.logprobs, strict=False)) for r in rows[:n]]
    return [row.generated for row in rows[:n]]


def _beam_search(ctx, prompts, inputs, features, on_token):
    """Beam search: the beams of prompt p are rows p*k ... p*k + k - 1."""
    k = int(ctx.options["num_beams"])
    base = _rows(ctx, prompts, inputs)
    rows = [dataclasses.replace(r, generated=[], logprobs=[]) for r in base for _ in range(k)]
    given = {name: jnp.repeat(v, k, axis=0) for name, v in _given(ctx, inputs).items()}
    options = ctx.options
    beams = {
        p: BeamPrompt(
            len(r.prompt),
            len(r.prompt) + r.max_new,
            k,
            float(options["length_penalty"]),
            options["early_stopping"],
            ctx.eos,
        )
        for p, r in enumerate(base[: len(prompts)])
        if not r.done
    }
    n = len(prompts)

    def choose(logits, views, states, remaining, step, members):
        running = np.zeros(len(rows), np.float32)
        for p, beam in beams.items():
            running[p * k : (p + 1) * k] = beam.scores
        out = np.asarray(ctx.compiled.select(logits, running, views, states))
        order = np.arange(len(rows))
        token = np.full(n, -1, np.int32)
        for p, beam in beams.items():
            first = p * k
            if not members[first] or beam.done:
                continue
            if remaining[first] > 0:
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
        if on_token is not None:
            done = np.array([p not in beams or beams[p].done for p in range(n)])
            best = [beams[p].hypotheses[0] if p in beams else None for p in range(n)]
            score = np.array([h.score if h and h.finished else np.nan for h in best], np.float32)
            on_token({"token": token, "finished": done, "score": score})
        return order if (order != np.arange(len(rows))).any() else None

    for group in _groups(ctx, rows):
        _run_group(ctx, rows, group, given, features, choose)
    results = []
    for p in range(n):
        if p not in beams:
            results.append([])
            continue
        tokens, logprobs, _ = beams[p].result()
        if options["token_logprobs"]:
            results.append(list(zip(tokens, logprobs, strict=False)))
        else:
            results.append(tokens)
    return results


def _groups(ctx: Context, rows: list[_Row]) -> list[list[int]]:
    """The rows that share a cache: all of them, or in grow those with prompts of one length."""
    active = [i for i, row in enumerate(rows) if not row.done]
    if cache_modes.shared_by_all_rows(ctx.mode):
        return [active] if active else []
    lengths = sorted({len(rows[i].prompt) for i in active})
    return [[i for i in active if len(rows[i].prompt) == n] for n in lengths]


@dataclasses.dataclass
class _Step:
    """The host arrays of one step: what each row feeds."""

    tokens: np.ndarray  # [B, S] int32, padding after each row's real tokens
    real: np.ndarray  # [B] real tokens of each row
    positions: np.ndarray  # [axes, B, S] position of each token
    image_mask: np.ndarray  # [B, S] image tokens to replace with features
    image_rows: np.ndarray  # [B, S] the feature row of each image token


def _plan(ctx, rows, members, remaining, start, pad, axes) -> _Step:
    batch = len(rows)
    size = chunk(int(remaining.max())) if remaining.max() > 0 else 1
    step = _Step(
        tokens=np.full((batch, size), pad, np.int32),
        real=np.zeros(batch, np.int32),
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


def _take(ctx, rows, members, remaining, step: _Step, chosen, logprob, token):
    """Gives each row that finished its prompt, or is generating, its selected token."""
    for i, row in enumerate(rows):
        if not members[i] or row.done:
            continue
        if remaining[i] > 0:
            row.fed += int(step.real[i])
            if row.fed < len(row.prompt):
                continue
        t = int(chosen[i])
        if i < len(token):
            token[i] = t
        if t in ctx.eos:
            row.done = True
        else:
            row.generated.append(t)
            if logprob is not None:
                row.logprobs.append(float(logprob[i]))
            row.done = len(row.generated) >= row.max_new


def _history(rows: list[_Row], width: int) -> np.ndarray:
    """[B, width] each row's prompt and new tokens, -1 after them."""
    history = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        tokens = row.prompt + row.generated
        history[i, : len(tokens)] = tokens
    return history


def _run_group(ctx, rows, group, given, features, choose) -> None:
    """Runs the rows ``group`` (the others are padding rows) until each is done.

    ``choose(logits, views, states, remaining, step, members)`` takes each step's last-token
    logits, gives rows their tokens, and returns the new order of the cache rows (beam search)
    or None.
    """
    batch = len(rows)
    members = np.zeros(batch, bool)
    members[group] = True
    pad = ctx.options["pad_token_id"]
    pad = pad if pad is not None else (ctx.eos[0] if ctx.eos else 0)
    longest = max(len(rows[i].prompt) + rows[i].max_new for i in group)
    first = chunk(max(len(rows[i].prompt) for i in group))
    states = given.get("encoder_hidden_states")
    encoder = 0 if states is None else int(states.shape[1])
    padded = ctx.compiled.padded
    capacity = cache_modes.capacity(ctx.mode, longest, first, padded)
    state = cache_modes.State(ctx.mode, ctx.cache, batch, capacity, encoder, padded)
    buckets = padded and ctx.compiled.grow_cache == "buckets"
    axes = _position_axes(ctx)
    width = -(-longest // 64) * 64
    prompt = jnp.asarray([len(r.prompt) for r in rows], jnp.int32)
    max_length = jnp.asarray([len(r.prompt) + r.max_new for r in rows], jnp.int32)
    custom = [p for p in ctx.processors if not isinstance(p, str)]
    while any(not rows[i].done for i in group):
        remaining = np.array(
            [len(r.prompt) - r.fed if members[i] and not r.done else 0 for i, r in enumerate(rows)]
        )
        start = state.lengths
        step = _plan(ctx, rows, members, remaining, start, pad, axes)
        if buckets:  # room for this step's tokens, in 64-row buckets
            state.capacity = cache_modes.bucket(int(start.max()) + step.tokens.shape[1])
        feed = _feed(ctx, step.tokens, step.positions, state, given, axes)
        if step.image_mask.any() and features is not None:
            feed["image_mask"] = step.image_mask
            feed["image_features"] = features[step.image_rows]
        last = np.maximum(step.real - 1, 0)  # each row's last real token
        logits, state.arrays = ctx.compiled.steps(
            state.arrays, feed, start, last.astype(np.int32), state.capacity
        )
        lengths = [len(r.prompt) + len(r.generated) for r in rows]
        views = Rows(_history(rows, width), prompt, np.asarray(lengths, np.int32), max_length)
        states = tuple(_states(p, rows, ctx.vocab_size) for p in custom)
        order = choose(logits, views, states, remaining, step, members)
        logits.delete()
        if order is not None:
            state.arrays = ctx.compiled.reorder(state.arrays, np.asarray(order, np.int32))
        state.advance(step.real, step.tokens.shape[1])


def _states(processor, rows, vocab) -> np.ndarray:
    """The state of a task's processor for each row: [B, ...]."""
    make = processor[0]
    return np.stack(
        [
            np.asarray(make({"prompt": r.prompt, "generated": r.generated[::-1], "vocab": vocab}))
            for r in rows
        ]
    )


def _position_axes(ctx: Context) -> int:
    info = next((i for i in ctx.model.inputs if i.name == "position_ids"), None)
    if info is None:
        return 0
    return 3 if info.shape is not None and len(info.shape) == 3 else 1


def _feed(ctx, tokens, positions, state, given, axes) -> dict[str, Any]:
    """The inputs of one step other than the cache (host arrays: the jitted step moves them)."""
    names = {i.name for i in ctx.model.inputs}
    feed: dict[str, Any] = {"tokens": tokens}
    if "attention_mask" in names:
        feed["attention_mask"] = state.mask(tokens.shape[1])
    if axes:
        feed["position_ids"] = (positions if axes == 3 else positions[0]).astype(np.int32)
    return feed | given
