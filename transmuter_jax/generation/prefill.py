"""Several requests' prompts in one prefill step, and long prompts chunk by chunk.

:func:`begin` admits requests (the checks of :func:`.slots.prefill`) and gives a
:class:`Pending`; each :func:`advance` runs ONE step of every prompt that has tokens left (the
next part of each, padded to a bucket of 64 tokens, at most :data:`~.cache.PREFILL_CAP`), so
a server can run the slots' decode chunks between the chunks of a long prompt; :func:`end`
selects each request's first token and gives its :class:`~.slots.Prefix`, ready for
:func:`.slots.insert`; :func:`select` and :func:`read` are :func:`end` in two halves, so a slot
can take a prefix before its first token is read. One request through them is
:func:`.slots.prefill`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.jit import put_all
from ..runtime.stored import AutoStoredJit
from . import slot_inputs, slots
from .cache import PREFILL_CAP
from .errors import GenerationError
from .stops import StopStrings

if TYPE_CHECKING:
    from .engine import Engine


@dataclasses.dataclass(frozen=True, eq=False)
class Pending:
    """Requests whose prompts are being fed, one step at a time.

    Attributes:
        requests: the requests, one row each.
        resolved: each request's options (the specification's where it gives None).
        stops: each request's stop strings, or None.
        fed: [n] prompt tokens fed so far.
        lengths: [n] valid cached tokens.
        cache: the rows' cache (batch n; rows: the smallest of :func:`windows` that holds
            every row the steps write).
        logits: [n, V] each row's logits after its last prompt token (rows that are done), or
            None before the first step.
        chunk: the most prompt tokens of one step.
        tables: each request's constraint table (:func:`.slots.prefill`'s), or None.
        window: the cache's rows after a step (a grow cache starts with none).
        inputs: each request's inputs (:mod:`.slot_inputs`).
        given: the requests' given inputs, batch n, at one encoder width.
    """

    requests: tuple[slots.Request, ...]
    resolved: tuple[dict[str, Any], ...]
    stops: tuple[StopStrings | None, ...]
    fed: np.ndarray
    lengths: np.ndarray
    cache: dict[str, jax.Array]
    logits: jax.Array | None = None
    chunk: int = PREFILL_CAP
    tables: tuple[Any, ...] = ()
    window: int = 0
    inputs: tuple[slot_inputs.Inputs, ...] = ()
    given: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def remaining(self) -> np.ndarray:
        """[n] prompt tokens each row has still to feed."""
        return np.array([len(r.prompt) for r in self.requests]) - self.fed

    @property
    def done(self) -> bool:
        """Whether every prompt is fed (then :func:`end` gives the prefixes)."""
        return not self.remaining.any()


def windows(capacity: int) -> list[int]:
    """The cache rows a prefill may run in, for slots of ``capacity`` rows: 64, 256, 1024, ...
    below it, and the capacity (each is a program per batch size, compiled at a server's
    start-up: a coarser ladder than the decode windows, :func:`.slots.windows`)."""
    found, rows = [], 64
    while rows < capacity:
        found.append(rows)
        rows *= 4
    return [*found, capacity]


def window(need: int, capacity: int) -> int:
    """The fewest rows of :func:`windows` that hold ``need`` rows (the capacity at most)."""
    return next((w for w in windows(capacity) if w >= need), capacity)


def _size(engine: Engine, remaining: int, chunk: int) -> int:
    """Tokens of the next step of prompts with at most ``remaining`` tokens left."""
    return engine.cache_mode.prompt_step(min(remaining, chunk), engine.spec.prefill)


def _schedule(engine: Engine, lengths: Sequence[int], chunk: int) -> list[int]:
    """The step sizes that feed prompts of ``lengths`` together."""
    left, sizes = np.array(lengths), []
    while left.max() > 0:
        size = _size(engine, int(left.max()), chunk)
        sizes.append(size)
        left = np.maximum(left - size, 0)
    return sizes


def begin(
    engine: Engine,
    requests: Sequence[slots.Request],
    chunk: int = PREFILL_CAP,
    *,
    rows: int = 0,
    names: Sequence[int] | None = None,
) -> Pending:
    """Admits ``requests`` (raises GenerationError, naming the request, for one the engine
    cannot take) and gives their prompts to feed, at most ``chunk`` tokens (a multiple of 64 up
    to 512) of each per step, in a cache of the fewest rows of :func:`windows` that hold what
    the steps write and at least ``rows`` (a warm-up's), or the step's own rows when one step
    feeds every prompt whole and ``rows`` asks no more (:meth:`~.cache.Mode.first_rows`): the
    steps attend over those rows only, and :func:`.slots.insert` puts them at the start of a
    slot, whose other rows the mask hides. ``names``: the numbers errors name the requests by
    (their indices)."""
    requests = tuple(requests)
    if not requests:
        raise GenerationError("prefill needs at least one request")
    if len(requests) > 1 and not engine.cache_mode.shared:
        raise GenerationError(
            f"{engine.spec.model.path!r} has a grow cache whose rows share one padding: a "
            "prefill step runs one prompt (another's length would be cached); begin one at a time"
        )
    names = range(len(requests)) if names is None else names
    if (
        isinstance(chunk, bool)
        or not isinstance(chunk, int)
        or not 64 <= chunk <= PREFILL_CAP
        or chunk % 64
    ):
        raise GenerationError(f"chunk must be a multiple of 64 up to {PREFILL_CAP}, got {chunk!r}")
    admitted, tables = [], []
    for i, request in enumerate(requests):
        try:
            admitted.append(slots._admit(engine, request))
            tables.append(slots._table_of(engine, request, admitted[-1][0]["eos"]))
        except GenerationError as error:
            raise GenerationError(f"request {names[i]}: {error}") from None
    capacity = engine.slot_capacity
    prompts = [len(r.prompt) for r in requests]
    # every step writes its padded width after each row's valid rows: the cache must hold it
    written = np.zeros(len(requests), int)
    fed = np.zeros(len(requests), int)
    for size in _schedule(engine, prompts, chunk):
        written = np.maximum(written, fed + size)
        fed = np.minimum(fed + size, prompts)
    for i, (r, _, _) in enumerate(admitted):
        need = max(prompts[i] + r["max_new"], int(written[i]))
        if need > capacity:
            raise GenerationError(
                f"request {names[i]} needs {need} cache rows (a prompt of {prompts[i]} tokens, "
                f"padded, and {r['max_new']} new ones): more than the slots' capacity of {capacity}"
            )
    n, asked = len(requests), rows
    rows = window(max(int(written.max()), asked), capacity)
    steps = _schedule(engine, prompts, chunk)
    own = engine.cache_mode.first_rows(steps[0], max(prompts)) if len(steps) == 1 else None
    if own is not None and asked <= own < rows:  # one step feeds every prompt: its own rows
        rows = own  # (it attends over them alone; insert puts them in a slot's first rows)
    inputs = tuple(i for _, _, i in admitted)
    given, width = slot_inputs.joined(engine, inputs)
    return Pending(
        requests,
        tuple(r for r, _, _ in admitted),
        tuple(s for _, s, _ in admitted),
        np.zeros(n, np.int32),
        np.zeros(n, np.int32),
        engine.cache.empty(n, engine.cache_mode.start_rows(rows), width),
        chunk=chunk,
        tables=tuple(tables),
        window=rows,
        inputs=inputs,
        given=put_all(given),
    )


def advance(engine: Engine, pending: Pending) -> Pending:
    """One step of every prompt with tokens left: its next part, padded (the cache of
    ``pending`` is donated)."""
    if pending.done:
        return pending
    return step(engine, pending, _size(engine, int(pending.remaining.max()), pending.chunk))


# The logits of the rows that ``ending`` marks (rows fed their last token in this step), the
# earlier ones elsewhere; compiled once, read from the compilation cache in a new process.
_last_logits = AutoStoredJit(
    lambda ending, new, old: jnp.where(ending[:, None], new, old), ("prefill.last_logits", 1)
)


def _rows_apart(tree: Any) -> tuple:
    """Traced: ``tree``'s arrays [n, ...] cut into n trees of one row each."""
    n = jax.tree.leaves(tree)[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i : i + 1], tree) for i in range(n))


# The requests' rows cut apart in one program: a slice of each array for each request dispatched
# one at a time costs ~0.1 ms of the host's time each (70 ms at batch 8 on the default model).
_apart = AutoStoredJit(_rows_apart, ("prefill.rows_apart", 1))


def step(engine: Engine, pending: Pending, size: int) -> Pending:
    """One step of ``size`` tokens of every row: the next part of its prompt, padded (a row
    with none left feeds padding after its valid rows, which the next ones overwrite or the
    mask hides). The cache of ``pending`` is donated."""
    mode, remaining, n = engine.cache_mode, pending.remaining, len(pending.requests)
    rows = slots._rows_of(engine, pending.cache, engine.slot_capacity)
    real = np.minimum(remaining, size).astype(np.int32)
    tokens = np.full((n, size), slots._pad_token(engine), np.int32)
    for i, request in enumerate(pending.requests):
        start = int(pending.fed[i])
        tokens[i, : real[i]] = request.prompt[start : start + real[i]]
    feed: dict[str, Any] = {"tokens": tokens, **pending.given}
    if "attention_mask" in {i.name for i in engine.model.inputs}:
        feed["attention_mask"] = mode.mask(pending.lengths, size, rows)
    each = pending.inputs or (slot_inputs.NONE,) * n
    positions = slot_inputs.step_positions(engine, each, pending.fed, size)
    if positions is not None:
        feed["position_ids"] = positions
    prompts = [r.prompt for r in pending.requests]
    feed |= slot_inputs.step_images(engine, prompts, each, pending.fed, real, size)
    last = np.maximum(real - 1, 0).astype(np.int32)
    logits, cache = engine.compiled.steps(
        pending.cache, feed, pending.lengths, last, pending.window, real
    )
    ending = (remaining > 0) & (remaining <= size)  # rows fed their last token
    if pending.logits is not None:
        logits = _last_logits(ending, logits, pending.logits)
    lengths = mode.advance(pending.lengths, real, size).astype(np.int32)
    return dataclasses.replace(
        pending, fed=pending.fed + real, lengths=lengths, cache=cache, logits=logits
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Selected:
    """The requests' first tokens, chosen on the device (:func:`select`) and not read yet.

    Attributes:
        prefixes: each request's :class:`~.slots.Prefix`, ``unread`` (``first`` None) where
            the request asks for tokens.
        outs: each request's selection (a device StepOut, batch n) and its row there.
    """

    prefixes: tuple[slots.Prefix, ...]
    outs: tuple[tuple[slots.StepOut, int] | None, ...]


def select(engine: Engine, pending: Pending) -> Selected:
    """Dispatches the selection of each request's first token and cuts the rows apart, without
    waiting for the device: :func:`read` gives the prefixes with their first tokens, and
    :func:`.slots.insert_many` takes the unread ones (a slot that runs before its first token
    is read)."""
    if not pending.done:
        raise GenerationError("the prompts are not all fed: call advance until done")
    n = len(pending.requests)
    tables = pending.tables or (None,) * n
    lengths = np.asarray(pending.lengths, np.int32)
    deltas = [i.delta for i in pending.inputs] or [0] * n
    each = [  # host arrays: the selection's call copies them
        slots._request_rows(
            engine, r_, r, lengths[i : i + 1], {}, tables[i], host=True, delta=deltas[i]
        )
        for i, (r_, r) in enumerate(zip(pending.requests, pending.resolved, strict=True))
    ]
    # the cache apart: not copied (one request: its rows as they are)
    rows = each[0] if n == 1 else jax.tree.map(lambda *a: np.concatenate(a), *each)
    first = slots._first(engine, engine.slot_top_logprobs)
    chosen: dict[int, tuple[tuple[slots.Rows_, ...], slots.StepOut]] = {}  # rows of each request
    distinct: list[Any] = []
    for t in tables:
        if not any(t is u for u in distinct):
            distinct.append(t)
    for table in distinct:  # one selection per constraint table (the others' rows free)
        members = np.array([t is table for t in tables])
        group = rows
        if table is not None:
            free = np.where(members, rows.constraint, -1).astype(np.int32)
            group = dataclasses.replace(rows, constraint=free)
        after, out = first(pending.logits, group, table)
        apart = _apart(after) if n > 1 else (after,)  # the selection's rows, one a request
        chosen.update({int(i): (apart, out) for i in np.flatnonzero(members)})
    # each request's rows of the cache and given inputs
    shared = (pending.cache, pending.given)
    shared_apart = _apart(shared) if n > 1 else (shared,)
    prefixes, outs = [], []
    for i, request in enumerate(pending.requests):
        apart, out = chosen[i]
        drafted = slots._drafted(engine, request.prompt, pending.resolved[i]["assisted"])
        cache, given = shared_apart[i]
        one = apart[i]
        one = dataclasses.replace(
            one, cache=cache, drafts=dataclasses.replace(one.drafts, cache=drafted)
        )
        asks = pending.resolved[i]["max_new"] > 0
        length = int(lengths[i])
        prefixes.append(slots.Prefix(request, one, None, tables[i], given, asks, length))
        outs.append((out, i) if asks else None)
    return Selected(tuple(prefixes), tuple(outs))


def read(engine: Engine, pending: Pending, selected: Selected) -> list[slots.Prefix]:
    """The prefixes of :func:`select` with their first tokens (waits for the device); a first
    token that ends its request by a stop string marks the prefix's row done."""
    read_: dict[int, Any] = {}  # each selection read once
    prefixes = []
    for i, (prefix, chosen) in enumerate(zip(selected.prefixes, selected.outs, strict=True)):
        if chosen is None:
            prefixes.append(prefix)
            continue
        out, row = chosen
        if id(out) not in read_:
            read_[id(out)] = jax.device_get(out)
        token = slots._tokens(read_[id(out)], prefix.request, [row], 0, None)[0]
        token = dataclasses.replace(token, slot=0)
        one, stops = prefix.rows, pending.stops[i]
        if stops is not None and not token.done and not token.eos:
            if stops.hit([*prefix.request.prompt, token.token]):
                token = dataclasses.replace(token, done=True, finish_reason="stop")
                one = dataclasses.replace(one, done=jnp.ones(1, bool))
        prefixes.append(dataclasses.replace(prefix, rows=one, first=token, unread=False))
    return prefixes


def end(engine: Engine, pending: Pending) -> list[slots.Prefix]:
    """Each request's prefix: its first token selected (as :func:`.slots.prefill` does)."""
    return read(engine, pending, select(engine, pending))


def _by_width(engine: Engine, requests: Sequence[slots.Request]) -> list[list[int]]:
    """The requests in groups of one encoder width, where the decoder cannot pad them (takes
    no encoder_attention_mask); else one group."""
    if not engine.given or slot_inputs.MASK in engine.given or len(requests) < 2:
        return [list(range(len(requests)))]
    groups: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        given = {n: a for n, a in (request.inputs or {}).items() if n in engine.given}
        groups.setdefault(slot_inputs.width(given), []).append(i)
    return list(groups.values())


def prefill_many(engine: Engine, requests: Sequence[slots.Request]) -> list[slots.Prefix]:
    """The prefixes of ``requests``, their prompts run together: one step per bucket chunk (in a
    grow cache whose rows share one padding, one prompt after another)."""
    if len(requests) > 1 and not engine.cache_mode.shared:
        return [p for request in requests for p in prefill_many(engine, [request])]
    groups = _by_width(engine, requests)
    if len(groups) > 1:  # encoder outputs of other widths and no mask to pad them
        done: dict[int, slots.Prefix] = {}
        for members in groups:
            done |= dict(zip(members, prefill_many(engine, [requests[i] for i in members]),
                             strict=True))  # fmt: skip
        return [done[i] for i in range(len(requests))]
    return end(engine, fed(engine, requests))


def together(engine: Engine, requests: Sequence[slots.Request]) -> bool:
    """Whether :func:`prefill_many` runs ``requests`` as one :class:`Pending` (:func:`fed`):
    one shared padding or one request, one encoder width."""
    shared = len(requests) < 2 or engine.cache_mode.shared
    return shared and len(_by_width(engine, requests)) == 1


def fed(engine: Engine, requests: Sequence[slots.Request]) -> Pending:
    """``requests`` begun and advanced until every prompt is fed (the steps dispatched)."""
    pending = begin(engine, requests)
    while not pending.done:
        pending = advance(engine, pending)
    return pending
