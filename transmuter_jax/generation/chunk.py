"""generate()'s decode chunks on the device: the slots' step (:mod:`.slots`) in one program.

After the prompts, a chunk runs up to ``decode_steps`` of the slots' pure step over one
:class:`~.slots.DecodeRows` pytree in a ``lax.while_loop`` that stops after ``limit`` steps or
when every row is done, with the cache donated in and out. The rows' options are the
specification's, as per-row arrays; the given inputs (a cross-attention cache, encoder
states), image embeddings (the embedding model's weights), M-RoPE offsets and a padded grow
cache are what generate() adds to the slots. The host gets the :class:`~.slots.StepOut` of
each step, [size, B], in one transfer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..runtime.jit import jit_options
from ..runtime.stored import StoredJit
from . import constraints, slots
from . import drafts as drafting
from .programs import program

if TYPE_CHECKING:
    from .engine import Engine


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The decode chunks of an engine, one program per (cache branch, padded rows, inputs).

    Attributes:
        size: decode_steps, the most steps of one chunk.
        k: the top_logprobs each step gives (0: none).
        mask: a finite constraint's :class:`~.constraints.DeviceMask` (its table runs in the
            chunk, the rows' ``constraint`` its states), or None.
    """

    size: int
    k: int
    mask: Any = None

    def __call__(
        self,
        engine: Engine,
        state: slots.DecodeRows,
        given: dict[str, Any],
        limit: int,
        rows: int | None,
    ) -> tuple[slots.DecodeRows, slots.StepOut]:
        """Runs up to ``limit`` (at most ``size``) steps; ``rows``: a padded grow cache's rows.

        Returns the rows after the chunk (their cache donated from ``state``) and the host
        StepOut [size, B] of the steps (steps not run: token -1).
        """
        steps, spec = engine.compiled.steps, engine.spec
        length = _self_rows(engine, state.cache)
        branch = steps.mode.branch(length)
        steps.shapes.add((1, length, branch) + ((rows,) if rows is not None else ()))
        key = steps.key(
            "decode",
            branch,
            rows,
            spec.options.program_key,
            constraints.program_names(spec.processors),
            spec.vocab_size,
            slots._pad_token(engine),
            slots._axes(engine),
            tuple(sorted(given)),
            self.k,
        )

        def make():
            one = slots._step_function(engine, None, self.k, branch, rows)
            size, k, placement = self.size, self.k, engine.placement

            def run(params, embed_params, state, given, limit, table):
                extra = {"table": table, "embed_params": embed_params, "given": given}
                state, out = slots.run_steps(one, size, k, params, state, limit, **extra)
                if placement is not None:  # the host reads it on every process
                    out = jax.tree.map(placement.readable, out)
                return state, out

            options = jit_options(dict(engine.jit_options))
            return StoredJit(run, key, donate_argnums=(2,), **options)

        fn = program(("decode", key, self.size, steps.local()), make, steps.held)
        embed_params = engine.embed.params if engine.embed is not None else {}
        signature = (
            tuple((k, np.shape(v), np.dtype(v.dtype)) for k, v in given.items()),
            tuple((k, np.shape(v)) for k, v in state.cache.items()),
            np.shape(state.history),
            np.shape(state.eos),
            None if state.encoder is None else np.shape(state.encoder),
            state.delta is None,
        )
        table = self.mask.table if self.mask is not None else None
        signature += (None if table is None else (table.mask.shape, table.next.shape),)
        limit = np.int32(min(limit, self.size))
        params = engine.model.params
        state, out = fn(signature, params, embed_params, state, given, limit, table)
        return state, jax.device_get(out)


def rows(
    engine: Engine,
    *,
    token: np.ndarray,
    lengths: np.ndarray,
    history: np.ndarray,
    prompt: np.ndarray,
    count: np.ndarray,
    max_new: np.ndarray,
    seeds: np.ndarray,
    done: np.ndarray,
    delta: np.ndarray | None,
    encoder: np.ndarray | None,
    cache: dict[str, jax.Array],
    constraint: np.ndarray | None = None,
) -> slots.DecodeRows:
    """generate()'s rows as the slots' per-row arrays, with the specification's options
    (``constraint``: [B] each row's state in a finite constraint's table; None: -1, none)."""
    batch, ids = len(token), tuple(engine.options.eos_token_id)
    r = slots._resolved(engine, slots.Request((0,), max_new_tokens=0, eos_token_id=()))
    eos = np.full((batch, max(slots.EOS_WIDTH, len(ids))), -1, np.int32)
    eos[:, : len(ids)] = ids
    full = lambda v, t: np.full(batch, v, t)  # noqa: E731
    vocab = engine.vocab_size or 2**31
    return slots.DecodeRows(
        token=token,
        lengths=lengths,
        history=history,
        prompt=prompt,
        count=count,
        max_new=max_new,
        seeds=seeds,
        done=done,
        eos=eos,
        sample=full(r["sample"], bool),
        temperature=full(r["temperature"], np.float32),
        top_k=full(r["top_k"] if r["top_k"] > 0 else vocab, np.int32),
        top_p_drop=full(np.float32(1 - r["top_p"]), np.float32),
        top_p_on=full(r["top_p"] < 1.0, bool),
        min_p=full(r["min_p"], np.float32),
        repetition=full(r["repetition"], np.float32),
        presence=full(0.0, np.float32),
        cache=cache,
        frequency=full(0.0, np.float32),
        bias_ids=np.full((batch, slots.BIAS_WIDTH), -1, np.int32),
        bias_values=np.zeros((batch, slots.BIAS_WIDTH), np.float32),
        min_new=full(0, np.int32),
        logprob=full(bool(engine.options.logprobs or engine.options.top_logprobs), bool),
        constraint=full(-1, np.int32) if constraint is None else constraint,
        drafts=drafting.empty(batch),
        delta=delta,
        encoder=encoder,
    )


def choose(engine: Engine, logits: jax.Array, rows: slots.DecodeRows) -> slots.StepOut:
    """The host path's selection: the slots' step's selection and end-of-row rule alone, over
    the logits [B, V] of a step the host ran (rows that take no token: done). Returns the host
    StepOut [B]."""
    _, out = slots._first(engine, int(engine.options.top_logprobs))(logits, rows, None)
    return jax.device_get(out)


def _self_rows(engine: Engine, cache: dict[str, jax.Array]) -> int:
    entry = next(e for e in engine.cache.entries if not e.cross)
    return int(cache[entry.input].shape[2])
