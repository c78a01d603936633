"""The KV cache in its three modes. Every branch on the cache mode lives in this module.

- in_place: one buffer as long as the attention mask; GroupQueryAttention writes the new rows of
  each row after its valid rows (it reads their count from the sum of the mask).
- append: a buffer whose free rows the mask hides; the graph's present is the buffer plus the new
  rows, which this module writes into the buffer at each row's length.
- grow: the cache has its exact length (shared by all rows); the present is the next cache.
  Padded (when the decoder could be rewritten, see :mod:`transmuter_jax.onnx.rewrite`), it has a
  fixed number of rows whose valid ones come last: the present is the cache plus the new rows,
  and the rows that end at each row's last real token are the next cache (a prompt step's
  padding after them is dropped); with buckets it grows 64 rows at a time.

Each mode is one :class:`Mode` object, chosen once by ``compile``.

Cache arrays are [batch, heads, length, head_size]: the sequence is axis 2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..onnx.dtypes import device_dtype
from ..onnx.model import Model
from ..onnx.ops import write_rows
from ..onnx.trace import value_sources
from ..onnx.window import hidden_rows_matter
from ..runtime import compile_cache
from ..runtime import jit as compiler
from ..runtime.stored import AutoStoredJit
from .errors import GenerationError

SEQ = 2  # the sequence axis of a cache array
PREFILL_CAP = 512  # the longest prompt step of the "buckets" rule: longer prompts run in chunks
GROW_CACHES = ("padded", "buckets", "exact")  # how compile() runs a grow decoder


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cache array: the graph input that reads it and the output that gives it back."""

    input: str
    output: str
    heads: int
    head_size: int
    dtype: np.dtype
    cross: bool  # cross attention: written once, from the encoder outputs


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The cache arrays of a decoder.

    Attributes:
        entries: the arrays generation keeps, each with the output that gives it back.
        given: the cross-attention inputs the caller gives (no step computes them: the
            decoder has no present output for them; the encoder does, as in the
            onnxruntime-genai Whisper export). They are inputs of every step, as
            encoder_hidden_states are; see :func:`transmuter_jax.generation.context`.
    """

    entries: tuple[CacheEntry, ...]
    given: tuple[str, ...] = ()

    def empty(self, batch: int, length: int, cross_length: int = 0) -> dict[str, jax.Array]:
        """Zero buffers: ``length`` rows (``cross_length`` for cross attention), made by one
        program (a ``jnp.zeros`` each costs a dispatch: 15-20 ms for 60 buffers), read from the
        compilation cache in a new process."""
        return _zeros(self, batch, length, cross_length)()


def zeros(layout: CacheLayout, batch: int, length: int, cross_length: int = 0) -> dict:
    """Traced: :meth:`CacheLayout.empty`'s buffers."""
    return {
        e.input: jnp.zeros(
            (batch, e.heads, cross_length if e.cross else length, e.head_size), e.dtype
        )
        for e in layout.entries
    }


@functools.cache
def _zeros(layout: CacheLayout, batch: int, length: int, cross_length: int):
    """The compiled ``() -> buffers`` of :meth:`CacheLayout.empty`."""
    program = jax.jit(functools.partial(zeros, layout, batch, length, cross_length))
    # its outputs uncommitted: a mesh's programs place them

    def run():
        with compile_cache.scope():  # the program read from the compilation cache
            return program()

    return run


CACHE_PREFIXES = ("past_key_values.", "past.", "past_key_", "past_value_")
"""The names of cache inputs: optimum's and genai's decoders (past_key_values.0.key), GPT-2's
(past.0.key), genai Whisper's (past_key_self_0, past_value_cross_0)."""


def present_name(name: str) -> str:
    """The output that gives back the cache input ``name``: present.0.key for
    past_key_values.0.key or past.0.key, present_key_self_0 for past_key_self_0."""
    if name.startswith("past_key_values."):
        return "present." + name.removeprefix("past_key_values.")
    if name.startswith("past."):
        return "present." + name.removeprefix("past.")
    return "present_" + name.removeprefix("past_")


def is_cross(name: str) -> bool:
    """Whether the cache input ``name`` holds cross attention (past_key_values.0.encoder.key,
    past_key_cross_0)."""
    return ".encoder." in name or "_cross_" in name


def config_dims(config: dict) -> tuple[int | None, int | None]:
    text = config.get("text_config", config)
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    heads = heads or text.get("decoder_attention_heads") or text.get("n_head")
    hidden = text.get("hidden_size") or text.get("d_model") or text.get("n_embd")
    attention = (
        text.get("num_attention_heads") or text.get("decoder_attention_heads") or text.get("n_head")
    )
    size = text.get("head_dim") or (hidden // attention if hidden and attention else None)
    return heads, size


def layout(model: Model, config: dict) -> CacheLayout:
    """The cache layout of ``model``: its cache inputs (:data:`CACHE_PREFIXES`) and their
    present outputs; cross-attention inputs without a present output are given by the caller."""
    outputs = {o.name for o in model.outputs}
    heads_default, size_default = config_dims(config)
    entries, given = [], []
    for info in model.inputs:
        if not info.name.startswith(CACHE_PREFIXES):
            continue
        output = present_name(info.name)
        cross = is_cross(info.name)
        if output not in outputs:
            if cross:  # computed by the encoder, given to every step
                given.append(info.name)
                continue
            raise GenerationError(
                f"{model.path!r}: cache input {info.name!r} has no output {output!r}"
            )
        shape = info.shape or (None,) * 4
        heads = shape[1] if isinstance(shape[1], int) else heads_default
        size = shape[3] if isinstance(shape[3], int) else size_default
        if cross:  # cross attention has all the attention heads
            text = config.get("text_config", config)
            heads = shape[1] if isinstance(shape[1], int) else text.get("decoder_attention_heads")
        if not heads or not size:
            raise GenerationError(f"cannot tell the heads and head size of {info.name!r} {shape}")
        dtype = device_dtype(np.dtype(info.dtype))
        entries.append(CacheEntry(info.name, output, int(heads), int(size), dtype, cross))
    return CacheLayout(tuple(entries), tuple(given))


def bucket(rows: int) -> int:
    """``rows`` rounded up to a multiple of 64 (the buffers' capacities and grow's buckets)."""
    return -(-rows // 64) * 64


def write(
    layout: CacheLayout,
    cache: dict[str, jax.Array],
    outputs: dict[str, jax.Array],
    lengths: jax.Array | None = None,
    padded_rows: int | None = None,
    real: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The cache after a step (traced in the step), from the graph's presents.

    Args:
        lengths: [B] int32 valid cached tokens of each row before the step: when given (append),
            the present's new rows are written into the buffer there.
        padded_rows: a padded grow cache's rows: the last ``padded_rows`` of the present, after
            zero rows when the present is shorter.
        real: with ``padded_rows``, [B] int32 the real tokens of each row's step (its padding
            follows them): each row keeps the ``padded_rows`` rows that end at its last real one.
    """
    new = {}
    for entry in layout.entries:
        present = outputs[entry.output]
        if entry.cross:  # a cross-attention present is empty on the steps that reuse the cache
            new[entry.input] = cache[entry.input] if present.size == 0 else present
        elif padded_rows is not None and real is not None:
            step = present.shape[SEQ] - cache[entry.input].shape[SEQ]
            new[entry.input] = ending_rows(present, padded_rows, step, real)
        elif padded_rows is not None:
            new[entry.input] = with_rows(present, padded_rows, last=True)
        elif lengths is not None:
            past = cache[entry.input]
            rows = jax.lax.slice_in_dim(present, past.shape[SEQ], present.shape[SEQ], axis=SEQ)
            new[entry.input] = write_rows(past, rows, lengths, axis=SEQ)
        else:
            new[entry.input] = present
        new[entry.input] = new[entry.input].astype(entry.dtype)
    return new


def with_rows(a: Any, rows: int, last: bool = False) -> Any:
    """Traced: ``a`` [B, heads, R, head_size] with ``rows`` rows: its first ones, zeros after
    (``last``: its last ones, after zeros)."""
    have = a.shape[SEQ]
    if have >= rows:
        start = have - rows if last else 0
        return jax.lax.slice_in_dim(a, start, start + rows, axis=SEQ)
    widths = [(0, 0)] * a.ndim
    widths[SEQ] = (rows - have, 0) if last else (0, rows - have)
    return jnp.pad(a, widths)


def ending_rows(a: Any, rows: int, step: int, real: Any) -> Any:
    """Traced: ``a`` [B, heads, R, head_size] whose last ``step`` rows are a step's, each row's
    ``real`` [B] real ones first: for each row, the ``rows`` rows that end at its last real one
    (after zeros where ``a`` has fewer before it)."""
    have = a.shape[SEQ]
    widths = [(0, 0)] * a.ndim
    widths[SEQ] = (rows, 0)
    padded = jnp.pad(a, widths)  # row i of ``a`` is row rows + i
    starts = (have - step + real).astype(jnp.int32)  # the slice's last: the last real row
    take = lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, rows, axis=SEQ - 1)  # noqa: E731
    return jax.vmap(take)(padded, starts)


def prompt_bucket(tokens: int) -> int:
    """The padded length of a prompt step of ``tokens`` tokens: a multiple of 16 up to 64 (short
    chat prompts pay little padding), then a multiple of 64."""
    tokens = max(tokens, 1)
    return -(-tokens // 16) * 16 if tokens <= 64 else bucket(tokens)


def chunk(remaining: int) -> int:
    """The largest power of two at most ``remaining`` (45 tokens run as 32, 8, 4, 1)."""
    return 1 << (max(remaining, 1).bit_length() - 1)


class Mode:
    """How one cache mode sizes, masks, writes and advances the cache. ``compile`` picks one.

    Attributes:
        name: "in_place", "append" or "grow".
        shared: rows with prompts of different lengths can share one cache (not in grow at
            exact lengths, nor in a padded grow cache of one padding for every row).
        padded: a grow cache of fixed rows whose valid rows come last.
        on_device: decode chunks can run on the device (the cache keeps its shape each step).
        rows_first: a row's valid rows come first, where its prompt's steps wrote them (so the
            rows of a prompt's first tokens can be stored and put back: a prefix cache).
    """

    name = ""
    shared = True
    padded = False
    on_device = True
    rows_first = True

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def compiled(self, grow_cache: str, pad: Any) -> tuple[Mode, Any, str, str]:
        """The mode that runs, for ``compile``'s ``grow_cache``: (mode, the padded rewrite or
        None, what runs in grow ("padded", "buckets", "exact"; "" elsewhere), why a grow cache
        keeps exact lengths). ``pad()`` gives the rewrite and the reason it failed."""
        return self, None, "", ""

    def prompt_step(self, remaining: int, rule: str) -> int:
        """Tokens of the next prompt step of rows with at most ``remaining`` prompt tokens left:
        "buckets": all of them padded to a bucket (:func:`prompt_bucket`; at most
        :data:`PREFILL_CAP`, longer prompts in chunks of it); "pow2": the largest power of two at
        most ``remaining``; "exact": all of them (at most :data:`PREFILL_CAP`)."""
        if rule == "pow2":
            return chunk(remaining)
        if rule == "exact":
            return min(max(remaining, 1), PREFILL_CAP)
        return min(prompt_bucket(remaining), PREFILL_CAP)

    def groups(self, lengths: dict[int, int]) -> list[list[int]]:
        """The rows that share a cache, from each live row's prompt length: all of them (where
        rows cannot share one, :attr:`shared`, those of one length)."""
        return [list(lengths)] if lengths else []

    def room(self, size: int, capacity: int | None, longest: int) -> int:
        """The decode steps a chunk of at most ``size`` can run (a padded grow bucket may hold
        fewer more tokens)."""
        return size

    def chunk_size(self, decode_steps: int) -> int:
        """The most steps of a decode program of the slots' step for ``decode_steps`` (1: the
        same step, one at a time; 0: the cache changes shape every step, so the host runs each
        step)."""
        return decode_steps if self.on_device else 0

    def grown(self, capacity: int | None, length: int, step: int) -> int | None:
        """The capacity for a step of ``step`` tokens after ``length`` cached ones (None where
        the cache has no padded capacity)."""
        return capacity

    def slot_refusal(self) -> str:
        """Why slots (rows that join and leave a running batch) cannot run ("" when they can)."""
        return ""

    def draft_refusal(self) -> str:
        """Why speculative decoding cannot run ("" when it can): its rejected rows must stay
        behind a row's valid ones, hidden by the mask."""
        return ""

    def start_rows(self, rows: int) -> int:
        """Rows of a new cache of ``rows`` rows before its first step (grow: none, the first
        step's present is the cache)."""
        return rows

    def resize(self, a: Any, rows: int) -> Any:
        """Traced: a self-attention cache array [B, heads, R, head_size] with ``rows`` rows, its
        valid rows kept (they come first: the first rows, then zeros)."""
        return with_rows(a, rows)

    def prompt_rows(self, length: int) -> int:
        """Rows of an empty cache for one step of ``length`` tokens (see prompt_inputs)."""
        return 0

    def capacity(self, longest: int, chunk: int, prompt: int | None = None) -> int:
        """Rows of the buffer for rows of at most ``longest`` tokens fed in chunks of up to
        ``chunk``: room for a chunk of padding after a row's last token, rounded up to 64 so
        that close workloads share compiled shapes. When one step of ``chunk`` tokens feeds
        every prompt whole (``prompt``: the longest), that step's padding is the only one:
        ``max(longest, chunk)`` rows (a 253-token prompt's step of 256 in 256 rows, not 512:
        a prompt step attends over every row of the buffer)."""
        if prompt is not None and chunk >= prompt:
            return bucket(max(longest, chunk))
        return bucket(longest + chunk)

    def first_rows(self, chunk: int, prompt: int) -> int | None:
        """Rows of the buffer a first step of ``chunk`` tokens runs in when it feeds every
        prompt whole (``prompt``: the longest), before the buffer grows to its capacity: the
        step's own rows (it attends over every row of its buffer, and GroupQueryAttention over
        the step's alone when they are all it has); None: the capacity from the start."""
        return chunk if chunk >= prompt else None

    def mask(self, lengths: Any, step: int, rows: int, xp: Any = np) -> Any:
        """[B, columns] int32 attention mask of a step of ``step`` tokens after ``lengths`` [B]
        valid cached tokens in a cache of ``rows`` rows (``xp``: numpy, or jax.numpy traced)."""
        raise NotImplementedError

    def write(self, layout, cache, outputs, lengths, rows_after, real=None):
        """The next cache, traced in the step (see :func:`write`); ``real``: [B] each row's
        real tokens of the step, where :meth:`real_input` gives them."""
        return write(layout, cache, outputs)

    def real_input(self, real: np.ndarray, step: int) -> np.ndarray | None:
        """What a step of ``step`` tokens, ``real`` [B] of them each row's, hands the cache's
        write (:meth:`write`): None where it needs nothing (the step's padding is hidden)."""
        return None

    def advance(self, lengths: Any, real: Any, step: int) -> Any:
        """Valid cached tokens after a step of ``step`` tokens, ``real`` [B] of them each row's."""
        return lengths + real

    def rows_after(self, rows: int, step: int, capacity: int | None) -> int:
        """Rows of the cache arrays after a step."""
        return rows

    def branch(self, cache_length: int) -> bool:
        """The value of use_cache_branch: whether the cache holds tokens or is a buffer."""
        return True

    def donated(self, cache_length: int, rows_after: int | None) -> bool:
        """Whether a step can update the cache arrays in place."""
        return True


class InPlace(Mode):
    """One buffer as long as the attention mask; GroupQueryAttention writes the new rows of each
    row after its valid rows (it reads their count from the sum of the mask)."""

    name = "in_place"

    def prompt_rows(self, length):
        return length  # GroupQueryAttention writes the step's rows into the buffer

    def mask(self, lengths, step, rows, xp=np):
        columns = xp.arange(rows)[None, :]
        return (columns < (lengths + step)[:, None]).astype(xp.int32)  # [B, M]


class Append(Mode):
    """A buffer whose free rows the mask hides; the graph's present is the buffer plus the new
    rows, which :func:`write` puts into the buffer at each row's length."""

    name = "append"

    def mask(self, lengths, step, rows, xp=np):
        past = xp.arange(rows)[None, :] < lengths[:, None]  # [B, C] valid rows, free rows hidden
        new = xp.ones((lengths.shape[0], step), bool)
        return xp.concatenate([past, new], axis=1).astype(xp.int32)  # [B, C + S]

    def write(self, layout, cache, outputs, lengths, rows_after, real=None):
        return write(layout, cache, outputs, lengths)


class GrowExact(Mode):
    """The cache has its exact length, shared by all rows; the present is the next cache. Every
    length is a new shape, so decode runs step by step on the host."""

    name = "grow"
    shared = False
    on_device = False
    rows_first = False

    def compiled(self, grow_cache, pad):
        if grow_cache not in GROW_CACHES:
            raise GenerationError(f"grow_cache must be one of {GROW_CACHES}, got {grow_cache!r}")
        if grow_cache == "exact":
            return self, None, "exact", "grow_cache='exact'"
        padding, reason = pad()
        if padding is None:
            return self, None, "exact", reason
        kind = GrowBuckets if grow_cache == "buckets" else GrowPadded
        return kind("" if padding.per_row else padding.shared), padding, grow_cache, ""

    def prompt_step(self, remaining, rule):
        if rule == "exact":
            return Mode.prompt_step(self, remaining, rule)
        return chunk(remaining)  # padding tokens would be cached: no bucket past the prompt

    def groups(self, lengths):
        return [[i for i, n in lengths.items() if n == m] for m in sorted(set(lengths.values()))]

    def slot_refusal(self):
        return (
            "its grow cache keeps exact lengths, one for all rows (every length a program of "
            "its own), so rows cannot join at other lengths"
        )

    def draft_refusal(self):
        return (
            "a grow cache keeps each row's valid rows last, so the rows of rejected drafts "
            "cannot be left behind them"
        )

    def start_rows(self, rows):
        return 0

    def capacity(self, longest, chunk, prompt=None):
        return 0

    def first_rows(self, chunk, prompt):
        return None  # the cache's length is the step's input shape

    def mask(self, lengths, step, rows, xp=np):
        return xp.ones((lengths.shape[0], rows + step), xp.int32)

    def advance(self, lengths, real, step):
        return lengths + step  # every row's cache holds the whole step

    def rows_after(self, rows, step, capacity):
        return rows + step

    def branch(self, cache_length):
        return cache_length > 0

    def donated(self, cache_length, rows_after):
        return False


class GrowPadded(GrowExact):
    """A grow decoder rewritten for a cache of fixed rows (see :mod:`transmuter_jax.onnx.rewrite`)
    whose valid rows come last: the present is the cache plus the new rows, and its last rows
    are the next cache. The capacity is the longest row rounded up to 64."""

    padded = True
    on_device = True

    def __init__(self, one_padding: str = ""):
        self.one_padding = one_padding  # why every row has the same padding ("": its own)

    def capacity(self, longest, chunk, prompt=None):
        return bucket(longest)  # the rows of a grow group feed the same tokens: no chunk past

    def slot_refusal(self):
        if not self.one_padding:
            return ""
        return (
            "its grow cache is padded by one number of padding rows for the whole batch (the "
            f"padded rewrite's scalar input: {self.one_padding}), so rows cannot join at other "
            "lengths"
        )

    def resize(self, a, rows):
        return with_rows(a, rows, last=True)  # the valid rows come last

    def mask(self, lengths, step, rows, xp=np):
        columns = xp.arange(rows + step)[None, :]  # padding rows hidden, then valid rows, tokens
        return (columns >= (rows - lengths)[:, None]).astype(xp.int32)

    @property
    def shared(self):  # rows of different lengths share a cache where each has its padding
        return not self.one_padding

    def prompt_step(self, remaining, rule):
        return Mode.prompt_step(self, remaining, rule)  # its padding is dropped (real_input)

    def groups(self, lengths):
        return Mode.groups(self, lengths) if self.shared else super().groups(lengths)

    def write(self, layout, cache, outputs, lengths, rows_after, real=None):
        return write(layout, cache, outputs, padded_rows=rows_after, real=real)

    def real_input(self, real, step):
        real = np.asarray(real, np.int32)
        return real if (real < step).any() else None  # rows that end before the step's end

    def advance(self, lengths, real, step):
        return lengths + real  # a row's padding is dropped (or hidden: a row done)

    def rows_after(self, rows, step, capacity):
        return capacity

    def donated(self, cache_length, rows_after):
        return cache_length == rows_after  # not on the first step, nor when a bucket grows

    def room(self, size, capacity, longest):
        return min(size, capacity - longest)  # a bucket holds this many more tokens


class GrowBuckets(GrowPadded):
    """A padded grow cache that grows 64 rows at a time as it fills (two decode shapes per 64
    rows, fewer padding rows read)."""

    def slot_refusal(self):
        return (
            "its grow cache grows 64 rows at a time (grow_cache='buckets', generate()'s own "
            "policy), where the slots read windows of their own: compile with "
            "grow_cache='padded'"
        )

    def grown(self, capacity, length, step):
        return bucket(length + step)


def detect(model: Model) -> Mode:
    """The cache mode of a decoder, from its graph (a grow one keeps exact lengths until
    ``compile`` refines it).

    in_place: a GroupQueryAttention counts the valid rows from the values of attention_mask.
    append: the graph takes position_ids, and hidden rows after the valid ones change none of its
    attention masks (see :func:`~transmuter_jax.onnx.window.hidden_rows_matter`). grow: the
    positions come from the cache length, or a mask reads it (a sliding window).
    """
    nodes = [n for n in model.graph.proto.node if n.op_type == "GroupQueryAttention"]
    if nodes:
        sources = value_sources(model.graph)
        seqlens = nodes[0].input[5] if len(nodes[0].input) > 5 else ""
        if "attention_mask" in sources.get(seqlens, ()):
            return InPlace()
        return GrowExact()
    if any(i.name == "position_ids" for i in model.inputs):
        return GrowExact() if hidden_rows_matter(model) else Append()
    return GrowExact()


def mode(name: str, padded: bool = False, buckets: bool = False) -> Mode:
    """The cache mode object of a context's mode ``name``."""
    if name == "in_place":
        return InPlace()
    if name == "append":
        return Append()
    if name != "grow":
        raise GenerationError(f"unknown cache mode {name!r}")
    if not padded:
        return GrowExact()
    return GrowBuckets() if buckets else GrowPadded()


class State:
    """The cache of a group of rows on the device, and the count of valid tokens of each row.

    Attributes:
        arrays: the cache arrays by input name.
        lengths: [B] int32 valid cached tokens of each row.
        rows: rows of the self-attention cache arrays now.
        capacity: in grow on a padded cache, its rows after the next step; else None.
    """

    def __init__(self, mode: Mode, layout: CacheLayout, batch: int, rows: int, cross: int):
        self.mode = mode
        grow = isinstance(mode, GrowExact)
        self.rows = mode.start_rows(rows)
        self.capacity = rows if mode.padded else None
        # In grow the cross-attention cache is made by the first step; elsewhere it is a buffer.
        self.arrays = layout.empty(batch, self.rows, 0 if grow else cross)
        self.lengths = np.zeros(batch, np.int32)

    def mask(self, step: int) -> np.ndarray:
        """The attention mask of the next step of ``step`` tokens."""
        return self.mode.mask(self.lengths, step, self.rows)

    def advance(self, real: np.ndarray, step: int) -> None:
        """Counts the tokens a step cached: ``real`` [B] of each row, ``step`` in all."""
        self.lengths = self.mode.advance(self.lengths, real, step).astype(np.int32)
        self.rows = self.mode.rows_after(self.rows, step, self.capacity)


def cache_length(cache: dict[str, Any], layout: CacheLayout) -> int:
    """Rows of the self-attention cache arrays."""
    entry = next(e for e in layout.entries if not e.cross)
    return int(cache[entry.input].shape[SEQ])


def reorder_function(layout: CacheLayout, **jit_options: Any):
    """The jitted ``(arrays, order [B]) -> arrays`` that gives row i the cache of row order[i]
    (beam search): one gather per buffer, donated. Cross-attention caches, the same for all beams
    of a prompt, do not move."""

    def reorder(arrays, order):
        cross = {e.input for e in layout.entries if e.cross}
        return {k: v if k in cross else jnp.take(v, order, axis=0) for k, v in arrays.items()}

    key = ("reorder", layout)
    return AutoStoredJit(reorder, key, donate_argnums=(0,), **compiler.jit_options(jit_options))
