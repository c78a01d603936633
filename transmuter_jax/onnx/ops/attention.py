"""com.microsoft attention and fused ops: GroupQueryAttention, SparseAttention,
MultiHeadAttention, DecoderMaskedMultiHeadAttention, Attention, RotaryEmbedding, the skip and
embedding layer norms, the GELU variants, BiasAdd and FusedMatMul. The attention math itself is
in :mod:`.attention_core`."""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ... import kernels
from .. import provenance
from ..registry import op
from ._util import precision, write_rows, xp
from .attention_core import (
    NO_LIMIT,
    cap,
    grouped_scores,
    grouped_values,
    masked_softmax,
    merge_heads,
    rotate_at,
    split_heads,
    visible,
)

MS = "com.microsoft"


# ---------------------------------------------------------------- GroupQueryAttention


@op("GroupQueryAttention", domain=MS, static=(6,))
def GroupQueryAttention(
    query,
    key=None,
    value=None,
    past_key=None,
    past_value=None,
    seqlens_k=None,
    total_sequence_length=None,
    cos_cache=None,
    sin_cache=None,
    position_ids=None,
    attention_bias=None,
    head_sink=None,
    k_scale=None,
    v_scale=None,
    q_norm_weight=None,
    k_norm_weight=None,
    query_seqlens=None,
    *,
    num_heads,
    kv_num_heads,
    scale=0.0,
    softcap=0.0,
    local_window_size=-1,
    do_rotary=0,
    rotary_interleaved=0,
    smooth_softmax=-1,
    qk_output=0,
    causal=1,
    sliding_window_cache=0,
    k_quant_type="NONE",
    v_quant_type="NONE",
    kv_cache_bit_width=0,
    qk_norm_epsilon=1e-6,
    q_norm_epsilon=None,
    k_norm_epsilon=None,
    ctx,
):
    """Grouped-query attention over a right-padded KV cache (BNSH), as onnxruntime's CPU kernel.

    Batch row b holds T = seqlens_k[b] + 1 tokens after the step; its Q = min(S, T) new tokens
    (or query_seqlens[b]) go to cache rows [P, P + S) with P = T - Q, at positions P + s.
    """
    _gqa_validate(k_scale, v_scale, k_quant_type, v_quant_type, q_norm_weight, k_norm_weight)
    if sliding_window_cache:
        raise NotImplementedError("GroupQueryAttention with sliding_window_cache=1")
    query = jnp.asarray(query)
    total_len = int(np.asarray(total_sequence_length).reshape(-1)[0])
    steps = _gqa_rows(seqlens_k, query_seqlens, query.shape[0], query.shape[1])
    first = query_seqlens is None and query.shape[1] == total_len  # a first prompt
    # A first prompt (total_sequence_length is the step's length: every row's past is 0) in a
    # buffer no longer than the step: no old row is valid, so none is read.
    fresh = first and (past_key is None or past_key.shape[2] <= total_len)
    sink = _gqa_sink(head_sink, smooth_softmax, num_heads)
    heads = num_heads + 2 * kv_num_heads if key is None else num_heads  # in query's last axis
    scale = scale or 1.0 / math.sqrt(query.shape[-1] // heads)
    window = local_window_size if causal else 0
    plain = attention_bias is None and ctx.num_outputs <= 3 and not softcap and sink is None
    if plain and key is None and past_key is not None and past_value is not None and not fresh:
        rotary = (cos_cache, sin_cache, position_ids, rotary_interleaved) if do_rotary else None
        step = _gqa_step(query, past_key, past_value, steps, total_len, first, rotary, num_heads,
                         kv_num_heads, scale, causal, window)  # fmt: skip
        if step is not None:
            return step[: max(ctx.num_outputs, 1)]
    q, k, v = _split_qkv(query, key, value, num_heads, kv_num_heads)  # [B, S, N|Nk, H]
    if do_rotary:
        rot = _gqa_rotary_positions(steps.pos, position_ids, first)
        q = rotate_at(q, rot, cos_cache, sin_cache, rotary_interleaved)
        k = rotate_at(k, rot, cos_cache, sin_cache, rotary_interleaved)
    cache = _gqa_write(past_key, past_value, k, v, steps.past, total_len, fresh)
    if attention_bias is None and ctx.num_outputs <= 3 and fresh:
        attend = partial(_gqa_attend_new, q, cache, steps)
    elif attention_bias is None and ctx.num_outputs <= 3:
        attend = partial(_gqa_attend_split, q, cache, steps)
    else:
        attend = partial(_gqa_attend_buffer, q, cache, steps, bias=attention_bias)
    scores, probs, out = attend(scale, softcap, causal, window, sink)
    outs = (merge_heads(out).astype(query.dtype), cache.present_k, cache.present_v)
    if ctx.num_outputs > 3:
        outs += ((scores if qk_output == 1 else probs).astype(query.dtype),)
    return outs[: max(ctx.num_outputs, 1)]


def _gqa_step(
    query, past_key, past_value, steps, total_len, first, rotary, n, nk, scale, causal, window
):
    """The step in one kernel call (:func:`kernels.attention_step`: the rotation, the attention
    over the buffer's valid rows and the step's, the buffer's write in place) where it runs it:
    packed QKV over a buffer that holds the step (not a first prompt in its own buffer), which
    the path below writes and reads alike; else None."""
    if query.ndim != 3:
        return None
    b, s, width = query.shape
    past_key, past_value = jnp.asarray(past_key), jnp.asarray(past_value)
    if width % (n + 2 * nk) or past_key.ndim != 4 or past_key.shape[2] < max(total_len, s):
        return None
    h = width // (n + 2 * nk)
    turn = None
    if rotary is not None:
        cos, sin, position_ids, interleaved = rotary
        positions = _gqa_rotary_positions(steps.pos, position_ids, first)
        turn = (jnp.asarray(cos), jnp.asarray(sin), positions, bool(interleaved))
    qkv = query.reshape(b, s, n + 2 * nk, h)
    old = (past_key, past_value, steps.past)
    done = kernels.attention_step(
        qkv, steps.total, old, heads=n, scale=scale, causal=causal, window=window, rotary=turn
    )
    if done is None:
        return None
    out, present_k, present_v = done
    return merge_heads(out).astype(query.dtype), present_k, present_v


def _gqa_validate(k_scale, v_scale, k_quant_type, v_quant_type, q_norm_weight, k_norm_weight):
    """Refuses what is not implemented: a quantized KV cache, q/k norms."""
    quantized = k_scale is not None or v_scale is not None
    if quantized or k_quant_type != "NONE" or v_quant_type != "NONE":
        raise NotImplementedError("GroupQueryAttention with a quantized KV cache")
    if q_norm_weight is not None or k_norm_weight is not None:
        raise NotImplementedError("GroupQueryAttention with q_norm_weight/k_norm_weight")


class _Steps(NamedTuple):
    """Where this step's tokens go in each batch row."""

    total: jax.Array  # [B] valid rows after the step
    past: jax.Array  # [B] valid rows before the step (where the new rows are written)
    pos: jax.Array  # [B, S] positions of the new tokens


def _gqa_steps(seqlens_k, query_seqlens, b, s) -> _Steps:
    total = jnp.asarray(seqlens_k).astype(jnp.int32).reshape(b) + 1
    if query_seqlens is None:
        new = jnp.minimum(total, s)
    else:
        new = jnp.asarray(query_seqlens).astype(jnp.int32).reshape(b)
    past = total - new
    return _Steps(total, past, past[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :])


def _gqa_rows(seqlens_k, query_seqlens, b, s) -> _Steps:
    """:func:`_gqa_steps`, computed once a run for every layer reading the same seqlens_k."""
    if query_seqlens is not None:
        return _gqa_steps(seqlens_k, query_seqlens, b, s)
    make = partial(_gqa_steps, seqlens_k, None, b, s)
    return provenance.derived(seqlens_k, f"GroupQueryAttention rows {b} {s}", make)


def _gqa_rotary_positions(pos, position_ids, first):
    """Rotary positions [B, S]: pos, or position_ids; a first prompt reads only
    position_ids[0, 0] and counts on from it in every row (as onnxruntime does)."""
    if position_ids is None:
        return pos
    ids = jnp.asarray(position_ids).astype(jnp.int32).reshape(pos.shape)
    if first:
        return ids[0, 0] + jnp.broadcast_to(jnp.arange(pos.shape[1], dtype=jnp.int32), pos.shape)
    return ids


class _Cache(NamedTuple):
    """The KV buffers of one step, all BNSH: before the write, this step's rows, after it."""

    old_k: jax.Array  # [B, Nk, L, H]
    old_v: jax.Array
    new_k: jax.Array  # [B, Nk, S, H]
    new_v: jax.Array
    present_k: jax.Array  # [B, Nk, L, H]
    present_v: jax.Array


def _gqa_write(past_key, past_value, k, v, past, total_len, fresh=False) -> _Cache:
    """Writes this step's keys and values at rows ``past[b]``, one slice update per row
    (``fresh``: every ``past[b]`` is 0 and the buffer is no longer than the step: the present
    is the step's rows)."""
    b, s, nk, h = k.shape
    buffer = 0 if past_key is None else past_key.shape[2]
    length = max(buffer, total_len, s)
    old_k = _cache(past_key, b, nk, length, h, k.dtype)
    old_v = _cache(past_value, b, nk, length, h, v.dtype)
    new_k, new_v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if fresh:  # length == s: the buffer and total_sequence_length are at most the step
        return _Cache(old_k, old_v, new_k, new_v, new_k, new_v)
    present_k = write_rows(old_k, new_k, past, axis=2)
    present_v = write_rows(old_v, new_v, past, axis=2)
    return _Cache(old_k, old_v, new_k, new_v, present_k, present_v)


def _gqa_sink(head_sink, smooth_softmax, n):
    """The logit of the value-less extra key per head, or None."""
    if head_sink is not None:
        return jnp.asarray(head_sink).astype(jnp.float32).reshape(1, n, 1, 1)
    if smooth_softmax == 1:
        return jnp.zeros((1, 1, 1, 1), jnp.float32)
    return None


def _gqa_mask(steps: _Steps, k_pos, valid, causal, window):
    """[B, 1, S, L] keys seen: valid, causal, and inside the window (counting the query)."""
    q_pos = steps.pos if causal else jnp.full_like(steps.pos, NO_LIMIT)
    mask = visible(q_pos, k_pos, left=window - 1 if window > 0 else -1)
    return (mask & valid[:, None, :])[:, None]


def _gqa_attend_split(q, cache: _Cache, steps: _Steps, scale, softcap, causal, window, sink):
    """Attends over the valid old rows, then this step's rows: the keys the written buffer
    holds, read without the buffer's update (which XLA would otherwise copy). On the CPU
    kernels (no softcap, no sink) one call computes it, and the scores and probabilities are not
    kept."""
    if not softcap and sink is None:
        old = (cache.old_k, cache.old_v, steps.past)
        out = kernels.attention(
            q, cache.new_k, cache.new_v, steps.total, scale=scale, causal=causal, window=window,
            old=old,
        )  # fmt: skip
        if out is not None:
            return None, None, out
    b, length = cache.old_k.shape[0], cache.old_k.shape[2]
    scores = jnp.concatenate(
        [grouped_scores(q, cache.old_k, scale), grouped_scores(q, cache.new_k, scale)], axis=-1
    )  # [B, N, S, L + S]
    scores = cap(scores, softcap)
    rows = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, L]
    k_pos = jnp.concatenate([jnp.broadcast_to(rows, (b, length)), steps.pos], axis=1)
    valid = jnp.concatenate([rows < steps.past[:, None], steps.pos < steps.total[:, None]], 1)
    mask = _gqa_mask(steps, k_pos, valid, causal, window)
    probs = masked_softmax(scores, mask, sink)
    out = grouped_values(probs[..., :length], cache.old_v)
    out = out + grouped_values(probs[..., length:], cache.new_v)  # [B, S, N, H]
    return scores, probs, out


def _gqa_attend_new(q, cache: _Cache, steps: _Steps, scale, softcap, causal, window, sink):
    """Attends over this step's rows alone (a first prompt: no old row is valid), as
    :func:`_gqa_attend_split` does less its old rows, which weigh 0 there. On the CPU kernels
    (no softcap, no sink) one call computes it, and the scores and probabilities are not kept."""
    if not softcap and sink is None:
        out = kernels.attention(
            q, cache.new_k, cache.new_v, steps.total, scale=scale, causal=causal, window=window
        )
        if out is not None:
            return None, None, out
    scores = cap(grouped_scores(q, cache.new_k, scale), softcap)  # [B, N, S, S]
    valid = steps.pos < steps.total[:, None]
    mask = _gqa_mask(steps, steps.pos, valid, causal, window)
    probs = masked_softmax(scores, mask, sink)
    return scores, probs, grouped_values(probs, cache.new_v)


def _gqa_attend_buffer(q, cache: _Cache, steps, scale, softcap, causal, window, sink, *, bias):
    """Attends over the written buffer, with the additive attention_bias [.., S, T]."""
    length = cache.present_k.shape[2]
    scores = grouped_scores(q, cache.present_k, scale)  # [B, N, S, L]
    if bias is not None:
        scores = scores + _fit_keys(jnp.asarray(bias).astype(jnp.float32), length)
    scores = cap(scores, softcap)
    rows = jnp.arange(length, dtype=jnp.int32)[None, :]
    mask = _gqa_mask(steps, rows, rows < steps.total[:, None], causal, window)
    probs = masked_softmax(scores, mask, sink)
    return scores, probs, grouped_values(probs, cache.present_v)


def _split_qkv(query, key, value, n, nk):
    """q: [B, S, N, H], k, v: [B, S, Nk, H] from separate or packed ([B, S, (N + 2 Nk) H]) QKV."""
    if key is None:
        h = query.shape[-1] // (n + 2 * nk)
        q = query[..., : n * h]
        key = query[..., n * h : (n + nk) * h]
        value = query[..., (n + nk) * h :]
    else:
        q = query
    return split_heads(q, n), split_heads(jnp.asarray(key), nk), split_heads(jnp.asarray(value), nk)


def _cache(past, b, heads, length, h, dtype):
    """The past buffer [B, Nk, P, H] zero-padded to [B, Nk, length, H] (zeros if absent)."""
    if past is None:
        return jnp.zeros((b, heads, length, h), dtype)
    past = jnp.asarray(past)
    if past.shape[2] == length:
        return past
    return jnp.pad(past, ((0, 0), (0, 0), (0, length - past.shape[2]), (0, 0)))


def _fit_keys(bias, length):
    """bias [..., T] cut or zero-padded to [..., length] along the key axis."""
    have = bias.shape[-1]
    if have >= length:
        return bias[..., :length]
    pad = [(0, 0)] * (bias.ndim - 1) + [(0, length - have)]
    return jnp.pad(bias, pad)


# ---------------------------------------------------------------- SparseAttention


@op("SparseAttention", domain=MS, static=(7,))
def SparseAttention(
    query,
    key,
    value,
    past_key,
    past_value,
    block_row_indices,
    block_col_indices,
    total_sequence_length,
    key_total_sequence_lengths,
    cos_cache=None,
    sin_cache=None,
    *,
    num_heads,
    kv_num_heads,
    sparse_block_size,
    do_rotary=0,
    rotary_interleaved=0,
    scale=0.0,
):
    """Phi-3-small's block-sparse causal attention over a KV buffer shared by past and present
    (as GroupQueryAttention's): query block r of head h sees key block c where the CSR block
    mask of layout h % layouts has (r, c)."""
    query = jnp.asarray(query)
    q, k, v = _split_qkv(query, key, value, num_heads, kv_num_heads)
    total = jnp.asarray(key_total_sequence_lengths).astype(jnp.int32) - 1
    steps = _gqa_steps(total, None, query.shape[0], query.shape[1])
    if do_rotary:
        q = rotate_at(q, steps.pos, cos_cache, sin_cache, rotary_interleaved)
        k = rotate_at(k, steps.pos, cos_cache, sin_cache, rotary_interleaved)
    total_len = int(np.asarray(total_sequence_length).reshape(-1)[0])
    cache = _gqa_write(past_key, past_value, k, v, steps.past, total_len)
    length = cache.present_k.shape[2]
    rows = jnp.arange(length, dtype=jnp.int32)
    mask = _gqa_mask(steps, rows[None, :], rows[None, :] < steps.total[:, None], True, 0)
    blocks = _block_mask(block_row_indices, block_col_indices)  # [layouts, R, C]
    heads = jnp.arange(num_heads) % blocks.shape[0]
    q_block = jnp.minimum(steps.pos // sparse_block_size, blocks.shape[1] - 1)  # [B, S]
    k_block = jnp.minimum(rows // sparse_block_size, blocks.shape[2] - 1)  # [L]
    allowed = blocks[heads[None, :, None, None], q_block[:, None, :, None], k_block]
    scores = grouped_scores(q, cache.present_k, scale or 1.0 / math.sqrt(q.shape[-1]))
    probs = masked_softmax(scores, mask & allowed)
    out = merge_heads(grouped_values(probs, cache.present_v)).astype(query.dtype)
    return out, cache.present_k, cache.present_v


def _block_mask(row_indices, col_indices):
    """The dense block mask [layouts, R, C] bool of its CSR rows [layouts, R + 1] and columns
    [layouts, nnz] (padded with -1)."""
    rows = jnp.asarray(row_indices).astype(jnp.int32)
    cols = jnp.asarray(col_indices).astype(jnp.int32)
    layouts, r = rows.shape[0], rows.shape[1] - 1
    k = jnp.arange(cols.shape[1])
    row_of = jax.vmap(lambda ptr: jnp.searchsorted(ptr, k, side="right") - 1)(rows)  # [L, nnz]
    valid = (k[None, :] < rows[:, -1:]) & (cols >= 0)
    layout = jnp.broadcast_to(jnp.arange(layouts)[:, None], cols.shape)
    dense = jnp.zeros((layouts, r, r), jnp.int32)
    at = (layout, jnp.clip(row_of, 0, r - 1), jnp.clip(cols, 0, r - 1))
    return dense.at[at].max(valid.astype(jnp.int32)) > 0


# ---------------------------------------------------------------- MultiHeadAttention


@op("MultiHeadAttention", domain=MS)
def MultiHeadAttention(
    query,
    key=None,
    value=None,
    bias=None,
    key_padding_mask=None,
    attention_bias=None,
    past_key=None,
    past_value=None,
    past_sequence_length=None,
    cache_indirection=None,
    *,
    num_heads,
    scale=0.0,
    mask_filter_value=-10000.0,
    unidirectional=0,
    ctx,
):
    """Multi-head self/cross attention with optional input bias, padding mask and KV cache."""
    if past_sequence_length is not None or cache_indirection is not None:
        raise NotImplementedError(
            "MultiHeadAttention with a shared KV buffer (past_sequence_length)"
        )
    n = num_heads
    q, k, v, kv_ready = _mha_inputs(jnp.asarray(query), key, value, bias, n)
    b, s, _, h = q.shape
    new_len = k.shape[2]
    if not kv_ready and past_key is not None:  # append the new keys to the cache
        k = jnp.concatenate([jnp.asarray(past_key), k], axis=2)
        v = jnp.concatenate([jnp.asarray(past_value), v], axis=2)
    length = k.shape[2]  # k, v: [B, N, L, H]
    past = length - new_len
    scores = grouped_scores(q, k, scale or 1.0 / math.sqrt(h))  # [B, N, S, L]
    keep = _padding_mask(key_padding_mask, b, s, length)  # [B, 1|S, L] or None
    if unidirectional:
        causal = jnp.arange(length)[None, :] <= (past + jnp.arange(s))[:, None]  # [S, L]
        keep = causal[None] if keep is None else keep & causal[None]
    if keep is not None:
        scores = scores + jnp.where(keep, 0.0, mask_filter_value)[:, None]
    if attention_bias is not None:
        scores = scores + jnp.asarray(attention_bias).astype(jnp.float32)
    probs = masked_softmax(scores)
    out = merge_heads(grouped_values(probs, v)).astype(q.dtype)
    return (out, k, v, probs.astype(q.dtype))[: max(ctx.num_outputs, 1)]


def _mha_inputs(query, key, value, bias, n):
    """q: [B, S, N, H] and k, v: [B, N, L, H]; kv_ready when key/value were given as BNSH."""
    if query.ndim == 5:  # packed QKV: [B, S, N, 3, H]
        q, k, v = query[:, :, :, 0], query[:, :, :, 1], query[:, :, :, 2]
        q, k, v = _add_bias(q, k, v, bias)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), False
    q = split_heads(query, n)
    key = jnp.asarray(key)
    if key.ndim == 5:  # packed KV: [B, L, N, 2, H]
        k, v = key[:, :, :, 0], key[:, :, :, 1]
        q, k, v = _add_bias(q, k, v, bias)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), False
    if key.ndim == 4:  # key/value already [B, N, L, H] (cross attention with cached keys)
        if bias is not None:
            hidden = q.shape[2] * q.shape[3]
            q = q + jnp.reshape(jnp.asarray(bias)[:hidden], q.shape[2:])
        return q, key, jnp.asarray(value), True
    value = jnp.asarray(value)
    k, v = split_heads(key, n), split_heads(value, n)
    q, k, v = _add_bias(q, k, v, bias)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), False


def _add_bias(q, k, v, bias):
    """Adds the packed bias [N*H + N*H + N*Hv] to q, k, v: [B, S, N, H]."""
    if bias is None:
        return q, k, v
    bias = jnp.asarray(bias)
    nq, nk = q.shape[2] * q.shape[3], k.shape[2] * k.shape[3]
    q = q + bias[:nq].reshape(q.shape[2:])
    k = k + bias[nq : nq + nk].reshape(k.shape[2:])
    v = v + bias[nq + nk :].reshape(v.shape[2:])
    return q, k, v


def _padding_mask(mask, b, s, length):
    """key_padding_mask as keep flags [B, 1|S, L]: lengths (B), 0/1 of (B, L) or (B, S, L)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.ndim == 1:  # valid key counts (right padding)
        return (jnp.arange(length)[None, :] < mask[:, None])[:, None, :]
    if mask.ndim == 2:
        return (mask != 0)[:, None, -length:]
    return (mask != 0)[:, :, -length:]


# ---------------------------------------------------------------- DecoderMaskedMultiHeadAttention


@op("DecoderMaskedMultiHeadAttention", domain=MS)
def DecoderMaskedMultiHeadAttention(
    query,
    key=None,
    value=None,
    mask_index=None,
    attention_bias=None,
    past_key=None,
    past_value=None,
    past_sequence_length=None,
    beam_width=None,
    cache_indirection=None,
    bias=None,
    *,
    num_heads,
    mask_filter_value=-10000.0,
    output_qk=0,
    past_present_share_buffer=0,
    scale=0.0,
    ctx,
):
    """One decoding step of self attention (the new key/value appended to past_key/past_value,
    or written at row past_sequence_length of a shared buffer) or of cross attention (key and
    value given as [B, N, L, H]); with beam search, cache_indirection [B, beams, max] names the
    beam each past key and value is read from. Outputs (out, present_key, present_value, qk);
    with a shared buffer qk covers the attended keys only when past_sequence_length is known at
    trace time (else the whole buffer)."""
    n = num_heads
    query = jnp.asarray(query)
    cross = key is not None and jnp.ndim(key) == 4
    q, k, v = _dmmha_inputs(query, key, value, bias, n, cross)  # q: [B, 1, N, H]
    if cross:
        keys, values, valid, present = jnp.asarray(key), jnp.asarray(value), None, ()
    else:
        keys, values, valid = _dmmha_cache(
            past_key, past_value, k, v, past_sequence_length, past_present_share_buffer
        )
        present = (keys, values)
        if cache_indirection is not None:
            keys, values = _beam_gather(keys, values, cache_indirection, valid)
    scores = grouped_scores(q, keys, scale or 1.0 / math.sqrt(q.shape[-1]))  # [B, N, 1, T]
    total = keys.shape[2]
    if mask_index is not None:
        # [B, T'] 0/1 over the attended keys; a shared buffer's rows after them are invalid.
        keep = _fit_keys(jnp.asarray(mask_index) != 0, total)[:, None, None, :]
        if keep.shape[-1] > jnp.shape(mask_index)[-1]:
            keep = keep | (jnp.arange(total) >= jnp.shape(mask_index)[-1])
        scores = scores + jnp.where(keep, 0.0, jnp.float32(mask_filter_value))
    if attention_bias is not None:
        scores = scores + jnp.asarray(attention_bias).astype(jnp.float32)
    probs = masked_softmax(scores, None if valid is None else valid[:, None, None, :])
    out = merge_heads(grouped_values(probs, values)).astype(query.dtype)
    outs = (out, *present) if present else (out, None, None)
    if ctx.num_outputs > 3:
        qk = (scores if output_qk else probs).astype(query.dtype)
        if past_present_share_buffer and isinstance(past_sequence_length, np.ndarray):
            qk = qk[..., : int(past_sequence_length.reshape(-1)[0]) + 1]  # the attended keys
        outs += (qk,)
    return outs[: max(ctx.num_outputs, 1)]


def _dmmha_inputs(query, key, value, bias, n, cross):
    """q: [B, 1, N, H] and the new k, v: [B, N, 1, H] (None for cross attention), biased."""
    if key is None:  # packed QKV
        h = query.shape[-1] // 3
        query, key, value = query[..., :h], query[..., h : 2 * h], query[..., 2 * h :]
    q = split_heads(query, n)
    if cross:
        if bias is not None:
            q = q + jnp.asarray(bias)[: q.shape[2] * q.shape[3]].reshape(q.shape[2:])
        return q, None, None
    k, v = split_heads(jnp.asarray(key), n), split_heads(jnp.asarray(value), n)
    q, k, v = _add_bias(q, k, v, bias)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _dmmha_cache(past_key, past_value, k, v, past_len, shared):
    """(present_key, present_value, valid rows [B, T] or None): the step's row appended, or
    written at row past_len of the shared buffer (rows after it are not attended)."""
    if not shared:
        if past_key is None:
            return k, v, None
        keys = jnp.concatenate([jnp.asarray(past_key), k.astype(past_key.dtype)], axis=2)
        values = jnp.concatenate([jnp.asarray(past_value), v.astype(past_value.dtype)], axis=2)
        return keys, values, None
    b = k.shape[0]
    at = jnp.broadcast_to(jnp.asarray(past_len).astype(jnp.int32).reshape(-1)[:1], (b,))
    keys = write_rows(jnp.asarray(past_key), k, at, axis=2)
    values = write_rows(jnp.asarray(past_value), v, at, axis=2)
    rows = jnp.arange(keys.shape[2], dtype=jnp.int32)[None, :]
    return keys, values, rows <= at[:, None]


def _beam_gather(keys, values, cache_indirection, valid):
    """The keys and values each beam reads: row t of beam j of batch entry i comes from beam
    cache_indirection[i, j, t] (its own row for the step's token)."""
    rows, _, total, _ = keys.shape
    ind = jnp.asarray(cache_indirection).astype(jnp.int32)  # [B, beams, max]
    beams = ind.shape[1]
    ind = ind.reshape(rows, -1)[:, :total]  # [R, T]
    step = jnp.sum(valid, axis=1, keepdims=True) - 1 if valid is not None else total - 1
    own = jnp.arange(rows)[:, None] % beams
    src = jnp.arange(rows)[:, None] // beams * beams + jnp.where(
        jnp.arange(total)[None, :] == step, own, ind
    )  # [R, T]
    t = jnp.arange(total)[None, :]
    gather = lambda x: jnp.swapaxes(jnp.swapaxes(x, 1, 2)[src, t], 1, 2)  # noqa: E731
    return gather(keys), gather(values)


# ---------------------------------------------------------------- Attention (com.microsoft)


@op("Attention", domain=MS)
def Attention(
    input,
    weights,
    bias=None,
    mask_index=None,
    past=None,
    attention_bias=None,
    past_sequence_length=None,
    *,
    num_heads,
    qkv_hidden_sizes=(),
    unidirectional=0,
    do_rotary=0,
    mask_filter_value=-10000.0,
    past_present_share_buffer=0,
    rotary_embedding_dim=0,
    scale=0.0,
    ctx,
):
    """Multi-head attention of input [B, S, D] with one packed QKV projection weights [D, Q+K+V]
    (split by ``qkv_hidden_sizes``, else in thirds), a mask and a KV cache past/present
    [2, B, N, P, H]. Masked keys score ``mask_filter_value`` (not -inf), as onnxruntime's."""
    if do_rotary or past_present_share_buffer or past_sequence_length is not None:
        raise NotImplementedError(
            "com.microsoft Attention with do_rotary or a shared past/present buffer"
        )
    x = jnp.asarray(input)
    qkv = jnp.matmul(x, jnp.asarray(weights), precision=precision())
    if bias is not None:
        qkv = qkv + bias
    sizes = list(qkv_hidden_sizes) or [qkv.shape[-1] // 3] * 3
    q, k, v = jnp.split(qkv, np.cumsum(sizes)[:2], axis=-1)
    n = num_heads
    q, k, v = split_heads(q, n), split_heads(k, n), split_heads(v, n)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, N, S, H]
    past_len = 0
    if past is not None:
        past = jnp.asarray(past).astype(k.dtype)  # [2, B, N, P, H]
        past_len = past.shape[3]
        k, v = jnp.concatenate([past[0], k], axis=2), jnp.concatenate([past[1], v], axis=2)
    b, s = x.shape[:2]
    total = k.shape[2]
    scores = grouped_scores(q, k, scale or 1.0 / math.sqrt(q.shape[-1]))  # [B, N, S, T]
    filler = jnp.float32(mask_filter_value)
    keep = _mask_index_keep(mask_index, b, s, past_len, total)  # [B, 1|S, T] or None
    if keep is not None:
        scores = scores + jnp.where(keep, 0.0, filler)[:, None]
    if unidirectional:
        causal = visible(past_len + jnp.arange(s), jnp.arange(total))  # [S, T]
        scores = scores + jnp.where(causal, 0.0, filler)
    if attention_bias is not None:
        scores = scores + jnp.asarray(attention_bias).astype(jnp.float32)
    out = merge_heads(grouped_values(masked_softmax(scores), v)).astype(x.dtype)
    return (out, jnp.stack([k, v])) if ctx.num_outputs > 1 else out


def _mask_index_keep(mask, b, s, past_len, total):
    """Attention's mask_index as keep flags [B, 1|S, T]: key counts [B] (right padding), end and
    start positions [2B], 0/1 masks [B, T] or [B, S, T], or a 4-D [B, 1, M, M] causal mask."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    j = jnp.arange(total)[None, :]
    if mask.ndim == 1 and mask.shape[0] == 2 * b:
        end, start = mask[:b, None], mask[b:, None]
        return ((j < end) & (j >= start))[:, None, :]
    if mask.ndim == 1:
        return (j < mask[:, None])[:, None, :]
    if mask.ndim == 2:
        return (mask != 0)[:, None, -total:]
    if mask.ndim == 3:
        return (mask != 0)[:, :, -total:]
    return mask[:, 0, past_len : past_len + s, :total] != 0


# ---------------------------------------------------------------- RotaryEmbedding


@op("RotaryEmbedding", domain=MS)
def RotaryEmbedding(
    input,
    position_ids,
    cos_cache,
    sin_cache,
    *,
    interleaved=0,
    num_heads=0,
    rotary_embedding_dim=0,
    is_packed_batching=0,
    scale=1.0,
):
    """Rotary embedding of input [B, S, N*H] or [B, N, S, H] at position_ids [B, S] (or an
    offset of shape [1])."""
    x = jnp.asarray(input)
    half = rotary_embedding_dim // 2 if rotary_embedding_dim else cos_cache.shape[-1]
    if x.ndim == 4:  # [B, N, S, H]
        b, _, s, h = x.shape
        bsnh = x.transpose(0, 2, 1, 3)
    else:  # [B, S, N*H]
        b, s, d = x.shape
        h = d // num_heads if num_heads else 2 * cos_cache.shape[-1]
        bsnh = x.reshape(b, s, d // h, h)
    pos = _positions(position_ids, b, s)
    cos = jnp.asarray(cos_cache)[:, :half]
    sin = jnp.asarray(sin_cache)[:, :half]
    out = rotate_at(bsnh, pos, cos, sin, interleaved)
    if x.ndim == 4:
        return out.transpose(0, 2, 1, 3)
    return out.reshape(x.shape)


def _positions(position_ids, b, s):
    """Positions [B, S] from position_ids [B, S], or an offset [1] plus 0..S-1."""
    pos = jnp.asarray(position_ids).astype(jnp.int32)
    if pos.size == 1:
        return jnp.broadcast_to(pos.reshape(1, 1) + jnp.arange(s, dtype=jnp.int32), (b, s))
    return pos.reshape(b, s)


# ---------------------------------------------------------------- layer norms


def _skip_sum(input, skip, bias):
    total = input + skip
    return total if bias is None else total + bias


@op("SkipLayerNormalization", domain=MS)
def SkipLayerNormalization(input, skip, gamma, beta=None, bias=None, *, epsilon=1e-12, ctx):
    """LayerNorm(input + skip + bias) * gamma + beta; outputs (y, mean, inv_std, sum)."""
    total = _skip_sum(input, skip, bias)
    x = total.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + epsilon)
    y = (x - mean) * inv * gamma
    if beta is not None:
        y = y + beta
    return _norm_outputs(y.astype(total.dtype), mean, inv, total, ctx.num_outputs)


@op("SkipSimplifiedLayerNormalization", domain=MS)
def SkipSimplifiedLayerNormalization(input, skip, gamma, bias=None, *, epsilon=1e-12, ctx):
    """RMSNorm(input + skip + bias) * gamma; outputs (y, mean, inv_std, sum)."""
    floats = all(jnp.result_type(a) == jnp.float32 for a in (input, skip))
    same = jnp.shape(input) == jnp.shape(skip) and jnp.shape(gamma) == jnp.shape(input)[-1:]
    if bias is None and floats and same:  # the sum and its norm in one call (steps as below)

        def ref(a, b, g):
            v = a + b
            return rms_scaled(v, g, epsilon), v

        y, total = kernels.skip_rms_norm(input, skip, gamma, epsilon, ref)
        return skip_rms_outputs(y, total, epsilon, ctx.num_outputs)
    total = _skip_sum(input, skip, bias)
    x = total.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + epsilon)
    if total.dtype == jnp.float32 and jnp.shape(gamma) == (x.shape[-1],):
        # onnxruntime's float steps (an int8 product after it turns one ulp into a step)
        ref = lambda v, g: rms_scaled(v, g, epsilon)  # noqa: E731
        y = kernels.rms_norm(x, gamma, epsilon, kernels.RMS_SKIP, ref)
    else:
        y = x * inv * gamma
    return _norm_outputs(y.astype(total.dtype), jnp.zeros_like(inv), inv, total, ctx.num_outputs)


@op("EmbedLayerNormalization", domain=MS)
def EmbedLayerNormalization(
    input_ids,
    segment_ids,
    word_embedding,
    position_embedding,
    segment_embedding=None,
    gamma=None,
    beta=None,
    mask=None,
    position_ids=None,
    *,
    epsilon=1e-12,
    mask_index_type=1,
    ctx,
):
    """LayerNorm(word[ids] + position[pos] + segment[segment_ids]) * gamma + beta (BERT's
    embeddings); outputs (y [B, S, D], mask_index [B]: the ones of each mask row, or 0s,
    embedding_sum)."""
    ids = jnp.asarray(input_ids).astype(jnp.int32)
    b, s = ids.shape
    if position_ids is None:
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    else:
        pos = jnp.broadcast_to(jnp.asarray(position_ids).astype(jnp.int32), (b, s))
    total = jnp.take(jnp.asarray(word_embedding), ids, axis=0)
    total = total + jnp.take(jnp.asarray(position_embedding), pos, axis=0)
    if segment_ids is not None and segment_embedding is not None:
        segments = jnp.asarray(segment_ids).astype(jnp.int32)
        total = total + jnp.take(jnp.asarray(segment_embedding), segments, axis=0)
    x = total.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + epsilon)
    y = ((x - mean) * inv * gamma + beta).astype(total.dtype)
    if mask is None:
        mask_index = jnp.zeros((b,), jnp.int32)
    else:
        mask_index = jnp.sum(jnp.asarray(mask) == 1, axis=-1).astype(jnp.int32)
    return (y, mask_index, total)[: max(ctx.num_outputs, 1)]


def _norm_outputs(y, mean, inv, total, count):
    return (y, mean, inv, total)[: max(count, 1)]


def rms_scaled(v, gamma, epsilon):
    """``v / rms(v) * gamma`` over the last axis in jax.numpy (the RMS norms' reference)."""
    return v * jax.lax.rsqrt(jnp.mean(jnp.square(v), -1, keepdims=True) + epsilon) * gamma


def skip_rms_outputs(y, total, epsilon, count):
    """SkipSimplifiedLayerNormalization's first ``count`` outputs (y, mean, inv_std, sum) from
    its norm ``y`` and its sum ``total``."""
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(total), axis=-1, keepdims=True) + epsilon)
    return _norm_outputs(y, jnp.zeros_like(inv), inv, total, count)


# ---------------------------------------------------------------- activations and products


def _gelu(x):
    return 0.5 * x * (1.0 + jax.scipy.special.erf(x / math.sqrt(2.0)))


@op("Gelu", domain=MS)
def Gelu(x):
    """x * Phi(x) with the exact erf."""
    return _gelu(jnp.asarray(x))


@op("BiasGelu", domain=MS)
def BiasGelu(a, b):
    """Gelu(a + b)."""
    return _gelu(jnp.asarray(a) + b)


@op("FastGelu", domain=MS)
def FastGelu(x, bias=None):
    """The tanh approximation of Gelu(x + bias)."""
    x = jnp.asarray(x) if bias is None else jnp.asarray(x) + bias
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + jnp.tanh(inner))


@op("QuickGelu", domain=MS)
def QuickGelu(x, *, alpha=1.702):
    """x * sigmoid(alpha * x)."""
    x = jnp.asarray(x)
    return x * jax.nn.sigmoid(alpha * x)


@op("BiasAdd", domain=MS)
def BiasAdd(x, bias, skip):
    """x + bias + skip."""
    return x + bias + skip


@op("FusedMatMul", domain=MS)
def FusedMatMul(a, b, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * op(a) @ op(b), op transposing the last two axes (and the batch axes)."""
    m = xp(a, b)
    a = _fused_operand(m, a, transA, transBatchA)
    b = _fused_operand(m, b, transB, transBatchB)
    return m.matmul(a, b) * m.asarray(alpha, dtype=m.result_type(a, b))


def _fused_operand(m, x, trans, trans_batch):
    if x.ndim < 2:
        return x
    if trans_batch:  # [d0, d1, ..., dk-2, dk-1] -> [d1, ..., dk-2, d0, dk-1]
        axes = list(range(1, x.ndim - 1)) + [0, x.ndim - 1]
        x = m.transpose(x, axes)
    if trans:
        x = m.swapaxes(x, -1, -2)
    return x
