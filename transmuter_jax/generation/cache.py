"""The KV cache in its three modes. Every branch on the cache mode lives in this module.

- in_place: one buffer as long as the attention mask; GroupQueryAttention writes the new rows of
  each row after its valid rows (it reads their count from the sum of the mask).
- append: a buffer whose free rows the mask hides; the graph's present is the buffer plus the new
  rows, which this module writes into the buffer at each row's length.
- grow: the cache has its exact length (shared by all rows); the present is the next cache.
  Padded (when the decoder could be rewritten, see :mod:`transmuter_jax.onnx.rewrite`), it has a
  fixed number of rows whose valid ones come last: the present is the cache plus the new rows,
  and its last rows are the next cache.

Cache arrays are [batch, heads, length, head_size]: the sequence is axis 2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..onnx import compiler
from ..onnx.dtypes import device_dtype
from ..onnx.model import Model
from ..onnx.ops._util import write_rows

SEQ = 2  # the sequence axis of a cache array


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
    """The cache arrays of a decoder."""

    entries: tuple[CacheEntry, ...]

    def empty(self, batch: int, length: int, cross_length: int = 0) -> dict[str, jax.Array]:
        """Zero buffers: ``length`` rows (``cross_length`` for cross attention)."""
        return {
            e.input: jnp.zeros(
                (batch, e.heads, cross_length if e.cross else length, e.head_size), e.dtype
            )
            for e in self.entries
        }


def _config_dims(config: dict) -> tuple[int | None, int | None]:
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
    """The cache layout of ``model``: its past_key_values.* inputs and their present outputs."""
    outputs = {o.name for o in model.outputs}
    heads_default, size_default = _config_dims(config)
    entries = []
    for info in model.inputs:
        if not info.name.startswith(("past_key_values.", "past.")):
            continue
        suffix = info.name.split(".", 1)[1]
        output = f"present.{suffix}"
        if output not in outputs:
            raise ValueError(f"{model.path!r}: cache input {info.name!r} has no output {output!r}")
        shape = info.shape or (None,) * 4
        heads = shape[1] if isinstance(shape[1], int) else heads_default
        size = shape[3] if isinstance(shape[3], int) else size_default
        cross = ".encoder." in info.name
        if cross:  # cross attention has all the attention heads
            text = config.get("text_config", config)
            heads = shape[1] if isinstance(shape[1], int) else text.get("decoder_attention_heads")
        if not heads or not size:
            raise ValueError(f"cannot tell the heads and head size of {info.name!r} {shape}")
        dtype = device_dtype(np.dtype(info.dtype))
        entries.append(CacheEntry(info.name, output, int(heads), int(size), dtype, cross))
    return CacheLayout(tuple(entries))


def capacity(mode: str, longest: int, chunk: int, padded: bool = False) -> int:
    """Rows of the buffer for rows of at most ``longest`` tokens fed in chunks of up to ``chunk``.

    A row may take a chunk of padding after its last token, so the buffer has room for it; the
    length is rounded up to a multiple of 64 so that close workloads share compiled shapes.
    grow has no buffer (0) unless padded: then ``longest`` rounded up to a multiple of 64 (the
    rows of a grow group all feed the same tokens, so no chunk runs past ``longest``).
    """
    if mode == "grow":
        return bucket(longest) if padded else 0
    return bucket(longest + chunk)


def bucket(rows: int) -> int:
    """``rows`` rounded up to a multiple of 64 (the buffers' capacities and grow's buckets)."""
    return -(-rows // 64) * 64


def mask(
    mode: str, lengths: np.ndarray, step: int, cache_length: int, padded: bool = False
) -> np.ndarray:
    """The attention mask of a step of ``step`` tokens after ``lengths`` valid cached tokens.

    Args:
        mode: the cache mode.
        lengths: [B] valid cached tokens of each row.
        step: tokens of this step (padding included).
        cache_length: rows of the cache array (the buffer, or the exact length in grow).
        padded: grow on a padded cache, whose first ``cache_length - lengths`` rows are padding.
    """
    batch = len(lengths)
    if mode == "grow" and padded:  # [B, C + S]: padding rows hidden, then valid rows and tokens
        columns = np.arange(cache_length + step)[None, :]
        return (columns >= (cache_length - lengths)[:, None]).astype(np.int32)
    if mode == "in_place":  # [B, M]: the valid rows, then this step's tokens
        return (np.arange(cache_length)[None, :] < (lengths + step)[:, None]).astype(np.int32)
    if mode == "append":  # [B, C + S]: valid rows, free rows hidden, then this step's tokens
        past = np.arange(cache_length)[None, :] < lengths[:, None]
        return np.concatenate([past, np.ones((batch, step), bool)], axis=1).astype(np.int32)
    return np.ones((batch, cache_length + step), np.int32)  # grow


def advance(
    mode: str,
    layout: CacheLayout,
    cache: dict[str, jax.Array],
    outputs: dict[str, jax.Array],
    lengths: jax.Array,
    padded_rows: int | None = None,
) -> dict[str, jax.Array]:
    """The cache after a step (traced in the step): from the graph's presents.

    Args:
        lengths: [B] int32 valid cached tokens of each row before the step (append writes the new
            rows there).
        padded_rows: in grow on a padded cache, its rows: the last ``padded_rows`` of the
            present, after zero rows when the present is shorter.
    """
    new = {}
    for entry in layout.entries:
        present = outputs[entry.output]
        if padded_rows is not None and not entry.cross:
            have = present.shape[SEQ]
            if have >= padded_rows:
                kept = jax.lax.slice_in_dim(present, have - padded_rows, have, axis=SEQ)
            else:
                widths = [(0, 0)] * present.ndim
                widths[SEQ] = (padded_rows - have, 0)
                kept = jnp.pad(present, widths)
            new[entry.input] = kept.astype(entry.dtype)
            continue
        if entry.cross or mode != "append":
            # A cross-attention present is empty on the steps that reuse the cache.
            keep = entry.cross and present.size == 0
            new[entry.input] = cache[entry.input] if keep else present.astype(entry.dtype)
            continue
        past = cache[entry.input]
        rows = jax.lax.slice_in_dim(present, past.shape[SEQ], present.shape[SEQ], axis=SEQ)

        new[entry.input] = write_rows(past, rows, lengths, axis=SEQ)
    return new


def shared_by_all_rows(mode: str) -> bool:
    """Whether rows with prompts of different lengths can share one cache (not in grow)."""
    return mode != "grow"


def donated(mode: str, padded: bool = False) -> bool:
    """Whether a step can update the cache buffers in place (not in grow, where they grow, unless
    padded)."""
    return mode != "grow" or padded


class State:
    """The cache of a group of rows on the device, and the count of valid tokens of each row.

    Attributes:
        rows: rows of the cache arrays now.
        capacity: in grow on a padded cache, its rows after the first step; else None.
    """

    def __init__(
        self,
        mode: str,
        layout: CacheLayout,
        batch: int,
        rows: int,
        cross: int,
        padded: bool = False,
    ):
        self.mode = mode
        self.rows = rows if mode != "grow" else 0
        self.capacity = rows if mode == "grow" and padded else None
        # In grow the cross-attention cache is made by the first step; elsewhere it is a buffer.
        self.arrays = layout.empty(batch, self.rows, cross if mode != "grow" else 0)
        self.lengths = np.zeros(batch, np.int32)  # valid cached tokens of each row

    def mask(self, step: int) -> np.ndarray:
        """The attention mask of the next step of ``step`` tokens."""
        return mask(self.mode, self.lengths, step, self.rows, self.capacity is not None)

    def advance(self, real: np.ndarray, step: int) -> None:
        """Counts the tokens a step cached: ``real`` [B] of each row, ``step`` in all."""
        if self.mode == "grow":  # every row's cache holds the whole step
            self.lengths = self.lengths + step
            self.rows = self.capacity if self.capacity is not None else self.rows + step
        else:  # padding tokens after a row's real ones are overwritten by its next step
            self.lengths = self.lengths + real


def branch(mode: str, cache_length: int) -> bool:
    """The value of use_cache_branch: whether the cache holds tokens (grow) or is a buffer."""
    return mode != "grow" or cache_length > 0


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

    return jax.jit(reorder, donate_argnums=(0,), **compiler.jit_options(jit_options))
