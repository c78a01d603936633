"""CPU kernels (XLA FFI, C++) for the matrix products of decoding, with pure-JAX equivalents.

- :func:`matmul`: float32 ``x @ w`` with ``w`` packed once by :func:`pack` into column strips.
- :func:`matmul_nbits`: com.microsoft MatMulNBits with 4-bit weights, read as stored.
- :func:`attention`: a step's attention over a cache; :func:`attention_step`: with the rotary
  embedding and the cache's write; :func:`matmul_nt`: ``a @ x^T`` without
  the transposed copy; :func:`matmul_nn`: few rows ``a @ x``; :func:`softmax`;
  :func:`rms_norm`; :func:`silu_mul`.

The kernels run only on the CPU backend, when the library built (see :mod:`.build`); otherwise
(and for shapes the kernels do not cover) the same functions compute with jax.numpy. Both are
differentiable and vmappable: gradients, and vmap over the weights, use the pure-JAX path.

Environment: ``TRANSMUTER_JAX_KERNELS=0`` turns the kernels off; ``TRANSMUTER_JAX_KERNEL_THREADS``
sets the threads of their pool (default: the CPUs this process may use) and
``TRANSMUTER_JAX_KERNEL_SPIN_US`` how long idle workers spin before sleeping (default 200);
``TRANSMUTER_JAX_KERNEL_AHEAD_KB`` how much of the next product's weights each idle thread
prefetches (default 256, 0 for none).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime import switch
from ..runtime.switch import enabled, off  # noqa: F401  (the one switch)
from . import build
from .build import library

STRIP = build.STRIP  # columns per strip of a packed weight; checked against the library at load
# More rows than this: exact MatMulNBits leaves the product to XLA (dequantize, then one large
# dot), which is faster there. int8 activations run in the kernel at any number of rows.
NBITS_MAX_ROWS = 96
# More rows than this: float32 matmul leaves the product to XLA's dot on the unpacked weight,
# which is faster for the large products of prefills and vision encoders.
MATMUL_MAX_ROWS = 512
PORTABLE_ENV = switch.PORTABLE_ENV


def available() -> bool:
    """Whether the kernel library is built and loaded (False when turned off)."""
    return library() is not None


switch.provide(available)  # enabled() and off() are the runtime's one switch


# ---------------------------------------------------------------- packed float32 weights


def pack(w: np.ndarray) -> np.ndarray:
    """A float32 matrix ``[K, N]`` as its strips ``[ceil(N / STRIP), K, STRIP]``, zero-padded.

    The result is 64-byte aligned, so ``jax.device_put`` on CPU can use it without a copy.
    """
    w = np.asarray(w, dtype=np.float32)
    k, n = w.shape
    strips = -(-n // STRIP)
    size = strips * k * STRIP
    raw = np.zeros(size + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    packed = raw[start : start + size].reshape(strips, k, STRIP)
    lib = library()
    if lib is not None and w.size:  # the library's threaded copy, from any strides
        row, col = (stride // 4 for stride in w.strides)
        lib.tj_pack_f32(
            ctypes.c_void_p(w.ctypes.data),
            ctypes.c_int64(row),
            ctypes.c_int64(col),
            ctypes.c_int64(k),
            ctypes.c_int64(n),
            ctypes.c_void_p(packed.ctypes.data),
        )
        return packed
    for s in range(strips):  # one strip at a time: no second full-size temporary
        cols = w[:, s * STRIP : (s + 1) * STRIP]
        packed[s, :, : cols.shape[1]] = cols
    return packed


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """The matrix ``[K, N]`` that :func:`pack` packed (materialized by XLA where it is used)."""
    strips, k, width = packed.shape
    return jnp.transpose(packed, (1, 0, 2)).reshape(k, strips * width)[:, :n]


def columns(packed: jax.Array, index: jax.Array, n: int) -> jax.Array:
    """Columns ``index`` (negative counts from N) of the packed matrix: ``[*index.shape, K]``."""
    index = jnp.asarray(index).astype(jnp.int32)
    index = jnp.where(index < 0, index + n, index)
    return packed[index // STRIP, :, index % STRIP]


def rows(packed: jax.Array, index: jax.Array, n: int) -> jax.Array:
    """Rows ``index`` (negative counts from K) of the packed matrix: ``[*index.shape, N]``."""
    strips, k, width = packed.shape
    index = jnp.asarray(index).astype(jnp.int32)
    index = jnp.where(index < 0, index + k, index)
    picked = jnp.take(packed, index, axis=1)  # [S, *index.shape, W]
    picked = jnp.moveaxis(picked, 0, -2)  # [*index.shape, S, W]
    return picked.reshape(*index.shape, strips * width)[..., :n]


def _matmul_reference(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    return jnp.matmul(x, unpack(packed, n))


def _matmul_kernel(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call("tj_gemm_f32", out)(x, packed)


def _matmul_rows_kernel(x: jax.Array, packed: jax.Array, counts: jax.Array, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call("tj_gemm_rows_f32", out)(x, packed, counts)


def _matmul_rows_reference(x: jax.Array, packed: jax.Array, counts: jax.Array, n: int):
    return _matmul_reference(x, packed, n)  # every row: the padding's are never read


# The real tokens of each row of the step being traced (see token_rows), or None.
_TOKEN_ROWS: contextvars.ContextVar[tuple[jax.Array, int] | None] = contextvars.ContextVar(
    "token_rows", default=None
)


@contextlib.contextmanager
def token_rows(counts: jax.Array, steps: int):
    """Within: a product over a step's token rows (``x [B, S, K]``, S = ``steps``, or ``[S, K]``
    with one row; :func:`matmul` with ``tokens=True``) computes the first ``counts[b]`` tokens
    of each row b only, and gives each later token (padding that nothing reads) a copy of the
    row's last computed one. ``counts``: [B] int32, each at least 1."""
    reset = _TOKEN_ROWS.set((jnp.asarray(counts, jnp.int32), int(steps)) if steps > 1 else None)
    try:
        yield
    finally:
        _TOKEN_ROWS.reset(reset)


# The live rows [B] of the batch of the step being traced (see live_rows), or None.
_LIVE_ROWS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "live_rows", default=None
)


@contextlib.contextmanager
def live_rows(live: jax.Array):
    """Within: a product over a step's token rows (``x [B, S, K]`` or ``[B, K]``;
    :func:`matmul` with ``tokens=True``) and a MatMulNBits over ``x [B, S, K]`` compute the rows
    of the live batch rows only (``live`` [B] bool), reading the weights once for them all; a
    row that is not live holds a copy of a live one (nothing may read it). A computed row has
    the bits it has when every row is computed. A batch of one is always computed."""
    live = jnp.asarray(live)
    reset = _LIVE_ROWS.set(live.astype(jnp.int32) if live.shape[0] > 1 else None)
    try:
        yield
    finally:
        _LIVE_ROWS.reset(reset)


def _live_for(x: jax.Array) -> jax.Array | None:
    """The live rows of :func:`live_rows` where ``x``'s leading axis is the step's batch."""
    live = _LIVE_ROWS.get()
    if live is None or x.ndim not in (2, 3) or x.shape[0] != live.shape[0]:
        return None
    return live


def _matmul_live_kernel(x: jax.Array, packed: jax.Array, live: jax.Array, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call("tj_gemm_live_f32", out)(x, packed, live)


def _matmul_live_reference(x: jax.Array, packed: jax.Array, live: jax.Array, n: int):
    return _matmul_reference(x, packed, n)  # every row: the others' are never read


def _counts_for(x: jax.Array) -> jax.Array | None:
    """The counts of :func:`token_rows` where ``x``'s rows are the step's tokens, batch first."""
    given = _TOKEN_ROWS.get()
    if given is None:
        return None
    counts, steps = given
    batch = counts.shape[0]
    if x.ndim == 3 and x.shape[:2] == (batch, steps) and (batch == 1 or batch != steps):
        return counts  # batch == steps: [S, B] sequence-first rows would look the same
    if x.ndim == 2 and batch == 1 and x.shape[0] == steps:
        return counts
    return None


def matmul(x: jax.Array, packed: jax.Array, n: int, *, tokens: bool = False) -> jax.Array:
    """``x [..., K] @ w [K, N]`` in float32, ``w`` given packed by :func:`pack`. ``tokens``:
    ``x``'s rows are the tokens of the graph's step, whose padding :func:`token_rows` may skip.
    """
    x = jnp.asarray(x, jnp.float32)
    if not enabled() or x.shape[-1] == 0 or math.prod(x.shape[:-1]) > MATMUL_MAX_ROWS:
        return _matmul_reference(x, packed, n)
    if x.shape[-1] != packed.shape[-2]:  # another K: the product's own shape error
        return _matmul_reference(x, packed, n)  # at trace time, not the kernel's at run time
    counts = _counts_for(x) if tokens else None
    if counts is not None:
        return _wrapped(_matmul_rows_kernel, _matmul_rows_reference, n=n)(x, packed, counts)
    live = _live_for(x) if tokens else None
    if live is not None:
        fn = _wrapped(_matmul_live_kernel, _matmul_live_reference, folds=False, n=n)
        return fn(x, packed, live)  # vmap over x: every row (the blocks would move)
    return _wrapped(_matmul_kernel, _matmul_reference, n=n)(x, packed)


def matmul_skip_norm(
    x: jax.Array,
    packed: jax.Array,
    skip: jax.Array,
    gamma: jax.Array,
    n: int,
    epsilon: float,
    reference: Callable[..., tuple[jax.Array, jax.Array]],
    *,
    tokens: bool = False,
) -> tuple[jax.Array, jax.Array] | None:
    """:func:`matmul` of ``x`` followed by :func:`skip_rms_norm` of the product and ``skip
    [..., N]`` (gamma ``[N]``), in one call: ``(the norm, product + skip)``, the values of the
    two calls; None where :func:`matmul` would not run one kernel call (more rows than
    :data:`MATMUL_MAX_ROWS`, a prompt's padded rows: the caller runs the two).
    ``reference(x, skip, w, gamma)`` computes the same pair in pure JAX (``w`` [K, N])."""
    x = jnp.asarray(x, jnp.float32)
    if (
        not enabled()
        or x.shape[-1] == 0
        or math.prod(x.shape[:-1]) > MATMUL_MAX_ROWS
        or x.shape[-1] != packed.shape[-2]
        or jnp.shape(skip) != (*x.shape[:-1], n)
        or jnp.shape(gamma) != (n,)
        or (tokens and _counts_for(x) is not None)
    ):
        return None
    live = _live_for(x) if tokens else None

    def kernel(x, skip, packed, gamma, *live):
        out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
        name = "tj_gemm_skip_norm_live_f32" if live else "tj_gemm_skip_norm_f32"
        return tuple(
            jax.ffi.ffi_call(name, (out, out))(
                x, packed, skip, gamma, *live, epsilon=np.float32(epsilon)
            )
        )

    def ref(x, skip, packed, gamma, *live):  # every row: the others' are never read
        return reference(x, skip, unpack(packed, n), gamma)

    fn = _wrapped(kernel, ref, folds=live is None, activations=2)
    more = () if live is None else (live,)
    skip, gamma = jnp.asarray(skip, jnp.float32), jnp.asarray(gamma, jnp.float32)
    return fn(x, skip, packed, gamma, *more)


def matmul_gate_up(
    x: jax.Array, gate: jax.Array, up: jax.Array, n: int, *, tokens: bool = False
) -> jax.Array:
    """``silu_mul(x @ gate, x @ up)``, both weights ``[K, N]`` packed by :func:`pack`, in one
    call where the kernels run it: both products on one run of the pool, then the gated
    activation, with the values of :func:`matmul` twice and :func:`silu_mul`. ``tokens`` as for
    :func:`matmul` (a step's padded prompt runs the three calls, skipping the padding)."""
    x = jnp.asarray(x, jnp.float32)
    if (
        not enabled()
        or build.vector_lanes() is None
        or x.shape[-1] == 0
        or math.prod(x.shape[:-1]) > MATMUL_MAX_ROWS
        or x.shape[-1] != gate.shape[-2]
        or gate.shape != up.shape
        or (tokens and _counts_for(x) is not None)
    ):
        return silu_mul(matmul(x, gate, n, tokens=tokens), matmul(x, up, n, tokens=tokens))
    live = _live_for(x) if tokens else None
    if live is not None:
        fn = _wrapped(_gate_up_live_kernel, _gate_up_live_reference, folds=False, n=n)
        return fn(x, gate, up, live)  # vmap over x: every row (the blocks would move)
    return _wrapped(_gate_up_kernel, _gate_up_reference, n=n)(x, gate, up)


def _gate_up_reference(x: jax.Array, gate: jax.Array, up: jax.Array, n: int) -> jax.Array:
    return _silu_mul_reference(_matmul_reference(x, gate, n), _matmul_reference(x, up, n))


def _gate_up_kernel(x: jax.Array, gate: jax.Array, up: jax.Array, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call("tj_gemm_gate_up_f32", out)(x, gate, up)


def _gate_up_live_kernel(x, gate, up, live, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call("tj_gemm_gate_up_live_f32", out)(x, gate, up, live)


def _gate_up_live_reference(x, gate, up, live, n: int) -> jax.Array:
    return _gate_up_reference(x, gate, up, n)  # every row: the others' are never read


# ---------------------------------------------------------------- attention


def _attention_reference(
    q, k, v, total, old_k, old_v, past, *, scale, causal, window, tokens_first=False
):
    """:func:`attention` in jax.numpy."""
    if tokens_first:  # k, v [B, S, Nk, H] -> [B, Nk, S, H]
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    b, s, n, h = q.shape
    nk, cached = k.shape[1], old_k.shape[2]
    past = jnp.clip(past, 0, cached) if cached else jnp.zeros_like(past)
    qg = q.reshape(b, s, nk, n // nk, h).astype(jnp.float32)
    keys = jnp.concatenate([old_k, k], axis=2).astype(jnp.float32)  # [B, Nk, L + S, H]
    values = jnp.concatenate([old_v, v], axis=2).astype(jnp.float32)
    scores = jnp.einsum("bsgmh,bgjh->bgmsj", qg, keys) * scale
    row = jnp.arange(cached + s)[None, :]  # [1, L + S]
    # key u's position: an old row's index, or past + the step's row
    at = jnp.where(row < cached, row, past[:, None] + row - cached)  # [B, L + S]
    kept = jnp.where(row < cached, row < past[:, None], True) & (at < total[:, None])
    i = past[:, None] + jnp.arange(s)[None, :]  # [B, S] query positions
    seen = jnp.broadcast_to(kept[:, None, :], (b, s, cached + s))
    if causal:
        seen = seen & (at[:, None, :] <= i[:, :, None])
        if window > 0:
            seen = seen & (i[:, :, None] - at[:, None, :] < window)
    seen = seen[:, None, None]  # [B, 1, 1, S, L + S]
    masked = jnp.where(seen, scores, -jnp.inf)
    top = jnp.max(masked, axis=-1, keepdims=True)
    e = jnp.where(seen, jnp.exp(masked - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total_e = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total_e == 0, 1.0, total_e)
    out = jnp.einsum("bgmsj,bgjh->bsgmh", probs, values)
    return out.reshape(b, s, n, h)


def _attention_kernel(
    q, k, v, total, old_k, old_v, past, *, scale, causal, window, tokens_first=False
):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("tj_attention_f32", out)(
        q,
        k,
        v,
        total,
        old_k,
        old_v,
        past,
        scale=np.float32(scale),
        window=np.int64(window),
        causal=bool(causal),
        tokens_first=bool(tokens_first),
    )


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    total: jax.Array,
    *,
    scale: float,
    causal: bool,
    window: int = 0,
    old: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    tokens_first: bool = False,
) -> jax.Array | None:
    """Attention of a step over a cache's valid rows and its own, in float32, or None where the
    kernel does not run it (the caller's own path then computes it).

    q: [B, S, N, H]; k, v: [B, Nk, S, H] the step's keys and values; total: [B] the valid keys
    of each row after the step; ``old``: (keys, values [B, Nk, L, H], past [B]) the cache before
    the step and its valid rows (none: a first prompt). Key u is old row u for u < past, else the
    step's row u - past, at position u; query i is at past + i and sees the keys u < total with
    u <= past + i (``causal``; with ``window`` > 0, past + i - u < window too), else every key
    u < total. A query without a key gives zeros. ``tokens_first``: k and v are given as
    [B, S, Nk, H] (a projection's output split into heads: read where it lies, no transposed
    copy).
    """
    lanes = build.vector_lanes()
    if not enabled() or lanes is None or q.ndim != 4 or k.ndim != 4:
        return None
    b, s, n, h = q.shape
    nk = k.shape[2 if tokens_first else 1]
    if old is None:
        empty = jnp.zeros((b, nk, 0, h), jnp.float32)
        old = (empty, empty, jnp.zeros((b,), jnp.int32))
    old_k, old_v, past = old
    arrays = (q, k, v, old_k, old_v)
    if any(jnp.dtype(a.dtype) != jnp.float32 or a.ndim != 4 for a in arrays) or h % lanes:
        return None
    want = (b, s, nk, h) if tokens_first else (b, nk, s, h)
    if k.shape != want or v.shape != k.shape or n % nk:
        return None
    if old_k.shape[:2] != (b, nk) or old_k.shape[3] != h or old_v.shape != old_k.shape:
        return None
    static = {
        "scale": float(scale),
        "causal": bool(causal),
        "window": int(window),
        "tokens_first": bool(tokens_first),
    }
    fn = _wrapped(_attention_kernel, _attention_reference, folds=False, **static)
    ints = [jnp.asarray(a, jnp.int32).reshape(b) for a in (total, past)]
    return fn(q, k, v, ints[0], old_k, old_v, ints[1])


def _attention_step_reference(
    qkv, cos, sin, rot, total, old_k, old_v, past, *, heads, scale, causal, window, interleaved
):
    """:func:`attention_step` in jax.numpy."""
    b, s, _, h = qkv.shape
    nk = old_k.shape[1]
    half = cos.shape[-1]
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + nk], qkv[:, :, heads + nk :]
    if half:
        c = jnp.take(cos, rot, axis=0)[:, :, None, :]  # [B, S, 1, half]; outside: NaN
        t = jnp.take(sin, rot, axis=0)[:, :, None, :]

        def rotate(x):
            if interleaved:
                a, o = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
                turned = jnp.stack([a * c - o * t, o * c + a * t], axis=-1).reshape(
                    x.shape[:-1] + (2 * half,)
                )
            else:
                a, o = x[..., :half], x[..., half : 2 * half]
                turned = jnp.concatenate([a * c - o * t, o * c + a * t], axis=-1)
            return jnp.concatenate([turned, x[..., 2 * half :]], axis=-1)

        q, k = rotate(q), rotate(k)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Nk, S, H]
    out = _attention_reference(
        q, k, v, total, old_k, old_v, past, scale=scale, causal=causal, window=window
    )

    def write(buffer, rows, at):
        return jax.lax.dynamic_update_slice(buffer, rows, (np.int32(0), at, np.int32(0)))

    at = jnp.asarray(past, jnp.int32)
    return out, jax.vmap(write)(old_k, k, at), jax.vmap(write)(old_v, v, at)


def _attention_step_kernel(
    qkv, cos, sin, rot, total, old_k, old_v, past, *, heads, scale, causal, window, interleaved
):
    b, s, _, h = qkv.shape
    shapes = (
        jax.ShapeDtypeStruct((b, s, heads, h), jnp.float32),
        jax.ShapeDtypeStruct(old_k.shape, jnp.float32),
        jax.ShapeDtypeStruct(old_v.shape, jnp.float32),
    )
    return jax.ffi.ffi_call("tj_gqa_step_f32", shapes, input_output_aliases={5: 1, 6: 2})(
        qkv,
        cos,
        sin,
        rot,
        total,
        old_k,
        old_v,
        past,
        scale=np.float32(scale),
        window=np.int64(window),
        causal=bool(causal),
        interleaved=bool(interleaved),
        heads=np.int64(heads),
    )


def attention_step(
    qkv: jax.Array,
    total: jax.Array,
    old: tuple[jax.Array, jax.Array, jax.Array],
    *,
    heads: int,
    scale: float,
    causal: bool,
    window: int = 0,
    rotary: tuple[jax.Array, jax.Array, jax.Array, bool] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """A step of grouped-query attention over a cache buffer in one call, or None where the
    kernel does not run it (the caller's own path then computes it).

    qkv: [B, S, N + 2 Nk, H] the packed queries, keys and values (N = ``heads``); ``old``: the
    buffer (keys, values [B, Nk, L, H], L >= S) and its valid rows past [B]; ``rotary``: (cos,
    sin [P, R/2], positions [B, S], interleaved) rotating the queries and keys first. Returns
    (out [B, S, N, H], keys, values): :func:`attention` over the buffer's valid rows and the
    step's, and the buffer with the step's rows written at row ``past[b]`` of each batch row
    (clamped so that they fit, as ``dynamic_update_slice``), in the buffer's place (donated in a
    jitted caller).
    """
    lanes = build.vector_lanes()
    old_k, old_v, past = old
    if not enabled() or lanes is None or qkv.ndim != 4 or old_k.ndim != 4:
        return None
    b, s, width, h = qkv.shape
    nk, cached = old_k.shape[1], old_k.shape[2]
    arrays = (qkv, old_k, old_v) + (tuple(rotary[:2]) if rotary is not None else ())
    if any(jnp.dtype(a.dtype) != jnp.float32 for a in arrays) or h % lanes:
        return None
    if heads < 1 or heads % nk or width != heads + 2 * nk or cached < s:
        return None
    if old_k.shape != (b, nk, cached, h) or old_v.shape != old_k.shape:
        return None
    if rotary is None:
        cos = sin = jnp.zeros((0, 0), jnp.float32)
        rot, interleaved = jnp.zeros((b, s), jnp.int32), False
    else:
        cos, sin, rot, interleaved = rotary
        if cos.ndim != 2 or sin.shape != cos.shape or 2 * cos.shape[1] > h:
            return None
        rot = jnp.asarray(rot).astype(jnp.int32).reshape(b, s)
    static = {
        "heads": int(heads),
        "scale": float(scale),
        "causal": bool(causal),
        "window": int(window),
        "interleaved": bool(interleaved),
    }
    fn = _wrapped(_attention_step_kernel, _attention_step_reference, folds=False, **static)
    ints = [jnp.asarray(a, jnp.int32).reshape(b) for a in (total, past)]
    return fn(qkv, cos, sin, rot, ints[0], old_k, old_v, ints[1])


# ---------------------------------------------------------------- products with x transposed

# More rows of ``a`` than this: :func:`matmul_nt` leaves the product to XLA's dot (an encoder's
# scores: the transposed copy is small beside the product).
NT_MAX_ROWS = 16


def _matmul_nt_reference(a: jax.Array, x: jax.Array, *, scale: float | None) -> jax.Array:
    x = x if scale is None else x * jnp.asarray(scale, x.dtype)
    return jnp.matmul(a, jnp.swapaxes(x, -1, -2))


def _matmul_nt_kernel(a: jax.Array, x: jax.Array, *, scale: float | None) -> jax.Array:
    out = jax.ShapeDtypeStruct((*a.shape[:-1], x.shape[-2]), jnp.float32)
    return jax.ffi.ffi_call("tj_matmul_nt_f32", out)(
        a, x, scale=np.float32(1.0 if scale is None else scale), scaled=scale is not None
    )


def matmul_nt(a: jax.Array, x: jax.Array, scale: float | None = None) -> jax.Array | None:
    """``a [..., M, K] @ (x [..., N, K] * scale)^T`` in float32 without copying ``x`` transposed
    (attention's scores over a cache), or None where the kernel does not run it (other dtypes,
    batch dimensions that differ, more than :data:`NT_MAX_ROWS` rows of ``a``): the caller's own
    path then computes it. ``x * scale`` is rounded first, as a graph's Mul rounds it."""
    lanes = build.vector_lanes()
    if not enabled() or lanes is None or a.ndim < 2 or x.ndim != a.ndim:
        return None
    if jnp.dtype(a.dtype) != jnp.float32 or jnp.dtype(x.dtype) != jnp.float32:
        return None
    if a.shape[:-2] != x.shape[:-2] or a.shape[-1] != x.shape[-1] or a.shape[-2] > NT_MAX_ROWS:
        return None
    fn = _wrapped(_matmul_nt_kernel, _matmul_nt_reference, folds=False, scale=scale)
    return fn(a, x)


def _matmul_nn_reference(a: jax.Array, x: jax.Array, x2: jax.Array | None = None) -> jax.Array:
    return jnp.matmul(a, x if x2 is None else jnp.concatenate([x, x2], axis=-2))


def _matmul_nn_kernel(a: jax.Array, x: jax.Array, x2: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((*a.shape[:-1], x.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call("tj_matmul_nn_f32", out)(a, x, x2)


def matmul_nn(a: jax.Array, x: jax.Array, x2: jax.Array | None = None) -> jax.Array | None:
    """``a [..., M, K] @ x [..., K, N]`` in float32 for at most :data:`NT_MAX_ROWS` rows of
    ``a`` over batch dimensions (attention's weighted values over a cache), each output one
    multiply-add chain over K; with ``x2``, x is ``concatenate([x, x2], axis=-2)``, read where
    its parts are (a cache and a step's own rows, the same bits). None where the kernel does not
    run it (other dtypes, batch dimensions that differ or none, more rows): the caller's own
    path then computes it."""
    if not enabled() or build.vector_lanes() is None or a.ndim < 3 or x.ndim != a.ndim:
        return None
    if x2 is None:
        x2 = jnp.zeros((*x.shape[:-2], 0, x.shape[-1]), jnp.float32)
    arrays = (a, x, x2)
    if any(jnp.dtype(v.dtype) != jnp.float32 for v in arrays) or x2.ndim != x.ndim:
        return None
    if a.shape[:-2] != x.shape[:-2] or x2.shape[:-2] != x.shape[:-2] or a.shape[-2] > NT_MAX_ROWS:
        return None
    if a.shape[-1] != x.shape[-2] + x2.shape[-2] or x2.shape[-1] != x.shape[-1]:
        return None
    return _wrapped(_matmul_nn_kernel, _matmul_nn_reference, folds=False)(a, x, x2)


# ---------------------------------------------------------------- axes swapped

# Fewer values than this: :func:`swap_axes` leaves the copy to XLA, which fuses it with its
# neighbours (a decode step's heads).
SWAP_MIN_VALUES = 1 << 16
# Shorter runs than this (values of the last axis): XLA's loop copies them as fast.
SWAP_MIN_RUN = 16


def _swap_axes_reference(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2)


def _swap_axes_kernel(x: jax.Array) -> jax.Array:
    b, t, n, h = x.shape
    return jax.ffi.ffi_call("tj_swap_axes_f32", jax.ShapeDtypeStruct((b, n, t, h), jnp.float32))(x)


def swap_axes(x: jax.Array) -> jax.Array | None:
    """``x [A, B, C, D] -> [A, C, B, D]`` in float32 (attention's split into heads), each run of
    D values copied whole on the pool, or None where the kernel does not run it (other dtypes or
    ranks, fewer than :data:`SWAP_MIN_VALUES` values, runs shorter than :data:`SWAP_MIN_RUN`):
    the caller's own path then copies it. One copy that every reader shares: XLA:CPU gave an
    output and a kernel's operand a transposed copy each, after a plain one."""
    if not enabled() or build.vector_lanes() is None or jnp.ndim(x) != 4:
        return None
    if jnp.dtype(x.dtype) != jnp.float32 or x.size < SWAP_MIN_VALUES or x.shape[3] < SWAP_MIN_RUN:
        return None
    return _wrapped(_swap_axes_kernel, _swap_axes_reference, folds=False)(x)


# ---------------------------------------------------------------- argmax


def argmax(x: jax.Array) -> jax.Array | None:
    """``jnp.argmax(x, axis=-1)`` of a float32 ``x`` as int32 (the first largest value; the
    first NaN where a row has one), in two vector passes a row with the rows on the pool (a
    token's choice over the vocabulary: XLA:CPU reduced [8, 49152] scores in ~400 us), or None
    where the kernel does not run it (other dtypes, an empty last axis): the caller's own path
    then computes it. vmap adds rows; it has no gradient (an index)."""
    if not enabled() or build.vector_lanes() is None or jnp.ndim(x) < 1 or x.shape[-1] == 0:
        return None
    if jnp.dtype(x.dtype) != jnp.float32 or x.shape[-1] > np.iinfo(np.int32).max:
        return None
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call("tj_argmax_f32", out, vmap_method="broadcast_all")(x)


# ---------------------------------------------------------------- softmax


def _softmax_reference(x: jax.Array) -> jax.Array:
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_kernel(x: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call("tj_softmax_f32", jax.ShapeDtypeStruct(x.shape, jnp.float32))(x)


def softmax(x: jax.Array) -> jax.Array | None:
    """Softmax over the last axis of a float32 ``x``, vectorized and on the pool (attention's
    weights: XLA runs its passes on one thread), or None where the kernel does not run it (the
    caller's own path then computes it). Every row takes the same steps at any size."""
    if not enabled() or build.vector_lanes() is None or jnp.ndim(x) < 1:
        return None
    if jnp.dtype(x.dtype) != jnp.float32 or x.shape[-1] == 0:
        return None
    return _wrapped(_softmax_kernel, _softmax_reference)(x)


# ---------------------------------------------------------------- activation


def _silu_mul_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    return (gate * jax.nn.sigmoid(gate)) * up


def _silu_mul_kernel(gate: jax.Array, up: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(gate.shape, jnp.float32)
    return jax.ffi.ffi_call("tj_silu_mul_f32", out)(gate, up)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``(gate * sigmoid(gate)) * up``, SwiGLU's gated activation (on the CPU kernels: float32
    arrays of one shape, vectorized and on the pool; else jax.numpy, broadcasting)."""
    same = jnp.shape(gate) == jnp.shape(up)
    floats = all(jnp.result_type(a) == jnp.float32 for a in (gate, up))
    if not enabled() or not same or not floats or build.vector_lanes() is None:
        return _silu_mul_reference(gate, up)
    return _wrapped(_silu_mul_kernel, _silu_mul_reference, folds=False)(gate, up)


# ---------------------------------------------------------------- MatMulNBits


def nbits_supported(bits: int, block_size: int, k: int, g_idx, scales, zero_points) -> bool:
    """Whether :func:`matmul_nbits` runs the kernel for these MatMulNBits attributes and inputs."""
    blocks = -(-k // block_size) if block_size else 0
    zp_ok = zero_points is None or _dtype(zero_points) in (np.uint8, np.float32)
    return (
        enabled()
        and bits == 4
        and block_size >= 16
        and block_size & (block_size - 1) == 0
        and blocks * block_size % 32 == 0
        and g_idx is None
        and _dtype(scales) == np.float32
        and zp_ok
    )


def _dtype(value) -> np.dtype:
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype


def matmul_nbits(
    x: jax.Array,
    b: jax.Array,
    scales: jax.Array,
    zero_points: jax.Array | None,
    *,
    n: int,
    block_size: int,
    reference: Callable[..., jax.Array],
    int8: bool = False,
    packed: bool = False,
) -> jax.Array:
    """The kernel of MatMulNBits without bias: ``x [..., K]`` float32 -> ``[..., N]`` float32.

    ``int8``: quantize ``x`` to int8 per row and block, as onnxruntime does for accuracy_level 4
    (the steps of :func:`transmuter_jax.onnx.ops.quant.int8_product`).
    ``packed``: ``b``, ``scales`` and ``zero_points`` are in the layouts of :func:`nbits_pack`,
    :func:`nbits_pack_scales` and :func:`nbits_pack_zero_points` (int8, block size 32, integer
    zero points or none); ``reference`` then receives them as stored (:func:`nbits_unpack_all`).
    ``reference(x, b, scales, zero_points)`` is the same computation in pure JAX, used for
    gradients and for vmap over the weights. Call only when :func:`nbits_supported` says so.
    """
    zp = jnp.zeros((0,), jnp.uint8) if zero_points is None else jnp.asarray(zero_points)
    # x [B, S, K] of a step's batch: the rows of live batch rows only (see live_rows)
    live = _live_for(x) if jnp.ndim(x) == 3 else None

    def kernel(x, b, scales, zp, *live):
        out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
        name = "tj_matmul_nbits_live" if live else "tj_matmul_nbits"
        return jax.ffi.ffi_call(name, out)(
            x,
            b,
            scales,
            zp,
            *live,
            block_size=np.int64(block_size),
            int8=bool(int8),
            portable=os.environ.get(PORTABLE_ENV, "") == "1",
            packed=bool(packed),
        )

    def ref(x, b, scales, zp, *live):  # every row: the others' are never read
        zp = None if zp.size == 0 else zp
        if packed:
            b, scales, zp = nbits_unpack_all(b, scales, zp, n)
        return reference(x, b, scales, zp)

    fn = _wrapped(kernel, ref, folds=live is None)  # vmap over x: the blocks would move
    more = () if live is None else (live,)
    return fn(jnp.asarray(x, jnp.float32), jnp.asarray(b), jnp.asarray(scales), zp, *more)


def matmul_nbits_skip_norm(
    x: jax.Array,
    b: jax.Array,
    scales: jax.Array,
    zero_points: jax.Array | None,
    skip: jax.Array,
    gamma: jax.Array,
    *,
    n: int,
    block_size: int,
    epsilon: float,
    reference: Callable[..., tuple[jax.Array, jax.Array]],
    int8: bool = False,
    packed: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`matmul_nbits` of ``x`` followed by :func:`skip_rms_norm` of the product and
    ``skip [..., N]`` (gamma ``[N]``), in one call: ``(the norm, product + skip)``, the values of
    the two calls. ``reference(x, skip, b, scales, zero_points, gamma)`` computes the same pair
    in pure JAX (the weights as :func:`matmul_nbits` gives them to its reference). Call only
    when :func:`nbits_supported` says so."""
    zp = jnp.zeros((0,), jnp.uint8) if zero_points is None else jnp.asarray(zero_points)
    live = _live_for(x) if jnp.ndim(x) == 3 else None

    def kernel(x, skip, b, scales, zp, gamma, *live):
        out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
        name = "tj_matmul_nbits_skip_norm_live" if live else "tj_matmul_nbits_skip_norm"
        return tuple(
            jax.ffi.ffi_call(name, (out, out))(
                x,
                b,
                scales,
                zp,
                skip,
                gamma,
                *live,
                block_size=np.int64(block_size),
                int8=bool(int8),
                portable=os.environ.get(PORTABLE_ENV, "") == "1",
                packed=bool(packed),
                epsilon=np.float32(epsilon),
            )
        )

    def ref(x, skip, b, scales, zp, gamma, *live):  # every row: the others' are never read
        zp = None if zp.size == 0 else zp
        if packed:
            b, scales, zp = nbits_unpack_all(b, scales, zp, n)
        return reference(x, skip, b, scales, zp, gamma)

    fn = _wrapped(kernel, ref, folds=live is None, activations=2)
    more = () if live is None else (live,)
    x, skip = jnp.asarray(x, jnp.float32), jnp.asarray(skip, jnp.float32)
    gamma = jnp.asarray(gamma, jnp.float32)
    return fn(x, skip, jnp.asarray(b), jnp.asarray(scales), zp, gamma, *more)


def matmul_nbits_gate_up(
    x: jax.Array,
    gate: tuple,
    up: tuple,
    *,
    n: int,
    block_size: int,
    reference: Callable[..., jax.Array],
    int8: bool = False,
) -> jax.Array:
    """``silu_mul(x @ gate, x @ up)`` of two packed MatMulNBits weights (each ``(b, scales,
    zero points or None)`` in the layouts of :func:`matmul_nbits` with ``packed``) in one call:
    ``x`` quantized once, both products on one run of the pool, then the gated activation; the
    values are those of the three calls. ``reference(x, *gate, *up)`` receives the weights as
    stored (:func:`nbits_unpack_all`). Call only when :func:`nbits_supported` says so for both."""
    live = _live_for(x) if jnp.ndim(x) == 3 else None

    def zeros(z):
        return jnp.zeros((0,), jnp.uint8) if z is None else jnp.asarray(z)

    def kernel(x, gb, gs, gz, ub, us, uz, *live):
        out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
        name = "tj_matmul_nbits_gate_up_live" if live else "tj_matmul_nbits_gate_up"
        return jax.ffi.ffi_call(name, out)(
            x, gb, gs, gz, ub, us, uz, *live,
            block_size=np.int64(block_size),
            int8=bool(int8),
            portable=os.environ.get(PORTABLE_ENV, "") == "1",
            packed=True,
        )  # fmt: skip

    def ref(x, gb, gs, gz, ub, us, uz, *live):  # every row: the others' are never read
        stored = [
            nbits_unpack_all(b, s, None if z.size == 0 else z, n)
            for b, s, z in ((gb, gs, gz), (ub, us, uz))
        ]
        return reference(x, *stored[0], *stored[1])

    fn = _wrapped(kernel, ref, folds=live is None)  # vmap over x: the blocks would move
    more = () if live is None else (live,)
    weights = [
        f(w) for b, s, z in (gate, up) for f, w in ((jnp.asarray, b), (jnp.asarray, s), (zeros, z))
    ]
    return fn(jnp.asarray(x, jnp.float32), *weights, *more)


# ---------------------------------------------------------------- RMS norms


RMS_SIMPLIFIED, RMS_SKIP = 0, 1  # the float steps of onnxruntime's two RMS norm ops


def rms_norm(
    x: jax.Array, gamma: jax.Array, epsilon: float, mode: int, reference: Callable
) -> jax.Array:
    """``x / rms(x) * gamma`` over the last axis in float32, with the float steps of
    onnxruntime's SimplifiedLayerNormalization (``mode`` :data:`RMS_SIMPLIFIED`: 8 FMA partial
    sums) or SkipSimplifiedLayerNormalization (:data:`RMS_SKIP`: squares summed in order).

    ``reference(x, gamma)`` computes the same in pure JAX: without the kernels, for gradients and
    vmap over gamma. ``gamma`` has shape ``[K]``.
    """
    x = jnp.asarray(x, jnp.float32)
    gamma = jnp.asarray(gamma, jnp.float32)
    if not enabled() or x.shape[-1] == 0 or gamma.shape != x.shape[-1:]:
        return reference(x, gamma)

    def kernel(x, gamma):
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        return jax.ffi.ffi_call("tj_rms_norm", out)(
            x, gamma, epsilon=np.float32(epsilon), mode=np.int64(mode)
        )

    return _wrapped(kernel, reference)(x, gamma)


def skip_rms_norm(
    x: jax.Array, skip: jax.Array, gamma: jax.Array, epsilon: float, reference: Callable
) -> tuple[jax.Array, jax.Array]:
    """``(rms_norm(x + skip), x + skip)`` in float32 with :data:`RMS_SKIP`'s float steps, in one
    call (SkipSimplifiedLayerNormalization's normed output and its sum, the residual stream):
    the sum is each element's one float add, as XLA's. ``reference(x, skip, gamma)`` computes
    the same pair in pure JAX. ``x`` and ``skip`` have one shape, ``gamma`` ``[K]``."""
    x = jnp.asarray(x, jnp.float32)
    skip = jnp.asarray(skip, jnp.float32)
    gamma = jnp.asarray(gamma, jnp.float32)
    if not enabled() or x.shape[-1] == 0 or x.shape != skip.shape or gamma.shape != x.shape[-1:]:
        return reference(x, skip, gamma)

    def kernel(x, skip, gamma):
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        return tuple(
            jax.ffi.ffi_call("tj_skip_rms_norm", (out, out))(
                x, skip, gamma, epsilon=np.float32(epsilon)
            )
        )

    return _wrapped(kernel, reference, activations=2)(x, skip, gamma)


def _nbits_parts() -> tuple[np.ndarray, np.ndarray]:
    """Which values of a group of 128 (4 blocks) byte 4 * o + i of the packed group holds: value
    ``first[4 * o + i]`` (low nibble) and ``second[4 * o + i]`` (high nibble). Lane o of the
    kernel's accumulator sums the 8 values of its part (nbits_block32.h): lane 4j + t takes
    values 16j + 4t' .. + 3 and 16j + 4t' + 8 .. + 3 of the group's first half (t = 0, 1: t' = t)
    or of its second half (t = 2, 3: 64 + ..., t' = t - 2)."""
    first, second = [], []
    for o in range(16):
        j, t = divmod(o, 4)
        base = (64 if t >= 2 else 0) + 16 * j + 4 * (t % 2)
        first += [base + i for i in range(4)]
        second += [base + 8 + i for i in range(4)]
    return np.array(first), np.array(second)


def _nbits_order(blocks: int) -> np.ndarray:
    """For the packed layout of one column (:func:`nbits_pack`), which stored byte and nibble
    each packed nibble holds: index ``2 * byte + high`` of the stored column, for the packed
    column's nibbles in the same order."""
    values = np.arange(blocks * 32).reshape(-1)  # value i sits at stored nibble i
    low, high = [], []
    groups = blocks // 4
    first, second = _nbits_parts()
    for g in range(groups):
        low.append(g * 128 + first)
        high.append(g * 128 + second)
    for b in range(groups * 4, blocks):
        block = values[b * 32 : (b + 1) * 32]
        low.append(block[:16])
        high.append(block[16:])
    if not low:
        return np.zeros(0, np.int64)
    low_all, high_all = np.concatenate(low), np.concatenate(high)
    return np.stack([low_all, high_all], axis=-1).reshape(-1)


def nbits_pack(b: np.ndarray) -> np.ndarray:
    """MatMulNBits weights ``uint8 [N, blocks, 16]`` (4 bits, block size 32, as stored: byte j of a
    block holds values 2j and 2j + 1) in the kernel's layout, same shape.

    Per column, each whole group of 4 blocks becomes 64 bytes whose low nibbles and high nibbles
    are the two halves of each of the kernel's 16 parts (:func:`_nbits_parts`), so a mask, a
    shift and two chained integer dot products give each part's sum; each block left over
    becomes 16 bytes, byte t holding values t and 16 + t.
    """
    b = np.asarray(b, np.uint8)
    n, blocks, half = b.shape
    if half != 16:
        raise ValueError(f"nbits_pack: blocks of 32 values (16 bytes), not {half} bytes")
    stored = np.stack([b & 15, b >> 4], axis=-1).reshape(n, blocks * 32)
    nibbles = stored[:, _nbits_order(blocks)].reshape(n, blocks * 16, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return np.ascontiguousarray(packed.reshape(n, blocks, 16), dtype=np.uint8)


NBITS_TILE = 16  # columns per tile of packed scales and zero points, as nbits_block32.h's kB32Tile


def nbits_pack_scales(scales: np.ndarray, n: int, blocks: int) -> np.ndarray:
    """MatMulNBits scales (``[N, blocks]`` or flat, float32) in the layout the kernel reads with
    packed weights: ``[ceil(N / 16), blocks, 16]``, block ``b`` of column ``c`` at
    ``[c // 16, b, c % 16]``, zero past N."""
    return _tiled(np.asarray(scales, np.float32).reshape(n, blocks))


def _tiled(values: np.ndarray) -> np.ndarray:
    """``values [N, blocks]`` as ``[ceil(N / 16), blocks, 16]``, zero past N."""
    n, blocks = values.shape
    tiles = -(-n // NBITS_TILE)
    padded = np.zeros((tiles * NBITS_TILE, blocks), values.dtype)
    padded[:n] = values
    return np.ascontiguousarray(padded.reshape(tiles, NBITS_TILE, blocks).transpose(0, 2, 1))


def nbits_unpack_scales(tiles: jax.Array, n: int) -> jax.Array:
    """The scales ``[N, blocks]`` of :func:`nbits_pack_scales`' layout (jax.numpy)."""
    tiles = jnp.asarray(tiles)
    count, blocks, _ = tiles.shape
    return jnp.transpose(tiles, (0, 2, 1)).reshape(count * NBITS_TILE, blocks)[:n]


def nbits_pack_zero_points(zero_points: np.ndarray, n: int, blocks: int) -> np.ndarray:
    """MatMulNBits 4-bit zero points (``uint8 [N, ceil(blocks / 2)]`` or flat, low nibble first)
    as one byte each in the tiles of :func:`nbits_pack_scales`: ``uint8 [ceil(N / 16), blocks,
    16]``."""
    zp = np.asarray(zero_points, np.uint8).reshape(n, -(-blocks // 2))
    return _tiled(np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks])


def nbits_unpack_zero_points(tiles: jax.Array, n: int) -> jax.Array:
    """The 4-bit zero points ``uint8 [N, ceil(blocks / 2)]`` (low nibble first) of
    :func:`nbits_pack_zero_points`' layout (jax.numpy)."""
    values = nbits_unpack_scales(tiles, n).astype(jnp.uint8)  # [N, blocks]
    blocks = values.shape[1]
    if blocks % 2:
        values = jnp.pad(values, ((0, 0), (0, 1)))
    pairs = values.reshape(n, -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def nbits_unpack_all(b, scales, zero_points, n: int):
    """Weights, scales and zero points (or None) of the packed layouts as stored, for the pure
    JAX path."""
    zp = None if zero_points is None else nbits_unpack_zero_points(zero_points, n)
    return nbits_unpack(b), nbits_unpack_scales(scales, n), zp


def nbits_unpack(packed: jax.Array) -> jax.Array:
    """The stored MatMulNBits layout of weights packed by :func:`nbits_pack` (jax.numpy)."""
    packed = jnp.asarray(packed)
    n, blocks, _ = packed.shape
    nibbles = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks * 32)
    inverse = np.argsort(_nbits_order(blocks))
    stored = nibbles[:, inverse].reshape(n, blocks * 16, 2)
    return (stored[..., 0] | (stored[..., 1] << 4)).astype(jnp.uint8).reshape(n, blocks, 16)


# ---------------------------------------------------------------- autodiff and vmap


def _wrapped(
    kernel: Callable, reference: Callable, *, folds: bool = True, activations: int = 1, **static
) -> Callable:
    """``kernel(x, *weights)`` made differentiable and vmappable through ``reference``.

    vmap over ``x`` only folds the batch into the kernel's leading dimensions (``folds``; else it
    runs ``reference``); vmap over any weight, and every gradient, runs ``reference`` instead.
    ``activations``: how many leading arguments are shaped as ``x`` (vmapped all alike, they
    fold together; some of them alone run ``reference``).
    """
    kernel = functools.partial(kernel, **static)
    reference = functools.partial(reference, **static)

    @jax.custom_batching.custom_vmap
    def batched(x, *weights):
        return kernel(x, *weights)

    @batched.def_vmap
    def _rule(axis_size, in_batched, x, *weights):
        acts = in_batched[:activations]
        if any(in_batched[activations:]) or (any(acts) and not (folds and all(acts))):
            axes = [0 if b else None for b in in_batched]
            out = jax.vmap(reference, in_axes=axes)(x, *weights)
            return out, jax.tree.map(lambda _: True, out)
        out = kernel(x, *weights)
        return out, jax.tree.map(lambda _: bool(acts[0]), out)

    @jax.custom_vjp
    def fn(x, *weights):
        return batched(x, *weights)

    def fwd(x, *weights):
        return batched(x, *weights), (x, weights)

    def bwd(saved, grad):
        x, weights = saved
        floats = [i for i, w in enumerate(weights) if jnp.issubdtype(w.dtype, jnp.floating)]

        def ref(x, *float_weights):
            full = list(weights)
            for i, w in zip(floats, float_weights, strict=True):
                full[i] = w
            return reference(x, *full)

        _, vjp = jax.vjp(ref, x, *(weights[i] for i in floats))
        grads = vjp(grad)
        out = [None] * len(weights)
        for i, g in zip(floats, grads[1:], strict=True):
            out[i] = g
        return (grads[0], *out)

    fn.defvjp(fwd, bwd)
    return fn
