"""Decode on the device: up to ``decode_steps`` new tokens per dispatch, in one XLA program.

After the prompt, a chunk runs decoder step -> selection -> next input in a ``lax.while_loop``
that stops after ``limit`` steps or when every row is done, with the cache donated in and out.
The host gets ONE int32 array per chunk: [steps, B, 2 + W] (token or -1, finished flag, then
the selection's other columns: the bits of the log-probability and the top_logprobs pairs);
steps the loop did not run hold -2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.jit import jit_options
from ..runtime.stored import StoredJit, storable
from . import constraints
from .constraints import advance, table_bitmask
from .processors import Rows
from .programs import program
from .steps import Steps

NOT_RUN = -2  # the token of a step the loop did not run


@storable
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The rows of a decode chunk, on the device.

    Attributes:
        token: [B] int32 each row's last token, the next input.
        lengths: [B] int32 valid cached tokens of each row.
        history: [B, H] int32 the row's tokens (prompt, then new ones), -1 after them.
        prompt: [B] int32 prompt length.
        count: [B] int32 new tokens so far (the sampling key's step).
        max_new: [B] int32 the most new tokens of the row.
        delta: [B] int32 a new token's position minus its index in the row.
        seeds: [B] int32 the sampling seed of each row.
        done: [B] bool rows that take no more tokens (padding rows, other groups, finished).
        cache: the cache arrays by input name, [B, heads, rows, head_size].
        encoder: [B, E] int32 the encoder's input ids (see :class:`.processors.Rows`) or None.
        constraint: [B] int32 each row's state of a finite constraint's table, or None.
    """

    token: jax.Array
    lengths: jax.Array
    history: jax.Array
    prompt: jax.Array
    count: jax.Array
    max_new: jax.Array
    delta: jax.Array
    seeds: jax.Array
    done: jax.Array
    cache: dict[str, jax.Array]
    encoder: jax.Array | None = None
    constraint: jax.Array | None = None


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


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The compiled decode chunks of a context, one per (cache branch, padded rows, mask)."""

    steps: Steps
    select: Any
    eos: tuple[int, ...]
    pad: int
    size: int  # decode_steps: the most steps of one chunk
    width: int  # columns of the selection's output (1: the token only)
    axes: int  # position_ids axes: 0 (none), 1, or 3 (M-RoPE)
    mask: Any = None  # a finite constraint's constraints.DeviceMask: its table runs on device

    def __call__(
        self, state: DecodeState, given: dict[str, Any], limit: int, rows: int | None
    ) -> tuple[DecodeState, np.ndarray]:
        """Runs up to ``limit`` (at most ``size``) steps; ``rows``: a padded grow cache's rows.

        Returns the state after the chunk (its cache donated from ``state``) and the host array
        [size, B, 1 + width] int32 of the steps.
        """
        ctx = self.steps.ctx
        mode = self.steps.mode
        length = _self_rows(ctx, state.cache)
        branch = mode.branch(length)
        self.steps.shapes.add((1, length, branch) + ((rows,) if rows is not None else ()))
        key = self.steps.key(
            "decode",
            branch,
            rows,
            ctx.options.program_key,
            constraints.program_names(ctx.processors),
            self.pad,
            self.axes,
            tuple(sorted(given)),
        )

        def make():
            run = self._chunk_function(branch, rows)
            options = jit_options(dict(ctx.jit_options))
            return StoredJit(run, key, donate_argnums=(2,), **options)

        fn = program(("decode", key, self.size, self.steps.local()), make, self.steps.held)
        embed_params = ctx.embed.params if ctx.embed is not None else {}
        signature = (
            tuple((k, np.shape(v), np.dtype(v.dtype)) for k, v in given.items()),
            tuple((k, np.shape(v)) for k, v in state.cache.items()),
            np.shape(state.history),
            None if state.encoder is None else np.shape(state.encoder),
        )
        limit = np.int32(min(limit, self.size))
        table = self.mask.table if self.mask is not None else None
        signature += (None if table is None else table.next.shape,)
        state, out = fn(signature, ctx.model.params, embed_params, state, given, limit, table)
        return state, np.asarray(out)

    def _chunk_function(self, branch: bool, rows: int | None):
        step = self.steps.function(branch, rows)
        mode, select = self.steps.mode, self.select.function  # traced into the chunk
        names = {i.name for i in self.steps.ctx.model.inputs}
        eos = np.asarray(self.eos or (-1,), np.int32)
        size, pad, axes, width = self.size, self.pad, self.axes, self.width
        ctx = self.steps.ctx

        def run(params, embed_params, state: DecodeState, given, limit, table):
            batch = state.token.shape[0]
            cache_rows = rows if rows is not None else _self_rows(ctx, state.cache)
            out = jnp.full((size, batch, width + 1), NOT_RUN, jnp.int32)
            index = jnp.arange(batch)

            def more(carry):
                i, s, _ = carry
                return (i < limit) & ~jnp.all(s.done)

            def one(carry):
                i, s, out = carry
                live = ~s.done  # [B]
                feed = {"tokens": jnp.where(live, s.token, pad)[:, None].astype(jnp.int32)}
                if "attention_mask" in names:
                    feed["attention_mask"] = mode.mask(s.lengths, 1, cache_rows, xp=jnp)
                if axes:
                    positions = (s.lengths + jnp.where(live, s.delta, 0))[:, None]  # [B, 1]
                    if axes == 3:
                        positions = jnp.broadcast_to(positions, (3, batch, 1))
                    feed["position_ids"] = positions.astype(jnp.int32)
                feed |= given
                zeros = jnp.zeros(batch, jnp.int32)
                logits, cache = step(params, embed_params, s.cache, feed, s.lengths, zeros)
                views = Rows(
                    s.history, s.prompt, s.prompt + s.count, s.prompt + s.max_new, s.encoder
                )
                masks = () if table is None else (table_bitmask(table, s.constraint),)
                chosen = select(logits, s.seeds, s.count, views, masks)  # [B] or [B, width]
                more = chosen[:, 1:] if width > 1 else None
                chosen = chosen[:, 0] if width > 1 else chosen
                ends, kept, count, finished = end_of_row(chosen, live, eos, s.count, s.max_new)
                at = s.prompt + s.count
                # [B, H]: a kept token goes after the row's tokens; other rows write out of range
                at = jnp.where(kept, at, s.history.shape[1])
                history = s.history.at[index, at].set(chosen, mode="drop")
                done = s.done | finished
                row = jnp.stack([jnp.where(live, chosen, -1), done.astype(jnp.int32)], axis=-1)
                if more is not None:
                    row = jnp.concatenate([row, more], axis=-1)
                out = out.at[i].set(row)
                lengths = mode.advance(s.lengths, live.astype(jnp.int32), 1).astype(jnp.int32)
                s = dataclasses.replace(
                    s,
                    token=jnp.where(kept, chosen, s.token),
                    lengths=lengths,
                    history=history,
                    count=count,
                    done=done,
                    cache=cache,
                    constraint=advance(table, s.constraint, chosen, kept),
                )
                return i + 1, s, out

            _, state, out = jax.lax.while_loop(more, one, (jnp.int32(0), state, out))
            if ctx.placement is not None:  # the host reads it on every process
                out = ctx.placement.readable(out)
            return state, out

        return run


def _self_rows(ctx, cache: dict[str, jax.Array]) -> int:
    entry = next(e for e in ctx.cache.entries if not e.cross)
    return int(cache[entry.input].shape[2])
