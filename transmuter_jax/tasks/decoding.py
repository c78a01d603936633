"""The one place the task pipelines call the generation engine (:mod:`transmuter_jax.generation`).

Checking the options, building and compiling a context (sharing one set of compiled steps per
decoder), generating, and reading how each sequence ended: the rest of the tasks' floor sees
only what these functions return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import generation as gen
from ..onnx.model import Model


def defaults(
    folder: str,
    model: Model,
    *,
    given: Sequence[str],
    embed: Model | None,
    tokenizer: Any,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """The options a call starts from (transformers' defaults, generation_config.json, then
    ``options``), checked now so that a bad one fails at construction."""
    base = gen.context(folder, model, given=tuple(given), embed=embed, tokenizer=tokenizer,
                       **options)  # fmt: skip
    return base.options.as_dict()


def compiled(
    folder: str,
    model: Model,
    *,
    given: Sequence[str],
    embed: Model | None,
    tokenizer: Any,
    options: Mapping[str, Any],
    processors: Sequence[Any],
    batch: int,
    mesh: Any,
    assistant: tuple[str, Model, Model | None] | None = None,
) -> gen.Engine:
    """An engine compiled for ``batch`` rows with ``options`` and a task's own ``processors``
    (after the others); engines of one decoder share their programs through the program cache.
    ``assistant``: a draft model's (folder, decoder, embed) for speculative decoding.

    A decoder fed ``given`` inputs (an encoder's states) gets a padded grow cache that grows 64
    rows at a time on the host rows' path (``grow_cache="buckets"``: beam search, timestamps):
    such tasks allow the model's whole length (Whisper: 448 tokens) where outputs end far
    sooner, and every step of a cache sized for the whole length reads and moves all its rows
    (through the slots, the decode chunks read a window of the rows in use)."""
    helper = None
    if assistant is not None:
        helper = gen.context(assistant[0], assistant[1], embed=assistant[2])
    spec = gen.context(folder, model, given=tuple(given), embed=embed, tokenizer=tokenizer,
                       processors=processors, assistant=helper, **options)  # fmt: skip
    return gen.compile(spec, batch, mesh=mesh, grow_cache="buckets" if given else "padded")


def check_assistant(
    folder: str, model: Model, embed: Model | None, assistant: tuple[str, Model, Model | None]
) -> None:
    """Raises GenerationError when the draft model ``assistant`` (folder, decoder, embed) cannot
    draft for ``model`` (another vocabulary, a cache that cannot run slots)."""
    helper = gen.context(assistant[0], assistant[1], embed=assistant[2])
    gen.context(folder, model, embed=embed, assistant=helper)
    refusal = helper.cache_mode.slot_refusal() or helper.cache_mode.draft_refusal()
    if refusal:
        raise gen.GenerationError(f"the assistant model {assistant[0]!r} cannot draft: {refusal}")


def compiled_shapes(shapes: set[tuple], engines: Iterable[gen.Engine]) -> int:
    """How many step shapes have run: ``shapes`` (updated in place) with those of ``engines``.
    A prompt step's program serves every engine of the model; a decode chunk's (one token a
    step) holds its engine's selection, so each engine's count apart."""
    for engine in engines:
        key = engine.spec.options.program_key
        shapes |= {s if s[0] > 1 else (*s, key) for s in engine.compiled.steps.shapes}
    return len(shapes)


def chosen(ctx: gen.Engine) -> gen.Options:
    """The options a compiled context runs with."""
    return ctx.options


def run(
    ctx: gen.Engine,
    prompts: list[list[int]],
    seeds: list[int],
    inputs: Mapping[str, Any] | None,
    on_token: Callable[[dict[str, np.ndarray]], None] | None,
) -> list:
    """The new tokens after each prompt, as :func:`transmuter_jax.generation.generate` gives
    them (with log-probabilities when the options ask)."""
    return gen.generate(ctx, prompts, seeds, inputs, on_token, clamp=True)


@dataclasses.dataclass(frozen=True)
class Ended:
    """One generated sequence: its tokens, their log-probabilities, and why it ended."""

    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    reason: str  # "eos", "length" or "stop" (a stop string of the engine's stop_strings)


def ended(ctx: gen.Engine, prompt: list[int], tokens: list) -> Ended:
    """How the sequence ``tokens`` (from :func:`run`) after ``prompt`` ended."""
    logprobs = top = None
    if ctx.options.top_logprobs:
        tokens, logprobs, top = (
            [t for t, _, _ in tokens],
            [p for _, p, _ in tokens],
            [list(best) for _, _, best in tokens],
        )
    elif ctx.options.token_logprobs:
        tokens, logprobs = [t for t, _ in tokens], [float(p) for _, p in tokens]
    limit = gen.new_tokens(ctx, len(prompt))
    if ctx.position_limit is not None:  # generate gave it the tokens that fit
        limit = min(limit, max(ctx.position_limit - len(prompt), 0))
    reason = "length" if len(tokens) >= limit else "eos"
    if tokens and ctx.stops is not None and ctx.stops.hit(list(prompt) + list(tokens)):
        reason = "stop"
    return Ended(list(tokens), logprobs, top, reason)
