"""A prefix cache for the slots: the KV rows of recent prompts stay on the device.

:meth:`PrefixCache.prefill_many` runs the prompts of a few requests together, each in steps of
its :func:`width`: a prompt of at most :data:`BLOCK` tokens in one step of its prompt bucket (a
multiple of 16, as :func:`.slots.prefill` runs it), a longer one in steps of exactly
:data:`BLOCK` tokens (its last block padded; a row whose prompt is done feeds padding until the
others are). Only prompts of one width run together. It keeps the cache rows of each prompt's
whole blocks, bounded in bytes and evicted least recently used first. A later prompt that
starts with stored blocks gets their rows copied into its row and runs only its other blocks. A
row's steps depend on its own prompt alone (the same width, the same positions), so a request
gets the same tokens and log-probabilities, bit for bit, with or without the cache and whichever
prompts run beside it, where the rows of a step do not change each other's bits
(:func:`rows_agree` checks that for a batch size). (The tokens equal a one-step
:func:`.slots.prefill`'s; for a prompt longer than a block, log-probabilities differ from it in
the last bits, as steps of other shapes round differently.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from . import prefill as prefills
from . import slot_inputs, slots
from .errors import GenerationError

if TYPE_CHECKING:
    from .engine import Engine

BLOCK = 64  # tokens of a prefill step, and the unit the cache keeps
ROWS = (1, 2, 4)  # the batch sizes of prefill steps (a batch pads to the next one); a step of
# 4 x 64 tokens is compute-bound on a CPU already, and each size is a program to compile


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    """What the cache did: prompts looked up, those that used stored rows, prompt tokens looked
    up and those whose rows came from the cache, the bytes and entries held now."""

    queries: int
    hits: int
    query_tokens: int
    hit_tokens: int
    bytes: int
    entries: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    tokens: tuple[int, ...]
    cache: dict[str, jax.Array]  # [1, heads, rows, head_size] by input name, rows >= tokens
    nbytes: int


@functools.cache
def _copy_function():
    def copy(empty, stored):
        return jax.tree.map(
            lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), 0, axis=2),
            empty,
            stored,
        )

    return jax.jit(copy, donate_argnums=(0,))


@functools.cache
def _row_function():
    def copy(cache, stored, row):  # a stored prompt longer than the cache: its first rows
        return jax.tree.map(
            lambda a, b: jax.lax.dynamic_update_slice(
                a, b[:, :, : a.shape[2]].astype(a.dtype), (row, 0, 0, 0)
            ),
            cache,
            stored,
        )

    return jax.jit(copy, donate_argnums=(0,))


@functools.cache
def _take_function(rows: int):
    return jax.jit(lambda cache: jax.tree.map(lambda a: a[:, :, :rows, :], cache))


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The KV rows of recent prompts, on the device, for an engine's slots.

    Args:
        engine: the engine whose slots take the prefixes.
        max_bytes: the most bytes of stored rows (0: nothing is stored; prompts still run in
            blocks, so the answers are those of a cache that misses).

    An engine whose prompt steps are not padded to blocks (the prefill rule "pow2", or a grow
    cache, whose valid rows come last) stores nothing: its prompts run as
    :func:`.prefill.prefill_many` runs them (``blocks`` is False).

    Not thread-safe: call it from the thread that runs the engine.
    """

    def __init__(self, engine: Engine, max_bytes: int):
        self.blocks = blocks_apply(engine)
        self.engine, self.max_bytes = engine, int(max_bytes) if self.blocks else 0
        self._entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._queries = self._hits = self._query_tokens = self._hit_tokens = 0

    @property
    def stats(self) -> PrefixStats:
        """The counts so far (see :class:`PrefixStats`)."""
        return PrefixStats(
            self._queries,
            self._hits,
            self._query_tokens,
            self._hit_tokens,
            self._bytes,
            len(self._entries),
        )

    def prefill(self, request: slots.Request) -> slots.Prefix:
        """``request``'s prefix: :meth:`prefill_many` of it alone."""
        return self.prefill_many([request])[0]

    def prefill_many(
        self, requests: Sequence[slots.Request], *, cache_rows: int = 0
    ) -> list[slots.Prefix]:
        """The prefixes of ``requests``: each prompt from the end of the stored blocks it starts
        with, in steps of its :func:`width`; prompts of one width run together, in batches of
        :data:`ROWS` sizes (no padding rows), in a cache of the rows of a prefill window
        (:func:`.prefill.windows`, at least ``cache_rows``); then stores the rows of each
        prompt's whole blocks.

        Raises:
            GenerationError: as :func:`.slots.prefill`, naming the request by its index.
        """
        engine, requests = self.engine, list(requests)
        if not self.blocks:  # nothing to look up: each prompt as prefill_many runs it
            self._queries += len(requests)
            self._query_tokens += sum(len(r.prompt) for r in requests)
            return [self._alone(r, cache_rows, i) for i, r in enumerate(requests)]
        starts = []
        for request in requests:
            prompt = request.prompt
            self._queries += 1
            self._query_tokens += len(prompt)
            entry, shared = self._lookup(prompt, (len(prompt) - 1) // BLOCK * BLOCK)
            if entry is not None:
                self._entries.move_to_end(entry.tokens)
                self._hits += 1
                self._hit_tokens += shared
            starts.append((entry, shared))
        groups: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(width(engine, len(request.prompt)), []).append(i)
        prefixes: list[slots.Prefix | None] = [None] * len(requests)
        for size, members in groups.items():
            while members:
                n = max((r for r in ROWS if r <= len(members)), default=len(members))
                part, members = members[:n], members[n:]
                ran = self._run([requests[i] for i in part], [starts[i] for i in part], size,
                                cache_rows, part)  # fmt: skip
                for i, prefix in zip(part, ran, strict=True):
                    prefixes[i] = prefix
        return prefixes  # type: ignore[return-value]

    def _run(self, requests, starts, size: int, cache_rows: int, names) -> list[slots.Prefix]:
        """The prefixes of ``requests`` of one width (``size``) run together, each from its
        start (a stored entry and the tokens it shares, or (None, 0))."""
        engine = self.engine
        pending = prefills.begin(engine, requests, BLOCK, rows=cache_rows, names=names)
        fed, cache = pending.fed.copy(), pending.cache
        for i, (entry, shared) in enumerate(starts):
            if entry is not None:
                # rows past ``shared`` are rewritten by the next blocks or hidden by the mask
                cache = _row_function()(cache, entry.cache, jnp.int32(i))
                fed[i] = shared
        pending = dataclasses.replace(pending, fed=fed, lengths=fed.astype(np.int32), cache=cache)
        steps = _steps(pending, size)  # of the longest row
        for i, request in enumerate(requests):
            # a row done before the others feeds a padded step after its prompt
            after = len(request.prompt) + size if _steps(pending, size, i) < steps else 0
            if max(after, written(pending, i, size)) > engine.slot_capacity:
                raise GenerationError(
                    f"request {names[i]}: its prompt of {len(request.prompt)} tokens, padded to "
                    f"steps of {size}, needs more than the slots' capacity of "
                    f"{engine.slot_capacity}"
                )
            held = slots._rows_of(engine, pending.cache, engine.slot_capacity)
            assert max(after, written(pending, i, size)) <= held, "begin's window holds them"
        while not pending.done:
            pending = prefills.step(engine, pending, size)
        prefixes = prefills.end(engine, pending)
        for request, prefix in zip(requests, prefixes, strict=True):
            whole = len(request.prompt) // BLOCK * BLOCK
            self._store(request.prompt[:whole], prefix.rows.cache)
        return prefixes

    def _alone(self, request: slots.Request, cache_rows: int, name: int) -> slots.Prefix:
        """``request``'s prefix, its prompt alone in the engine's own steps."""
        pending = prefills.begin(self.engine, [request], rows=cache_rows, names=[name])
        while not pending.done:
            pending = prefills.advance(self.engine, pending)
        return prefills.end(self.engine, pending)[0]

    def clear(self) -> None:
        """Drops every stored prefix."""
        self._entries.clear()
        self._bytes = 0

    def _lookup(self, prompt: tuple[int, ...], last: int) -> tuple[_Entry | None, int]:
        """The entry sharing the most whole blocks with ``prompt`` (up to ``last``), and how
        many tokens those blocks hold."""
        best, most = None, 0
        for entry in self._entries.values():
            shared = min(_shared(entry.tokens, prompt), last) // BLOCK * BLOCK
            if shared > most:
                best, most = entry, shared
        return best, most

    def _store(self, prompt: tuple[int, ...], cache: dict[str, jax.Array]) -> None:
        if self.max_bytes <= 0 or not prompt:
            return
        rows = len(prompt)  # whole blocks: few shapes to compile
        nbytes = sum(
            a.shape[0] * a.shape[1] * rows * a.shape[3] * a.dtype.itemsize for a in cache.values()
        )
        if nbytes > self.max_bytes:
            return
        covering = next((t for t in self._entries if t[: len(prompt)] == prompt), None)
        if covering is not None:  # a stored prompt starts with this one: it covers it
            self._entries.move_to_end(covering)
            return
        # a stored prompt that starts this one is covered by it
        for tokens in [t for t in self._entries if len(t) < len(prompt) and prompt[: len(t)] == t]:
            self._bytes -= self._entries.pop(tokens).nbytes
        while self._entries and self._bytes + nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
        kept = _take_function(rows)(cache)
        self._entries[prompt] = _Entry(prompt, kept, nbytes)
        self._bytes += nbytes


def warm(engine: Engine, state: slots.SlotState, batches: Sequence[int]) -> slots.SlotState:
    """Compiles what :meth:`PrefixCache.prefill_many` and :func:`.slots.insert` run for
    prefills of ``batches`` prompts: a step of every :func:`width` in the rows it runs in (its
    own rows, :func:`.prefill.begin`), in the other prefill windows (:func:`.prefill.windows`)
    steps of :data:`BLOCK` (a prompt of more than one block); each prefix put into slot 0 of
    ``state`` and freed; then the moves between windows (:func:`.slots.warm_moves`: a prefix
    of each number of rows into the slots at each window, the slots resized between windows).
    Returns the state (its arrays were donated; slot 0 must be free)."""
    cache = PrefixCache(engine, 0)
    pad = slots._pad_token(engine)
    shortest: dict[int, int] = {}  # the shortest prompt of each width
    for n in range(BLOCK, 0, -1):
        shortest[width(engine, n)] = n
    _, *others = prefills.windows(engine.slot_capacity)
    # a prompt of one step runs in the rows a request gets (its step's own, or the first window)
    runs = [(0, n) for n in sorted(shortest.values())]
    runs += [(rows, BLOCK + 1) for rows in others if rows >= 2 * BLOCK]
    made: dict[int, slots.Prefix] = {}  # a prefix of each number of cache rows
    for rows, length in runs:
        for batch in batches:
            requests = [slots.Request((pad,) * length, max_new_tokens=1)] * batch
            prefix = cache.prefill_many(requests, cache_rows=rows)[0]
            state = slots.free(slots.insert(engine, prefix, state, 0), 0)
            made[slots._rows_of(engine, prefix.rows.cache, engine.slot_capacity)] = prefix
    slots.warm_moves(engine, state, list(made.values()))
    return state


def cache_bytes_per_token(engine: Engine) -> int:
    """Bytes of the cache rows of one token (all layers, keys and values)."""
    return sum(e.heads * e.head_size * jnp.dtype(e.dtype).itemsize for e in engine.cache.entries)


def width(engine: Engine, length: int) -> int:
    """Tokens of each prefill step of a prompt of ``length`` tokens in :class:`PrefixCache`:
    one step of the engine's prompt bucket for a prompt of at most :data:`BLOCK` tokens (37
    tokens as 48: the width :func:`.slots.prefill` runs it in; such a prompt has no whole block
    to find stored), else :data:`BLOCK`. A step's width changes the bits of its rows' attention,
    so prompts of one width only run together."""
    if length <= BLOCK:
        return engine.cache_mode.prompt_step(max(int(length), 1), engine.spec.prefill)
    return BLOCK


def _steps(pending: prefills.Pending, size: int, row: int | None = None) -> int:
    """Steps of ``size`` tokens that ``row`` (None: the longest row) has left."""
    left = pending.remaining if row is None else pending.remaining[row : row + 1]
    return int(-(-left.max() // size))


def written(pending: prefills.Pending, row: int, size: int = BLOCK) -> int:
    """Cache rows the steps of ``size`` tokens of ``row`` write (its last step padded)."""
    return int(pending.fed[row] + size * _steps(pending, size, row))


def blocks_apply(engine: Engine) -> bool:
    """Whether the engine's prompt steps may be padded to :data:`BLOCK` tokens (its rule pads
    to buckets; else :class:`PrefixCache` cannot run its prompts) and its rows depend on the
    prompt's tokens alone (no request's own inputs: an encoder's, images)."""
    mode, rule = engine.cache_mode, engine.spec.prefill
    if not mode.rows_first:  # a grow cache's valid rows come last: no stored rows to put back
        return False
    if slot_inputs.takes(engine):
        return False
    return mode.prompt_step(BLOCK, rule) == BLOCK and mode.prompt_step(BLOCK - 1, rule) == BLOCK


def rows_agree(engine: Engine, rows: int) -> bool:
    """Whether ``rows`` prompts run together by :meth:`PrefixCache.prefill_many` get the same
    prefixes (first tokens, log-probabilities and cache rows), bit for bit, as each run alone
    (on some CPUs a larger matrix product or reduction sums in another order): prompts of one
    step (one :func:`width`), and of two blocks where the slots hold them."""
    vocab = engine.vocab_size or 1000
    top = engine.slot_top_logprobs

    def request(j: int, length: int) -> slots.Request:
        prompt = tuple((3 + j + 7 * i) % vocab for i in range(length))
        return slots.Request(
            prompt, max_new_tokens=1, logprobs=True, top_logprobs=top, do_sample=j % 2 == 1,
            seed=j,
        )  # fmt: skip

    sets = [[request(j, 40 - 2 * j) for j in range(rows)]]  # one width (48 tokens)
    if engine.slot_capacity >= 3 * BLOCK:
        sets.append([request(j, 70 + 5 * j) for j in range(rows)])  # two blocks each
    cache = PrefixCache(engine, 0)

    def bits(prefix: slots.Prefix) -> tuple:
        first, n = prefix.first, len(prefix.request.prompt)
        arrays = [np.asarray(a[:, :, :n]).tobytes() for _, a in sorted(prefix.rows.cache.items())]
        return first.token, np.float32(first.logprob).tobytes(), first.top, arrays

    for requests in sets:
        alone = [cache.prefill_many([r])[0] for r in requests]
        together = cache.prefill_many(requests)
        if not all(bits(a) == bits(b) for a, b in zip(alone, together, strict=True)):
            return False
    return True
