"""generate() as a loop over the slots' API: prefill_many, insert, generate.

Where the slots run a specification (:func:`.slots.check`: no beam search, no task's own
processors, no mesh, a cache whose rows can join at other lengths),
:func:`.loop.generate` is :func:`run`: each prompt (with num_return_sequences n > 1, each of
its n sequences, :func:`single`) is a :class:`~.slots.Request` with the specification's
options, its seed and its number of new tokens, in a slot of its own; the
prompts run together (:func:`.prefill.prefill_many`; where no constraint runs, the slots take
their rows and the first chunk is dispatched before the first tokens are read), and the slots'
decode chunks (:func:`.speculative.generate`: plain steps where no slot speculates) give the
tokens, which on_token reports in generate()'s events (one per step, -1 where a row takes none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from . import constraints, slots, speculative
from . import prefill as prefills
from .cache import PREFILL_CAP, bucket

if TYPE_CHECKING:
    from .engine import Engine


def single(engine: Engine) -> Engine:
    """``engine`` as the slots run generate(): one sequence per prompt (with
    num_return_sequences n > 1 each of a prompt's sequences is a row, a slot, of its own, with
    its own seed) and no constraint of the specification's (each row's request carries it)."""
    options, changes = engine.options, {}
    if options.num_return_sequences > 1:
        changes["num_return_sequences"] = 1
    if engine.spec.constraint:
        changes |= {k: False if k == "json_object" else None for k in constraints.KINDS}
    if not changes:
        return engine
    return dataclasses.replace(engine, spec=engine.spec.with_options(**changes))


def run(
    engine: Engine,
    rows: Sequence[tuple[Sequence[int], int, int] | tuple[Sequence[int], int, int, Any]],
    on_token: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> tuple[list[list[Any]], speculative.Stats]:
    """generate() over the slots: each (prompt, max_new_tokens, seed[, inputs]) a request in a
    slot of its own (an empty prompt or none to make: a row that gives nothing; ``inputs``: the
    request's own, :mod:`.slot_inputs`), the prompts prefilled together, then the slots' decode
    chunks until every row is done.

    Returns each row's new tokens (as :func:`.loop.generate` gives them: without the eos id,
    with log-probabilities where the options ask) and what speculation did
    (:class:`~.speculative.Stats`).
    """
    constraint = constraints.from_options(engine.options)  # each row's request's
    engine = single(engine)
    inputs = [row[3] if len(row) > 3 else None for row in rows]
    rows = [tuple(row[:3]) for row in rows]
    options = engine.options
    need = [
        max(bucket(len(p) + n), bucket(len(p)) if len(p) <= PREFILL_CAP else bucket(len(p) + 1))
        for p, n, _ in rows
        if p
    ]
    longest = max((len(p) for p, _, _ in rows), default=0)
    # the prompts run together: each writes the padded width of the longest one's steps
    capacity = bucket(max([*need, slots.written(0, longest) if longest else 0, 64]))
    limit = engine.position_limit
    if limit is not None:
        capacity = min(capacity, bucket(limit))
    # the top_logprobs the options ask for, no more: top k of every position costs
    engine = dataclasses.replace(
        engine,
        batch_size=max(engine.batch_size, len(rows)),  # num_return_sequences: rows per prompt
        slot_capacity=capacity,
        slot_top_logprobs=options.top_logprobs,
        # a capacity of the call's own, read whole: one decode program, as generate() had;
        # an encoder-decoder's calls allow the model's whole length (Whisper: 448 tokens) and
        # end far sooner: its chunks read a window of the rows in use
        slot_windows=bool(engine.given),
    )
    state = None  # the slots, made when a row takes more than its first token
    n = len(rows)
    kept: list[list[Any]] = [[] for _ in rows]
    finished = np.array([not p or m == 0 for p, m, _ in rows])
    first = np.full(n, -1, np.int32)
    first_logprob = np.full(n, np.nan, np.float32)
    first_top: list[tuple] = [()] * n
    taking = [i for i in range(n) if not finished[i]]
    requests = [
        slots.Request(
            tuple(rows[i][0]),
            max_new_tokens=rows[i][1],
            seed=int(rows[i][2]),
            stop_strings=options.stop_strings or (),
            logprobs=options.logprobs,
            top_logprobs=options.top_logprobs,
            constraint=constraint,
            inputs=inputs[i],
        )
        for i in taking
    ]
    ahead: slots.Chunk | None = None
    early = (
        bool(requests)
        and constraint is None
        and prefills.together(engine, requests)
        and _loaded(engine, requests, options.decode_steps)
    )
    if early:  # the slots take the rows and run before the first tokens are read
        state, ahead, inserted, prefixes = _started(engine, requests, taking, options.decode_steps)
    else:
        prefixes = prefills.prefill_many(engine, requests) if requests else []
    for i, prefix in zip(taking, prefixes, strict=True):
        if prefix.first is not None:
            t = prefix.first
            first[i], first_logprob[i], first_top[i] = t.token, t.logprob, t.top
            finished[i] = t.done
            _keep(kept[i], t, options)
    _emit(on_token, options, first, finished, first_logprob, first_top)
    if early:
        if state is not None:
            firsts = dict(zip(taking, (p.first for p in prefixes), strict=True))
            state = slots.settle(state, [(i, firsts[i]) for i in inserted])
    else:
        pairs = []
        for prefix, i in zip(prefixes, taking, strict=True):
            if finished[i]:
                slots.discard(prefix)
            else:
                pairs.append((prefix, i))
        inserted = [i for _, i in pairs]
        if pairs:  # its rows are the slots' once inserted
            state = slots.insert_many(engine, pairs, slots.init(engine))
        del pairs
    del prefixes
    made = 0
    chunks = _chunks(engine, state, options.decode_steps, rows, kept, ahead)
    for after, tokens in chunks:
        state = after
        _events(on_token, options, tokens, finished)
        made += len(tokens)
        for t in tokens:
            _keep(kept[t.slot], t, options)
    if state is None:
        return kept, speculative.Stats(made)
    for i in inserted:  # a constraint's host matchers go
        state = slots.free(state, i)
    d = jax.device_get(state.rows.drafts)
    used = [i for i, (p, m, _) in enumerate(rows) if p and m]
    total = lambda a: int(np.sum(a[used])) if used else 0  # noqa: E731
    return kept, speculative.Stats(made, total(d.steps), total(d.drafted), total(d.accepted))


def _plain(engine: Engine, state: slots.SlotState) -> bool:
    """Whether the slots' next chunk is a plain one: no constraint table, no slot speculating."""
    return state.live_table is None and not speculative.speculating(engine, state)[0]


def _loaded(engine: Engine, requests: Sequence[slots.Request], steps: int) -> bool:
    """Whether the decode chunk of ``requests``' slots has run in this process: else its program
    is compiled or read first, which the first tokens do not wait for."""
    window = engine.slot_capacity
    if engine.slot_windows:  # as launch() picks it, the prompts' lengths the longest
        window = slots.window_of(max(len(r.prompt) for r in requests) + steps, window)
    return slots.ran(engine, window)


def _started(
    engine: Engine, requests: Sequence[slots.Request], taking: list[int], steps: int
) -> tuple[slots.SlotState | None, slots.Chunk | None, list[int], list[slots.Prefix]]:
    """The prompts of ``requests`` (those of rows ``taking``) run together, and before their
    first tokens are read (the host's dispatches overlap the device's prompt): the slots made,
    the rows that take more than one token put in them unread, the first plain chunk launched.
    Returns the state (None: no row takes more), the chunk, the rows in slots, and the
    prefixes with their first tokens (waiting for the device); :func:`.slots.settle` gives the
    slots their first tokens."""
    pending = prefills.fed(engine, requests)
    more = [k for k, r in enumerate(pending.resolved) if r["max_new"] > 1]
    selected = prefills.select(engine, pending)  # first: the device's next program
    state = slots.init(engine) if more else None  # made while the device runs the prompts
    ahead = None
    if state is not None:
        pairs = [(selected.prefixes[k], taking[k]) for k in more]
        state = slots.insert_many(engine, pairs, state)
        longest = max(p.length for p, _ in pairs)  # the host's: no wait for the rows
        del pairs
        if _plain(engine, state):
            state, ahead = slots.launch(engine, state, steps, longest=longest)
    prefixes = prefills.read(engine, pending, selected)
    return state, ahead, [taking[k] for k in more], prefixes


def _chunks(
    engine: Engine,
    state: slots.SlotState | None,
    steps: int,
    rows,
    kept,
    ahead: slots.Chunk | None = None,
) -> Iterator[tuple[slots.SlotState, list[slots.Token]]]:
    """The decode chunks of the slots until none is live: the state and the tokens of each chunk
    as it is read.

    Plain chunks (no slot speculates, no constraint table) run one ahead: the next chunk is
    dispatched on the rows of the one the device runs before the host reads that one's tokens,
    so the device does not wait for the host between chunks (for the tokens' transfer, their
    reading, the next call's dispatch: 1-2 ms a chunk on a CPU). It is not dispatched where
    each live row's ``max_new_tokens`` ends within the chunk being read. ``rows``: run()'s
    (prompt, max_new_tokens, seed); ``kept``: each row's tokens so far (a row's slot is its
    index); ``ahead``: a chunk launched on ``state``'s rows, not read."""
    while state is not None and state.live_slots:
        plain = _plain(engine, state)
        if ahead is None and not plain:
            state, tokens = speculative.generate(engine, state, steps)
            yield state, tokens
            continue
        if ahead is None:
            state, ahead = slots.launch(engine, state, steps)
        left = [rows[s][1] - len(kept[s]) for s in state.live_slots]
        then = None
        if plain and max(left, default=0) > steps:  # a row may take tokens after this chunk
            state, then = slots.launch(engine, state, steps, longest=ahead.longest)
        state, tokens = slots.finish(state, ahead)
        ahead = then
        yield state, tokens


def _keep(into: list, token: slots.Token, options) -> None:
    if token.eos:
        return
    if options.top_logprobs:
        into.append((token.token, token.logprob, list(token.top)))
    elif options.token_logprobs:
        into.append((token.token, token.logprob))
    else:
        into.append(token.token)


def _events(on_token, options, tokens: list[slots.Token], finished: np.ndarray) -> None:
    """One on_token event per position: a slot's tokens in order, the others -1."""
    if on_token is None or not tokens:
        return
    n = len(finished)
    queues: dict[int, list[slots.Token]] = {}
    for t in tokens:
        queues.setdefault(t.slot, []).append(t)
    for j in range(max(len(q) for q in queues.values())):
        token = np.full(n, -1, np.int32)
        logprob = np.full(n, np.nan, np.float32)
        top: list[tuple] = [()] * n
        for s, q in queues.items():
            if j < len(q):
                token[s], logprob[s], top[s] = q[j].token, q[j].logprob, q[j].top
                finished[s] = q[j].done
        _emit(on_token, options, token, finished, logprob, top)


def _emit(on_token, options, token, finished, logprob, top) -> None:
    if on_token is None or not np.any(token >= 0):
        return
    event = {"token": token.copy(), "finished": finished.copy()}
    if options.logprobs:
        event["logprob"] = np.where(token >= 0, logprob, np.nan).astype(np.float32)
    if options.top_logprobs:
        k = options.top_logprobs
        ids = np.full((len(token), k), -1, np.int32)
        values = np.full((len(token), k), np.nan, np.float32)
        for i, pairs in enumerate(top):
            for j, (a, b) in enumerate(pairs[:k]):
                ids[i, j], values[i, j] = a, b
        event["top_ids"], event["top_logprobs"] = ids, values
    on_token(event)
