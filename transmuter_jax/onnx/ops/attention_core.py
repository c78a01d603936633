"""The attention math shared by every attention op: heads, rotary embedding, masks, the masked
softmax, and grouped scores and values.

Layouts: ``BSNH`` is [batch, sequence, heads, head size] (how projections come out), ``BNSH`` is
[batch, heads, sequence, head size] (how KV caches are stored). Queries are BSNH, keys and values
BNSH; a query head ``i`` reads KV head ``i // (N / Nk)``, and K/V are never repeated per query
head: each KV head's queries form one matrix.

Precision rule: rotary embedding, scores, softmax and the weighted sum of values are computed in
float32 whatever the input dtype (float16, bfloat16), and rounded to the input dtype once at the
end, as onnxruntime's CPU kernels do (MLAS rotates in float; attention accumulates in float).
"""

from __future__ import annotations

import jax.numpy as jnp

from ._util import precision

# A position larger than any query's: "no causal limit" for keys at real positions.
NO_LIMIT = 2**30


def split_heads(x, heads: int):
    """[B, S, N*H] -> [B, S, N, H] (BSNH)."""
    b, s, d = x.shape
    return jnp.reshape(x, (b, s, heads, d // heads))


def merge_heads(x):
    """[B, S, N, H] -> [B, S, N*H]."""
    b, s, n, h = x.shape
    return jnp.reshape(x, (b, s, n * h))


# ---------------------------------------------------------------- rotary embedding


def rotate(x, cos, sin, interleaved):
    """Rotates the first ``2 * cos.shape[-1]`` features of each head, in float32.

    x: [B, S, N, H]; cos, sin: [B or 1, S, R/2], the angles of each token. Interleaved pairs are
    features (2i, 2i+1); otherwise (i, i + R/2). Returns x's dtype.
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    c = jnp.asarray(cos)[:, :, None, :].astype(jnp.float32)  # [B, S, 1, R/2]
    s = jnp.asarray(sin)[:, :, None, :].astype(jnp.float32)
    r = rot.astype(jnp.float32)
    if interleaved:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(r.shape)
    else:
        x1, x2 = r[..., :half], r[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


def rotate_at(x, positions, cos_cache, sin_cache, interleaved):
    """x: [B, S, N, H] rotated at ``positions`` [B, S] (ints) by the tables [P, R/2]."""
    positions = jnp.asarray(positions).astype(jnp.int32)
    cos = jnp.take(jnp.asarray(cos_cache), positions, axis=0)  # [B, S, R/2]
    sin = jnp.take(jnp.asarray(sin_cache), positions, axis=0)
    return rotate(x, cos, sin, interleaved)


# ---------------------------------------------------------------- masks and softmax


def visible(q_pos, k_pos, *, causal=True, left=-1, right=-1):
    """Which keys each query sees, by absolute position.

    q_pos: [..., S] query positions; k_pos: [..., L] key positions (broadcast against q_pos's
    leading axes). ``causal``: keys after the query are hidden. ``left``/``right``: at most that
    many keys before/after the query are seen (< 0: unlimited). Returns [..., S, L] bool.
    """
    i = jnp.asarray(q_pos)[..., :, None]
    j = jnp.asarray(k_pos)[..., None, :]
    mask = jnp.ones(jnp.broadcast_shapes(i.shape, j.shape), bool)
    if causal:
        mask &= j <= i
    if left >= 0:
        mask &= i - j <= left
    if right >= 0:
        mask &= j - i <= right
    return mask


def cap(scores, softcap):
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit cap); scores as they are if <= 0."""
    if softcap and softcap > 0:
        return softcap * jnp.tanh(scores / softcap)
    return scores


def masked_softmax(scores, mask=None, sink=None):
    """Softmax over the last axis restricted to the keys in ``mask`` (others weigh 0; a row
    without a key, or whose keys all score -inf, is all 0).

    scores: [..., L] float32; mask: bool broadcast against scores, or None (every key).
    sink: optional logit of an extra key without a value (smooth softmax), broadcast to [..., 1].
    """
    masked = scores if mask is None else jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(masked, axis=-1, keepdims=True)
    if sink is not None:
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(masked - top)
    if mask is not None:
        e = jnp.where(mask, e, 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - top)
    return e / jnp.where(total == 0, 1.0, total)


# ---------------------------------------------------------------- grouped scores and values


def grouped_scores(q, k, scale):
    """q: [B, S, N, H], k: [B, Nk, L, H] -> ``scale * q.k``: [B, N, S, L] in float32.

    Each KV head's G = N / Nk queries are one [G * S, H] matrix, so the product reads k as it
    lies (no repeat, no copy of the cache).
    """
    b, s, n, h = q.shape
    nk = k.shape[1]
    qg = q.reshape(b, s, nk, n // nk, h).transpose(0, 2, 3, 1, 4).reshape(b, nk, -1, h)
    qg = qg.astype(jnp.float32)
    scores = jnp.einsum("bkmh,bklh->bkml", qg, k.astype(jnp.float32), precision=precision())
    return scores.reshape(b, n, s, k.shape[2]) * scale


def grouped_values(probs, v):
    """probs: [B, N, S, L], v: [B, Nk, L, Hv] -> [B, S, N, Hv] in float32."""
    b, n, s, l = probs.shape
    nk, h = v.shape[1], v.shape[3]
    pg = probs.reshape(b, nk, -1, l)  # [B, Nk, G * S, L]
    out = jnp.einsum("bkml,bklh->bkmh", pg, v.astype(jnp.float32), precision=precision())
    return out.reshape(b, nk, n // nk, s, h).transpose(0, 3, 1, 2, 4).reshape(b, s, n, h)


def attend(q, k, v, scale, mask=None, *, bias=None, softcap=0.0, sink=None):
    """Scaled dot-product attention with grouped KV heads, in float32.

    q: [B, S, N, H]; k: [B, Nk, L, H]; v: [B, Nk, L, Hv]; mask: bool [.., S, L] or None; bias:
    additive [.., S, L] (after the softcap). Returns (out [B, S, N, Hv], probs [B, N, S, L]).
    """
    scores = cap(grouped_scores(q, k, scale), softcap)
    if bias is not None:
        scores = scores + bias
    probs = masked_softmax(scores, mask, sink)
    return grouped_values(probs, v), probs
