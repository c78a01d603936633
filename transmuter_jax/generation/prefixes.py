"""A prefix cache for the slots: the KV rows of recent prompts stay on the device.

:meth:`PrefixCache.prefill` runs a prompt in blocks of :data:`BLOCK` tokens, one step each
(the last block holds the rest, padded), and keeps the cache rows of its whole blocks, bounded
in bytes and evicted least recently used first. A later prompt that starts with stored blocks
gets their rows copied into its slot and runs only its other blocks (:func:`.slots.prefill`
with ``past``). Every block runs as the same step with the same inputs either way, so a request
gets the same tokens and log-probabilities, bit for bit, with or without the cache. (They equal
a one-step :func:`.slots.prefill`'s tokens; log-probabilities differ from it in the last bits,
as steps of other shapes round differently.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from . import slots

if TYPE_CHECKING:
    from .engine import Engine

BLOCK = 64  # tokens of a prefill step, and the unit the cache keeps


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

    Not thread-safe: call it from the thread that runs the engine.
    """

    def __init__(self, engine: Engine, max_bytes: int):
        self.engine, self.max_bytes = engine, int(max_bytes)
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
        """``engine.prefill(request)`` in blocks, starting after the stored blocks its prompt
        starts with; then stores the rows of the prompt's whole blocks."""
        engine, prompt = self.engine, request.prompt
        self._queries += 1
        self._query_tokens += len(prompt)
        last = (len(prompt) - 1) // BLOCK * BLOCK  # where the last block starts
        entry, shared = self._lookup(prompt, last)
        past = None
        if entry is not None:
            # rows past ``shared`` are rewritten by the next blocks or hidden by the mask
            empty = engine.cache.empty(1, engine.slot_capacity)
            past = (_copy_function()(empty, entry.cache), shared)
            self._entries.move_to_end(entry.tokens)
            self._hits += 1
            self._hit_tokens += shared
        for end in range(shared + BLOCK, last + 1, BLOCK):
            block = slots.Request(prompt[:end], max_new_tokens=0)
            past = (slots.prefill(engine, block, past).rows.cache, end)
        prefix = slots.prefill(engine, request, past)
        self._store(prompt[: len(prompt) // BLOCK * BLOCK], prefix.rows.cache)
        return prefix

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


def cache_bytes_per_token(engine: Engine) -> int:
    """Bytes of the cache rows of one token (all layers, keys and values)."""
    return sum(e.heads * e.head_size * jnp.dtype(e.dtype).itemsize for e in engine.cache.entries)
