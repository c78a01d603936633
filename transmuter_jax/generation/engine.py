"""The compiled engine: a frozen specification compiled for a batch (and a mesh).

:func:`~transmuter_jax.generation.compile` gives an :class:`Engine`; :func:`generate` runs
batches on it and its slots (:mod:`.slots`) let requests join and leave a running batch. The
engine is frozen: its programs come from the one cache of :mod:`.programs`, shared by every
engine that agrees on what determines them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..onnx.model import Model
from . import prefill as prefills
from . import slots, speculative
from .cache import CacheLayout, Mode
from .context import Context
from .options import Options
from .stops import StopStrings


@dataclasses.dataclass(frozen=True, eq=False)
class Compiled:
    """What compile() prepares: the steps (which record the shapes they ran), the selection, the
    beam reorder, and the decode chunks.

    Attributes:
        grow_cache: in grow, what runs: "padded", "buckets" or "exact" ("" in other modes).
        unpadded: in grow, why the cache keeps exact lengths ("" when it is padded).
        decoder: the decode chunks on the device; None where every step runs on the host.
    """

    steps: Any
    select: Any
    reorder: Any
    grow_cache: str = ""
    unpadded: str = ""
    decoder: Any = None

    @property
    def cache(self) -> Mode:
        """The cache mode object that runs."""
        return self.steps.mode

    @property
    def shapes(self) -> int:
        """How many step shapes this engine has run (prompt steps and decode chunks)."""
        return len(self.steps.shapes)

    @property
    def padded(self) -> bool:
        """Whether grow steps run on a padded cache (a few shapes) rather than exact lengths."""
        return self.steps.padding is not None


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """A specification compiled for batches of ``batch_size`` rows.

    Attributes:
        spec: the specification (:func:`~transmuter_jax.generation.context`).
        batch_size: the rows of a batch (the slots).
        model: the decoder that runs (its fused q/k/v split and its weights placed on a mesh).
        embed: the embedding model that runs, or None.
        jit_options: options of ``jax.jit``, as (name, value) pairs.
        placement: with a mesh, where the weights and cache live
            (:class:`~transmuter_jax.generation.sharding.Placement`), else None.
        compiled: the programs (:class:`Compiled`).
        assistant: the draft model's engine (speculative decoding, docs/speculative.md), or
            None.
        slot_windows: the slots' decode chunks read the smallest window of their capacity that
            holds the live requests (64, 128, 256, ... rows: a program each); False: the whole
            capacity (generate()'s calls, whose capacity is their own: one decode program).
    """

    spec: Context
    batch_size: int
    model: Model
    embed: Model | None
    jit_options: tuple[tuple[str, Any], ...] = ()
    placement: Any = None
    compiled: Compiled | None = None
    slot_capacity: int = slots.CAPACITY
    slot_top_logprobs: int = 5
    assistant: Engine | None = None
    slot_windows: bool = True

    # -- slots (see :mod:`.slots` and docs/engine.md) -----------------------------------------

    def init_state(self) -> slots.SlotState:
        """Empty slots: ``batch_size`` of them, each with a cache of ``slot_capacity`` rows."""
        return slots.init(self)

    def prefill(self, request: slots.Request) -> slots.Prefix:
        """Runs ``request``'s prompt alone (one padded step) and selects its first token (a
        request with inputs of its own: as :meth:`prefill_many` runs it)."""
        if isinstance(request, slots.Request) and (request.inputs or self.given):
            return prefills.prefill_many(self, [request])[0]
        return slots.prefill(self, request)

    def prefill_many(self, requests: Sequence[slots.Request]) -> list[slots.Prefix]:
        """Runs the prompts of ``requests`` together (one step per bucket chunk for all of
        them) and selects each one's first token: their prefixes, in order."""
        return prefills.prefill_many(self, requests)

    def begin_prefill(
        self, requests: Sequence[slots.Request], chunk: int = 512
    ) -> prefills.Pending:
        """Admits ``requests`` for a prefill run step by step (:meth:`advance_prefill`), at most
        ``chunk`` prompt tokens of each per step (a multiple of 64 up to 512), so that decode
        chunks of the running slots can go between the chunks of long prompts."""
        return prefills.begin(self, requests, chunk)

    def advance_prefill(self, pending: prefills.Pending) -> prefills.Pending:
        """One prefill step of every prompt of ``pending`` with tokens left (its next part,
        padded to a bucket); ``pending.done`` once all are fed."""
        return prefills.advance(self, pending)

    def end_prefill(self, pending: prefills.Pending) -> list[slots.Prefix]:
        """The prefixes of a fed ``pending`` (each request's first token selected)."""
        return prefills.end(self, pending)

    def insert(self, prefix: slots.Prefix, state: slots.SlotState, slot: int) -> slots.SlotState:
        """``state`` with ``prefix`` in the free slot ``slot`` (``state`` is donated)."""
        return slots.insert(self, prefix, state, slot)

    def generate(
        self, state: slots.SlotState, steps: int, program_steps: int | None = None
    ) -> tuple[slots.SlotState, list[slots.Token]]:
        """Up to ``steps`` decode steps of every live slot in one compiled loop: the state after
        them (``state`` is donated) and the new tokens, step by step (a slot that speculates,
        docs/speculative.md, may take several tokens a step). The loop is compiled for a power
        of two of ``steps``, or of ``program_steps`` (at least ``steps``), so that chunks of
        other lengths run one program."""
        return speculative.generate(self, state, steps, program_steps)

    def free(self, state: slots.SlotState, slot: int) -> slots.SlotState:
        """``state`` with slot ``slot`` empty."""
        return slots.free(state, slot)

    # -- what the specification says ---------------------------------------------------------

    @property
    def options(self) -> Options:
        """The generation options."""
        return self.spec.options

    @property
    def config(self) -> dict[str, Any]:
        """config.json of the repository."""
        return self.spec.config

    @property
    def given(self) -> tuple[str, ...]:
        """Inputs the caller gives each step."""
        return self.spec.given

    @property
    def image_token(self) -> int | None:
        """The image token whose embeddings image features replace, or None."""
        return self.spec.image_token

    @property
    def cache(self) -> CacheLayout:
        """The layout of the KV cache."""
        return self.spec.cache

    @property
    def processors(self) -> tuple[Any, ...]:
        """The logits processors, in order."""
        return self.spec.processors

    @property
    def stops(self) -> StopStrings | None:
        """The stop strings, or None."""
        return self.spec.stops

    @property
    def mode(self) -> str:
        """The name of the cache mode."""
        return self.spec.mode

    @property
    def eos(self) -> tuple[int, ...]:
        """The eos token ids (empty: none)."""
        return self.spec.eos

    @property
    def position_limit(self) -> int | None:
        """The most tokens a row can hold (see :attr:`Context.position_limit`)."""
        return self.spec.position_limit

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size."""
        return self.spec.vocab_size

    @property
    def cache_mode(self) -> Mode:
        """The cache mode object that runs (a grow mode refined by compile)."""
        return self.compiled.cache if self.compiled is not None else self.spec.cache_mode
