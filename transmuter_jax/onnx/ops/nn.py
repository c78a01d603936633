"""Neural-network ops: matrix products, convolution, pooling, normalization, softmax, attention."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ... import kernels
from .. import provenance
from ..prepack import DOMAIN as PACKED
from ..registry import op
from ..trace import is_static
from . import attention_core as core
from ._util import ints, precision, transposed, xp


def _matmul(a, b):
    """a @ b; with JAX at full float32 precision (no TF32 / bf16 passes on accelerators). Two
    batched float32 operands with a few rows of ``a`` (attention's weighted values) run
    kernels.matmul_nn."""
    m = xp(a, b)
    if m is np:
        return np.matmul(a, b)
    if not is_static(a) and not is_static(b):
        out = _grouped(a, b, _values, list(range(np.ndim(b))))
        if out is None:
            out = _values(a, b)
        if out is not None:
            return out
    return jnp.matmul(a, b, precision=precision())


def _values(a, x):
    """kernels.matmul_nn(a, x), reading the parts of a joined x (a cache and a step's rows,
    onnx.provenance) where they are."""
    parts = provenance.joined(x)
    out = None if parts is None else kernels.matmul_nn(a, *parts)
    return kernels.matmul_nn(a, x) if out is None else out


def _scores(a, x, scale):
    """kernels.matmul_nt(a, x, scale), over the parts of a joined x where it is one (each
    output computed alone: the same bits)."""
    parts = provenance.joined(x)
    if parts is not None:
        outs = [kernels.matmul_nt(a, p, scale) for p in parts]
        if all(o is not None for o in outs):
            return jnp.concatenate(outs, axis=-1)
    return kernels.matmul_nt(a, x, scale)


def _grouped(a, b, product, axes):
    """``product(a, b)`` where ``b`` repeats each head of x [B, Nk, T, H] for a group of ``g``
    query heads (onnx.provenance), computed as ``product`` of a's heads of each group as rows
    against x read once (the same values, each output computed alike), with x's axes in the
    order ``axes``; None where b is no such value or ``product`` does not run it."""
    found = provenance.repeated(b)
    if found is None or np.ndim(a) != 4 or list(axes[:2]) != [0, 1]:
        return None
    x, groups = found
    batch, heads, rows, k = np.shape(a)
    if heads != np.shape(x)[1] * groups:
        return None
    x = x if list(axes) == [0, 1, 2, 3] else jnp.transpose(x, axes)
    out = product(jnp.reshape(a, (batch, heads // groups, groups * rows, k)), x)
    return None if out is None else jnp.reshape(out, (batch, heads, rows, out.shape[-1]))


# --- matrix products ------------------------------------------------------------------------


@op("MatMul")
def MatMul(a, b):
    return _matmul(a, b)


@op("Gemm")
def Gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, broadcast=0):
    """alpha * A' @ B' + beta * C; ``broadcast`` (opset < 7) is implied by numpy broadcasting."""
    a = a.T if transA else a
    b = b.T if transB else b
    return _gemm_tail(_matmul(a, b), c, alpha, beta)  # [M, N]


def _gemm_tail(y, c, alpha, beta):
    dtype = y.dtype
    if alpha != 1.0:
        y = (y * alpha).astype(dtype)
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c).astype(dtype)
    return y


# Internal ops of weights packed at load time (see transmuter_jax.onnx.prepack).


@op("PackedMatMul", domain=PACKED, fold=False)
def PackedMatMul(a, packed, *, n, tokens=0):
    """a @ w, w [K, N] float32 held packed in strips; ``tokens``: a's rows are the step's tokens
    (see prepack.mark_tokens)."""
    return kernels.matmul(a, packed, n, tokens=bool(tokens))


@op("PackedGateUp", domain=PACKED, fold=False)
def PackedGateUp(a, gate, up, *, n, tokens=0):
    """``SiluMul(PackedMatMul(a, gate), PackedMatMul(a, up))``, fused at load (see onnx.fuse):
    both products and the gated activation in one kernel call, with the three ops' values."""
    return kernels.matmul_gate_up(a, gate, up, n, tokens=bool(tokens))


@op("PackedSkipNorm", domain=PACKED, fold=False)
def PackedSkipNorm(a, packed, skip, gamma, *, n, tokens=0, epsilon=1e-12, ctx):
    """``SkipSimplifiedLayerNormalization(PackedMatMul(a, w), skip, gamma)``, fused at load (see
    onnx.fuse): on the kernels one call computes the product, its sum with ``skip`` and the
    sum's RMS norm, with the two ops' values; outputs (y, mean, inv_std, sum) as the norm's."""
    from .attention import SkipSimplifiedLayerNormalization, rms_scaled, skip_rms_outputs

    def reference(x, skip, w, g):
        v = jnp.matmul(x, w) + skip
        return rms_scaled(v, g, epsilon), v

    floats = all(jnp.result_type(v) == jnp.float32 for v in (a, skip, gamma))
    out = None
    if floats:
        out = kernels.matmul_skip_norm(a, packed, skip, gamma, n, epsilon, reference,
                                       tokens=bool(tokens))  # fmt: skip
    if out is None:
        product = kernels.matmul(a, packed, n, tokens=bool(tokens))
        return SkipSimplifiedLayerNormalization(product, skip, gamma, epsilon=epsilon, ctx=ctx)
    y, total = out
    return skip_rms_outputs(y, total, epsilon, ctx.num_outputs)


@op("PackedGemm", domain=PACKED, fold=False)
def PackedGemm(a, packed, c=None, *, n, alpha=1.0, beta=1.0, transA=0, tokens=0):
    """Gemm with B' = w held packed in strips."""
    a = a.T if transA else a
    y = kernels.matmul(a, packed, n, tokens=bool(tokens) and not transA)
    return _gemm_tail(y, c, alpha, beta)


@op("PackedGather", domain=PACKED, fold=False)
def PackedGather(packed, indices, *, n, columns):
    """Rows of w (columns=0) or of w^T (columns=1), w held packed in strips."""
    return kernels.columns(packed, indices, n) if columns else kernels.rows(packed, indices, n)


@op("SiluMul", domain=PACKED, fold=False)
def SiluMul(gate, up):
    """(gate * Sigmoid(gate)) * up: SwiGLU's gate, fused at load (see onnx.fuse)."""
    return kernels.silu_mul(gate, up)


@op("TransposedMatMul", domain=PACKED, fold=False)
def TransposedMatMul(a, b, scale=None, *, perm_a=(), perm_b=()):
    """MatMul(Transpose(a, perm_a), Transpose(b, perm_b) * scale) (an empty perm: as it is; no
    scale: 1), fused at load (see onnx.fuse). A float32 product over a transposed cache of keys
    runs kernels.matmul_nt (no transposed copy); values split into heads (b's rows kept whole)
    run a @ b transposed (kernels.matmul_nn); others one dot_general of a and b as they are.
    Operands whose batch dimensions broadcast take the plain path."""
    rank_a, rank_b = np.ndim(a), np.ndim(b)
    pa, pb = list(perm_a) or list(range(rank_a)), list(perm_b) or list(range(rank_b))
    m = xp(a, b, scale)
    shape_a = [np.shape(a)[i] for i in pa]
    shape_b = [np.shape(b)[i] for i in pb]
    plain = (
        m is np
        or rank_a != rank_b
        or rank_a < 2
        or shape_a[:-2] != shape_b[:-2]
        or shape_a[-1] != shape_b[-2]
        or a.dtype != b.dtype
        or (
            scale is not None
            and (
                not is_static(scale)
                or np.dtype(scale.dtype) != b.dtype
                or np.size(scale) != 1
                or np.ndim(scale) > rank_b  # a Mul that adds axes
            )
        )
    )
    if plain:
        bt = m.transpose(b, pb)
        return _matmul(m.transpose(a, pa), bt if scale is None else bt * scale)
    c = None if scale is None else float(np.asarray(scale).reshape(-1)[0])
    keys = [*pb[:-2], pb[-1], pb[-2]]
    if pa == list(range(rank_a)) and keys[-1] != rank_b - 1 and pb[-1] == rank_b - 1:
        # b's rows stay whole in b transposed (attention's values split into heads): a @ that
        # copy, not a @ (a copy with b's last axis moved)^T
        bt = transposed(b, pb)
        return _matmul(a, bt if c is None else bt * np.asarray(c, b.dtype))
    if pa == list(range(rank_a)):  # a @ x^T, x = b with the axes of pb but its last two swapped
        out = _grouped(a, b, lambda a, x: _scores(a, x, c), keys)
        if out is not None:
            return out
        x = b if keys == list(range(rank_b)) else transposed(b, keys)  # as stored, or the
        out = _scores(a, x, c)  # keys' copy an attention's cache output makes too
        if out is not None:
            return out
    if c is not None:  # the graph's Mul, on b as it is (the same values)
        b = b * np.asarray(c, b.dtype)
    dims = (((pa[-1],), (pb[-2],)), (tuple(pa[:-2]), tuple(pb[:-2])))
    return lax.dot_general(a, b, dims, precision=precision())


@op("SoftmaxAttention", domain=PACKED, fold=False)
def SoftmaxAttention(
    a, b, v, within=None, scale=None, *, divide=0, perm_a=(), perm_b=(), perm_b_v=()
):
    """MatMul(Softmax(S [* scale, or / scale with ``divide``], axis=-1), Transpose(v, perm_b_v)),
    S = TransposedMatMul(a, b, within, perm_a, perm_b) (a MatMul without perms or ``within``;
    an empty perm: as it is), fused at load (see onnx.fuse). Float32 self-attention (S's
    operands [B, N, S, H] and [B, N, H, S], v [B, N, S, H]) runs kernels.attention without a
    mask (a divided scale as its reciprocal's product) on q, k and v tokens first, where XLA
    cancels the graph's split into heads (no transposed copies); others the ops themselves."""
    m = xp(a, b, v, within, scale)
    v = m.transpose(v, list(perm_b_v)) if perm_b_v else v
    c = _scalar(scale)
    if m is not np and (scale is None or c is not None) and (within is None or _scalar(within)):
        rank_a, rank_b = np.ndim(a), np.ndim(b)
        q = jnp.transpose(a, list(perm_a) or range(rank_a))
        k = jnp.transpose(b, list(perm_b) or range(rank_b))
        k = k if within is None else k * jnp.asarray(within, k.dtype).reshape(())
        shapes = [np.shape(x) for x in (q, k, v)]
        if (
            all(len(s) == 4 for s in shapes)
            and all(np.dtype(x.dtype) == np.float32 for x in (q, k, v))
            and shapes[1] == (*shapes[0][:2], shapes[0][3], shapes[0][2])
            and shapes[2] == shapes[0]
        ):
            total = jnp.full((shapes[0][0],), shapes[0][2], jnp.int32)
            if c is not None and divide:
                c = 1.0 / c
            out = kernels.attention(  # q, k and v tokens first: the heads' split as written
                jnp.transpose(q, (0, 2, 1, 3)),
                jnp.transpose(k, (0, 3, 1, 2)),
                jnp.transpose(v, (0, 2, 1, 3)),
                total,
                scale=1.0 if c is None else c,
                causal=False,
                tokens_first=True,
            )
            if out is not None:
                return jnp.transpose(out, (0, 2, 1, 3))
    if within is None and not perm_a and not perm_b:
        scores = _matmul(a, b)
    else:
        scores = TransposedMatMul(a, b, within, perm_a=perm_a, perm_b=perm_b)
    if scale is not None:
        scores = scores / scale if divide else scores * scale
    return _matmul(_softmax(scores, -1), v)


def _scalar(value) -> float | None:
    """A nonzero static scalar's value as a float, else None."""
    if value is None or not is_static(value) or np.size(value) != 1:
        return None
    c = float(np.asarray(value).reshape(-1)[0])
    return c if c != 0 else None


@op("MatMulInteger", since=10)
def MatMulInteger(a, b, a_zero_point=None, b_zero_point=None):
    """(A - a_zero_point) @ (B - b_zero_point) in int32; a 1-D a_zero_point is per row of A."""
    m = xp(a, b, a_zero_point, b_zero_point)
    a = m.asarray(a).astype(np.int32)
    b = m.asarray(b).astype(np.int32)
    if a_zero_point is not None:
        za = m.asarray(a_zero_point).astype(np.int32)
        a = a - (za.reshape(-1, 1) if za.ndim == 1 else za)  # per row: [M, 1]
    if b_zero_point is not None:
        b = b - m.asarray(b_zero_point).astype(np.int32)  # per column: [N]
    if m is np:
        return np.matmul(a, b).astype(np.int32)
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)


@op("Einsum", since=12)
def Einsum(*inputs, equation):
    equation = equation.replace(" ", "")
    if xp(*inputs) is np:
        return np.einsum(equation, *inputs)
    return jnp.einsum(equation, *inputs, precision=precision())


# --- convolution ----------------------------------------------------------------------------


def _spatial(value, n: int, default: int) -> list[int]:
    return [int(v) for v in value] if value else [default] * n


def _same_pads(auto_pad: str, total: int) -> tuple[int, int]:
    """(begin, end) splitting ``total`` padding; SAME_UPPER puts the odd one at the end."""
    small = total // 2
    return (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)


def _window_pads(auto_pad, sizes, kernel, strides, dilations, pads) -> list[tuple[int, int]]:
    """The (begin, end) padding of each spatial axis for a convolution or a pooling window."""
    n = len(sizes)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        result = []
        for size, k, s, d in zip(sizes, kernel, strides, dilations, strict=True):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            result.append(_same_pads(auto_pad, total))
        return result
    if auto_pad == "VALID" or not pads:
        return [(0, 0)] * n
    return [(int(pads[i]), int(pads[i + n])) for i in range(n)]


def _channel(v, ndim: int):
    """A per-channel vector [C] (or [C, D1, ...]) shaped to broadcast over [N, C, D1, ...]."""
    return v.reshape(v.shape + (1,) * (ndim - 1 - v.ndim))


@op("Conv")
def Conv(
    x,
    w,
    b=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    """N-D convolution; x: [N, C, D1, ...], w: [M, C / group, k1, ...], b: [M]."""
    n = x.ndim - 2
    strides = _spatial(strides, n, 1)
    dilations = _spatial(dilations, n, 1)
    padding = _window_pads(auto_pad, x.shape[2:], w.shape[2:], strides, dilations, pads)
    x = jnp.asarray(x)
    w = jnp.asarray(w).astype(x.dtype)
    y = lax.conv_general_dilated(
        x,
        w,
        window_strides=strides,
        padding=padding,
        rhs_dilation=dilations,
        feature_group_count=group,
        precision=precision(),
    )  # y: [N, M, O1, ...]
    if b is not None:
        y = y + _channel(jnp.asarray(b).astype(y.dtype), y.ndim)
    return y


@op("ConvTranspose")
def ConvTranspose(
    x,
    w,
    b=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    output_padding=None,
    output_shape=None,
    pads=None,
    strides=None,
):
    """N-D transposed convolution; x: [N, C, D1, ...], w: [C, M / group, k1, ...], b: [M]."""
    n = x.ndim - 2
    sizes, kernel = x.shape[2:], w.shape[2:]
    strides = _spatial(strides, n, 1)
    dilations = _spatial(dilations, n, 1)
    extra = _spatial(output_padding, n, 0)
    full = [
        s * (i - 1) + e + (k - 1) * d + 1
        for i, k, s, d, e in zip(sizes, kernel, strides, dilations, extra, strict=True)
    ]
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = (
            [int(v) for v in output_shape][-n:]
            if output_shape
            else [i * s for i, s in zip(sizes, strides, strict=True)]
        )
        padding = [_same_pads(auto_pad, f - t) for f, t in zip(full, target, strict=True)]
    else:
        padding = _window_pads("NOTSET", sizes, kernel, strides, dilations, pads)
    # A transposed convolution is a convolution of the stride-dilated input with the flipped
    # kernel, in and out channels swapped within each group.
    x = jnp.asarray(x)
    c, m_per_group = w.shape[0], w.shape[1]
    w = jnp.asarray(w).astype(x.dtype).reshape((group, c // group, m_per_group) + kernel)
    w = jnp.swapaxes(w, 1, 2).reshape((group * m_per_group, c // group) + kernel)
    w = jnp.flip(w, axis=tuple(range(2, n + 2)))  # w: [M, C / group, k1, ...]
    conv_pads = [
        ((k - 1) * d - begin, (k - 1) * d - end + e)
        for k, d, (begin, end), e in zip(kernel, dilations, padding, extra, strict=True)
    ]
    y = lax.conv_general_dilated(
        x,
        w,
        window_strides=[1] * n,
        padding=conv_pads,
        lhs_dilation=strides,
        rhs_dilation=dilations,
        feature_group_count=group,
        precision=precision(),
    )  # y: [N, M, O1, ...]
    if b is not None:
        y = y + _channel(jnp.asarray(b).astype(y.dtype), y.ndim)
    return y


# --- pooling --------------------------------------------------------------------------------


def _pool_geometry(x, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode):
    """Strides, dilations, explicit (begin, end) pads, the output sizes and the (begin, end)
    padding the windows need (explicit pads plus what ceil_mode adds at the end)."""
    n = x.ndim - 2
    sizes = x.shape[2:]
    kernel = [int(k) for k in kernel_shape]
    strides = _spatial(strides, n, 1)
    dilations = _spatial(dilations, n, 1)
    explicit = _window_pads(auto_pad, sizes, kernel, strides, dilations, pads)
    outs, window = [], []
    for size, k, s, d, (lo, hi) in zip(sizes, kernel, strides, dilations, explicit, strict=True):
        span = size + lo + hi - (k - 1) * d - 1
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= size + lo:
            out -= 1  # the last window would start in the end padding
        outs.append(out)
        window.append((lo, max(hi, (out - 1) * s + (k - 1) * d + 1 - size - lo)))
    return kernel, strides, dilations, explicit, outs, window


def _reduce_window(x, init, reducer, kernel, strides, dilations, window, outs):
    """``reducer`` over each window of the spatial axes of x: [N, C, D1, ...] -> [N, C, O1, ...]."""
    y = lax.reduce_window(
        jnp.asarray(x),
        init,
        reducer,
        (1, 1, *kernel),
        (1, 1, *strides),
        [(0, 0), (0, 0), *window],
        window_dilation=(1, 1, *dilations),
    )
    return y[(slice(None), slice(None), *(slice(0, o) for o in outs))]


def _lowest(dtype):
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating):
        return -np.inf
    return np.iinfo(dtype).min


@op("MaxPool")
def MaxPool(
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    dilations=None,
    kernel_shape,
    pads=None,
    storage_order=0,
    strides=None,
    ctx,
):
    """Max over windows; the optional Indices output indexes the flattened x (column-major
    spatial axes when storage_order is 1)."""
    kernel, strides, dilations, _, outs, window = _pool_geometry(
        x, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    x = jnp.asarray(x)
    lowest = jnp.array(_lowest(x.dtype), x.dtype)
    if ctx.num_outputs < 2:
        return _reduce_window(x, lowest, lax.max, kernel, strides, dilations, window, outs)
    # Carry each value's row-major index; ties keep the first (smallest) index.
    index = jnp.arange(x.size, dtype=jnp.int32).reshape(x.shape)

    def pick(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = (vb > va) | ((vb == va) & (ib < ia))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    y, i = lax.reduce_window(
        (x, index),
        (lowest, jnp.array(np.iinfo(np.int32).max, jnp.int32)),
        pick,
        (1, 1, *kernel),
        (1, 1, *strides),
        [(0, 0), (0, 0), *window],
        window_dilation=(1, 1, *dilations),
    )
    crop = (slice(None), slice(None), *(slice(0, o) for o in outs))
    y, i = y[crop], i[crop]
    if storage_order:
        spatial = x.shape[2:]
        step = math.prod(spatial)
        coords = jnp.unravel_index(i % step, spatial)
        column = sum(c * math.prod(spatial[:k]) for k, c in enumerate(coords))
        i = i // step * step + column
    return y, i


@op("AveragePool")
def AveragePool(
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    count_include_pad=0,
    dilations=None,
    kernel_shape,
    pads=None,
    strides=None,
):
    """Mean over windows; padding counts when count_include_pad is 1, ceil_mode's extra end
    positions never do."""
    kernel, strides, dilations, explicit, outs, window = _pool_geometry(
        x, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    x = jnp.asarray(x)
    total = _reduce_window(
        x, jnp.array(0, x.dtype), lax.add, kernel, strides, dilations, window, outs
    )
    valid = explicit if count_include_pad else [(0, 0)] * len(kernel)
    counts = _counts(x.shape[2:], kernel, strides, dilations, window, valid, outs)
    return total / jnp.asarray(counts, x.dtype)


def _counts(sizes, kernel, strides, dilations, window, valid, outs) -> np.ndarray:
    """How many positions of each window lie in the input extended by ``valid`` padding: [O1, ...]."""
    counts = np.ones((), np.int64)
    for size, k, s, d, (lo, _), (vlo, vhi), out in zip(
        sizes, kernel, strides, dilations, window, valid, outs, strict=True
    ):
        pos = np.arange(out)[:, None] * s - lo + np.arange(k)[None, :] * d  # pos: [O, k]
        inside = (pos >= -vlo) & (pos < size + vhi)
        counts = np.multiply.outer(counts, inside.sum(axis=1))
    return np.maximum(counts, 1)


@op("LpPool")
def LpPool(
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    dilations=None,
    kernel_shape,
    p=2,
    pads=None,
    strides=None,
):
    """(sum |x|^p)^(1/p) over windows."""
    kernel, strides, dilations, _, outs, window = _pool_geometry(
        x, kernel_shape, auto_pad, pads, strides, dilations, ceil_mode
    )
    x = jnp.asarray(x)
    p = float(p)
    total = _reduce_window(
        jnp.abs(x) ** p, jnp.array(0, x.dtype), lax.add, kernel, strides, dilations, window, outs
    )
    return total ** (1.0 / p)


@op("GlobalAveragePool")
def GlobalAveragePool(x):
    return xp(x).mean(x, axis=tuple(range(2, x.ndim)), keepdims=True)


@op("GlobalMaxPool")
def GlobalMaxPool(x):
    return xp(x).max(x, axis=tuple(range(2, x.ndim)), keepdims=True)


@op("GlobalLpPool", since=2)
def GlobalLpPool(x, *, p=2):
    m = xp(x)
    p = float(p)
    return (m.sum(m.abs(x) ** p, axis=tuple(range(2, x.ndim)), keepdims=True) ** (1.0 / p)).astype(
        x.dtype
    )


# --- normalization --------------------------------------------------------------------------


def _stash(x, stash_type: int):
    """x in the precision of the statistics: float32 when stash_type is 1."""
    return x.astype(np.float32) if stash_type == 1 else x


@op("BatchNormalization")
def BatchNormalization(
    x,
    scale,
    bias,
    mean,
    var,
    *,
    epsilon=1e-5,
    momentum=0.9,
    training_mode=0,
    spatial=1,
    is_test=0,
    consumed_inputs=None,
    ctx,
):
    """Normalizes x: [N, C, D1, ...] per channel with the running statistics; in training mode
    (or when the old opsets' statistics outputs are asked for) with the batch's, returning the
    updated running mean and variance as well."""
    m = xp(x, scale, bias, mean, var)
    nd = x.ndim
    if not training_mode and ctx.num_outputs == 1:
        inv = 1 / m.sqrt(_channel(var, nd) + epsilon)
        return (x - _channel(mean, nd)) * inv * _channel(scale, nd) + _channel(bias, nd)
    axes = (0, *range(2, nd)) if spatial else (0,)
    batch_mean = m.mean(x, axis=axes)  # [C] (or [C, D1, ...] when not spatial)
    batch_var = m.var(x, axis=axes)
    inv = 1 / m.sqrt(_channel(batch_var, nd) + epsilon)
    y = (x - _channel(batch_mean, nd)) * inv * _channel(scale, nd) + _channel(bias, nd)
    running_mean = mean * momentum + batch_mean * (1 - momentum)
    running_var = var * momentum + batch_var * (1 - momentum)
    return (y, running_mean, running_var, batch_mean, batch_var)[: ctx.num_outputs]


@op("InstanceNormalization")
def InstanceNormalization(x, scale, bias, *, epsilon=1e-5):
    """Normalizes each [N, C] slice of x: [N, C, D1, ...] over its spatial axes."""
    m = xp(x, scale, bias)
    axes = tuple(range(2, x.ndim))
    mean = m.mean(x, axis=axes, keepdims=True)
    var = m.mean(m.square(x - mean), axis=axes, keepdims=True)
    return (x - mean) / m.sqrt(var + epsilon) * _channel(scale, x.ndim) + _channel(bias, x.ndim)


@op("LayerNormalization", since=17)
def LayerNormalization(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1, ctx):
    """Normalizes x over the axes from ``axis`` on; optional outputs Mean and InvStdDev have
    x's shape with those axes of size 1."""
    m = xp(x, scale, bias)
    axes = tuple(range(axis % x.ndim, x.ndim))
    xs = _stash(x, stash_type)
    mean = m.mean(xs, axis=axes, keepdims=True)
    inv = 1 / m.sqrt(m.mean(m.square(xs - mean), axis=axes, keepdims=True) + epsilon)
    y = ((xs - mean) * inv).astype(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return (y, mean, inv)[: ctx.num_outputs]


def _group_norm(x, num_groups: int, epsilon: float, stash_type: int):
    """x: [N, C, D1, ...] normalized over each group of C / num_groups channels."""
    m = xp(x)
    shape = x.shape
    xs = _stash(x, stash_type).reshape(shape[0], num_groups, -1)  # xs: [N, G, C / G * D]
    mean = m.mean(xs, axis=-1, keepdims=True)
    var = m.mean(m.square(xs - mean), axis=-1, keepdims=True)
    return ((xs - mean) / m.sqrt(var + epsilon)).reshape(shape).astype(x.dtype)


@op("GroupNormalization", since=18)
def GroupNormalization_18(x, scale, bias, *, epsilon=1e-5, num_groups):
    """Group norm with scale and bias per group: [num_groups]."""
    m = xp(x, scale, bias)
    per_channel = x.shape[1] // num_groups
    scale = m.repeat(scale, per_channel)  # [C]
    bias = m.repeat(bias, per_channel)
    y = _group_norm(x, num_groups, epsilon, 0)
    return y * _channel(scale, x.ndim) + _channel(bias, x.ndim)


@op("GroupNormalization", since=21)
def GroupNormalization(x, scale, bias, *, epsilon=1e-5, num_groups, stash_type=1):
    """Group norm with scale and bias per channel: [C]."""
    y = _group_norm(x, num_groups, epsilon, stash_type)
    return y * _channel(scale, x.ndim) + _channel(bias, x.ndim)


def _rms_inv(m, xs, axis: int, epsilon: float):
    """1 / sqrt(mean(x^2) + epsilon) over the axes from ``axis`` on, kept as size-1 axes."""
    axes = tuple(range(axis % xs.ndim, xs.ndim))
    return 1 / m.sqrt(m.mean(m.square(xs), axis=axes, keepdims=True) + epsilon)


@op("RMSNormalization", since=23)
def RMSNormalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    m = xp(x, scale)
    xs = _stash(x, stash_type)
    return (xs * _rms_inv(m, xs, axis, epsilon)).astype(x.dtype) * scale


@op("SimplifiedLayerNormalization")
def SimplifiedLayerNormalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1, ctx):
    """onnxruntime's RMS norm (default domain); optional output inv_std_var has x's shape with
    the normalized axes of size 1."""
    m = xp(x, scale)
    xs = _stash(x, stash_type)
    inv = _rms_inv(m, xs, axis, epsilon)
    if m is jnp and _last_axis_f32(x, xs, scale, axis) and xs.shape[-1] % 8 == 0:
        # onnxruntime's float steps (an int8 product after it turns one ulp into a step)
        ref = lambda v, g: (v * _rms_inv(jnp, v, -1, epsilon)) * g  # noqa: E731
        y = kernels.rms_norm(xs, scale, epsilon, kernels.RMS_SIMPLIFIED, ref)
        return (y, inv)[: ctx.num_outputs]
    y = (xs * inv).astype(x.dtype) * scale
    return (y, inv)[: ctx.num_outputs]


def _last_axis_f32(x, xs, scale, axis: int) -> bool:
    """Whether a norm over the last axis of float32 x with a [K] float32 scale."""
    return (
        axis % xs.ndim == xs.ndim - 1
        and x.dtype == jnp.float32
        and xs.dtype == jnp.float32
        and jnp.shape(scale) == (xs.shape[-1],)
        and jnp.asarray(scale).dtype == jnp.float32
    )


@op("LRN")
def LRN(x, *, alpha=1e-4, beta=0.75, bias=1.0, size):
    """x / (bias + alpha / size * sum of x^2 over ``size`` neighbouring channels)^beta."""
    m = xp(x)
    before, after = (size - 1) // 2, -(-(size - 1) // 2)
    sq = m.pad(m.square(x), [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    channels = x.shape[1]
    square_sum = sum(sq[:, i : i + channels] for i in range(size))  # [N, C, D1, ...]
    return x / (bias + alpha / size * square_sum) ** beta


@op("MeanVarianceNormalization", since=9)
def MeanVarianceNormalization(x, *, axes=(0, 2, 3)):
    """(x - mean) / sqrt(variance) over ``axes`` (1e-9 added to the deviation, as in the spec's
    function body)."""
    m = xp(x)
    axes = tuple(int(a) for a in axes)
    mean = m.mean(x, axis=axes, keepdims=True)
    var = m.maximum(m.mean(m.square(x), axis=axes, keepdims=True) - m.square(mean), 0)
    return (x - mean) / (m.sqrt(var) + 1e-9)


@op("LpNormalization")
def LpNormalization(x, *, axis=-1, p=2):
    """x divided by its L1 or L2 norm along ``axis`` (0 where the norm is 0)."""
    m = xp(x)
    if p == 1:
        norm = m.sum(m.abs(x), axis=axis, keepdims=True)
    else:
        norm = m.sqrt(m.sum(m.square(x), axis=axis, keepdims=True))
    return m.where(norm == 0, 0, x / m.where(norm == 0, 1, norm)).astype(x.dtype)


# --- softmax --------------------------------------------------------------------------------


def _softmax(x, axis):
    m = xp(x)
    if m is not np and axis in (-1, np.ndim(x) - 1):  # the CPU kernel, where it runs
        out = kernels.softmax(x)
        if out is not None:
            return out
    e = m.exp(x - m.max(x, axis=axis, keepdims=True))
    return e / m.sum(e, axis=axis, keepdims=True)


def _log_softmax(x, axis):
    m = xp(x)
    shifted = x - m.max(x, axis=axis, keepdims=True)
    return shifted - m.log(m.sum(m.exp(shifted), axis=axis, keepdims=True))


def _hardmax(x, axis):
    m = xp(x)
    first = m.expand_dims(m.argmax(x, axis=axis), axis)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return (m.arange(x.shape[axis]).reshape(shape) == first).astype(x.dtype)


def _on_2d(fn, x, axis):
    """fn over the last axis of x flattened to 2-D at ``axis`` (the opset < 13 semantics)."""
    m = xp(x)
    axis = axis % x.ndim if x.ndim else 0
    rows = math.prod(x.shape[:axis])
    return m.reshape(fn(m.reshape(x, (rows, -1)), 1), x.shape)


@op("Softmax")
def Softmax_1(x, *, axis=1):
    """Softmax of x flattened to 2-D at ``axis`` (opsets 1-12)."""
    return _on_2d(_softmax, x, axis)


@op("Softmax", since=13)
def Softmax(x, *, axis=-1):
    """Softmax along ``axis``."""
    return _softmax(x, axis)


@op("LogSoftmax")
def LogSoftmax_1(x, *, axis=1):
    """LogSoftmax of x flattened to 2-D at ``axis`` (opsets 1-12)."""
    return _on_2d(_log_softmax, x, axis)


@op("LogSoftmax", since=13)
def LogSoftmax(x, *, axis=-1):
    """LogSoftmax along ``axis``."""
    return _log_softmax(x, axis)


@op("Hardmax")
def Hardmax_1(x, *, axis=1):
    """Hardmax of x flattened to 2-D at ``axis`` (opsets 1-12)."""
    return _on_2d(_hardmax, x, axis)


@op("Hardmax", since=13)
def Hardmax(x, *, axis=-1):
    """Hardmax along ``axis``."""
    return _hardmax(x, axis % x.ndim)


# --- dropout --------------------------------------------------------------------------------


@op("Dropout")
def Dropout_1(x, *, ratio=0.5, is_test=0, consumed_inputs=None, ctx):
    """Inference: identity; the optional mask (of x's type before opset 10) is all ones."""
    return (x, xp(x).ones_like(x))[: ctx.num_outputs]


@op("Dropout", since=10)
def Dropout_10(x, *, ratio=0.5, ctx):
    """Inference: identity; the optional boolean mask is all True."""
    return (x, xp(x).ones(x.shape, bool))[: ctx.num_outputs]


@op("Dropout", since=12, prefer_static=(1, 2))
def Dropout(x, ratio=None, training_mode=None, *, seed=None, ctx):
    """Inference: identity with an all-True mask. Training mode is random and not supported,
    unless ratio is 0."""
    if training_mode is not None and not is_static(training_mode):
        raise NotImplementedError(
            f"{ctx.label}: Dropout's training_mode must be known at trace time"
        )
    training = training_mode is not None and bool(np.asarray(training_mode).reshape(-1)[0])
    no_drop = ratio is not None and is_static(ratio) and float(ratio.reshape(-1)[0]) == 0.0
    if training and not no_drop:
        raise NotImplementedError(f"{ctx.label}: Dropout in training mode is random; not supported")
    return (x, xp(x).ones(x.shape, bool))[: ctx.num_outputs]


# --- attention ------------------------------------------------------------------------------


@op("Attention", since=23)
def Attention(
    q,
    k,
    v,
    attn_mask=None,
    past_key=None,
    past_value=None,
    nonpad_kv_seqlen=None,
    *,
    is_causal=0,
    kv_num_heads=None,
    q_num_heads=None,
    qk_matmul_output_mode=0,
    scale=None,
    softcap=0.0,
    softmax_precision=None,
    left_window_size=-1,
    right_window_size=-1,
    ctx,
):
    """Scaled dot-product attention (opsets 23-25) on 4-D [B, H, S, D] or 3-D [B, S, H * D]
    inputs, with a KV cache, grouped KV heads, causal and sliding-window masks and softcap.

    Outputs: Y (q's layout), present_key and present_value ([B, KV, P + S, D]) and
    qk_matmul_output ([B, H, S, P + S]; which stage it shows is ``qk_matmul_output_mode``).
    Computed in float32 (``softmax_precision`` is met or exceeded).
    """
    dtype = jnp.asarray(q).dtype
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    three_d = q.ndim == 3
    if three_d:  # [B, S, H * D] -> q: [B, S, H, D]; k, v: [B, KV, L, D]
        q = core.split_heads(q, q_num_heads)
        k = core.split_heads(k, kv_num_heads).transpose(0, 2, 1, 3)
        v = core.split_heads(v, kv_num_heads).transpose(0, 2, 1, 3)
    else:
        q = q.transpose(0, 2, 1, 3)
    if past_key is not None:
        k = jnp.concatenate([jnp.asarray(past_key).astype(dtype), k], axis=2)
        v = jnp.concatenate([jnp.asarray(past_value).astype(dtype), v], axis=2)
    batch, q_len, heads, head_size = q.shape
    kv_len = k.shape[2]
    raw = core.grouped_scores(q, k, scale if scale is not None else 1 / math.sqrt(head_size))
    capped = core.cap(raw, softcap)  # [B, H, S, P + L]
    biased = capped if attn_mask is None else capped + _attention_bias(attn_mask, kv_len)
    allowed = _attention_visible(
        q_len, kv_len, past_key, nonpad_kv_seqlen, is_causal, left_window_size, right_window_size
    )
    probs = core.masked_softmax(biased, allowed)
    y = core.grouped_values(probs, v).astype(dtype)  # [B, S, H, Dv]
    y = y.reshape(batch, q_len, -1) if three_d else y.transpose(0, 2, 1, 3)
    if ctx.num_outputs < 4:
        return (y, k, v)[: ctx.num_outputs]
    masked = jnp.where(allowed, biased, -jnp.inf)
    qk_out = {0: raw, 1: capped, 2: masked, 3: probs}[qk_matmul_output_mode]
    qk_out = jnp.broadcast_to(qk_out, (batch, heads, q_len, kv_len)).astype(dtype)
    return y, k, v, qk_out


def _attention_bias(attn_mask, kv_len):
    """attn_mask as an additive float32 bias [..., S, P + L]: bool -> 0 / -inf; a mask shorter
    than the keys hides the keys after it."""
    mask = jnp.asarray(attn_mask)
    if mask.dtype == jnp.bool_:
        mask = jnp.where(mask, 0.0, -jnp.inf)
    mask = mask.astype(jnp.float32)
    pad = kv_len - mask.shape[-1]
    if pad > 0:
        mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return mask


def _attention_visible(q_len, kv_len, past_key, nonpad, causal, left, right):
    """[(B, 1,) S, P + L] bool: the causal and window masks at absolute positions, and the
    non-padding keys."""
    past_len = past_key.shape[2] if past_key is not None else 0
    if nonpad is not None and past_key is None:
        offset = jnp.asarray(nonpad).reshape(-1, 1, 1) - q_len  # [B, 1, 1]
    else:
        offset = past_len
    q_pos = jnp.arange(q_len) + offset  # [(B, 1,) S]
    allowed = core.visible(q_pos, jnp.arange(kv_len), causal=bool(causal), left=left, right=right)
    if nonpad is not None:
        valid = jnp.arange(kv_len) < jnp.asarray(nonpad).reshape(-1, 1, 1, 1)
        allowed = allowed & valid
    return allowed


@op("RotaryEmbedding", since=23)
def RotaryEmbedding(
    x,
    cos_cache,
    sin_cache,
    position_ids=None,
    *,
    interleaved=0,
    num_heads=0,
    rotary_embedding_dim=0,
):
    """Rotates the first ``rotary_embedding_dim`` features of each head of x: [B, H, S, D] or
    [B, S, H * D]. With position_ids [B, S] the caches are [max_position, R / 2] tables,
    without they are [B, S, R / 2]. Computed in float32 (see attention_core)."""
    shape = x.shape
    x = jnp.asarray(x)
    if x.ndim == 4:
        x = jnp.transpose(x, (0, 2, 1, 3))  # [B, S, H, D]
    else:
        x = x.reshape(shape[0], shape[1], num_heads, -1)
    half = (rotary_embedding_dim or x.shape[-1]) // 2
    cos, sin = jnp.asarray(cos_cache), jnp.asarray(sin_cache)
    if position_ids is not None:
        y = core.rotate_at(x, position_ids, cos[:, :half], sin[:, :half], interleaved)
    else:
        y = core.rotate(x, cos[..., :half], sin[..., :half], interleaved)
    if len(shape) == 4:
        return jnp.transpose(y, (0, 2, 1, 3))
    return y.reshape(shape)


# --- losses ---------------------------------------------------------------------------------


def _nll(log_prob, target, weight, ignore_index, reduction):
    """-log_prob[n, target[n, ...], ...] weighted by weight[target] (0 at ``ignore_index``),
    then reduced: none, sum, or mean (the sum over the sum of the weights)."""
    target = jnp.asarray(target).astype(jnp.int32)  # [N, d...]
    valid = jnp.ones(target.shape, bool) if ignore_index is None else target != ignore_index
    safe = jnp.where(valid, target, 0)
    picked = -jnp.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]  # [N, d...]
    if weight is None:
        w = jnp.ones(target.shape, log_prob.dtype)
    else:
        w = jnp.take(jnp.asarray(weight), safe, mode="clip").astype(log_prob.dtype)
    w = jnp.where(valid, w, 0)
    loss = picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / jnp.sum(w)


@op("NegativeLogLikelihoodLoss", since=12)
def NegativeLogLikelihoodLoss(input, target, weight=None, *, ignore_index=None, reduction="mean"):
    """The negative log likelihood of ``target`` [N, d...] under log-probabilities
    input [N, C, d...]."""
    return _nll(jnp.asarray(input), target, weight, ignore_index, reduction)


@op("SoftmaxCrossEntropyLoss", since=12)
def SoftmaxCrossEntropyLoss(
    scores, labels, weights=None, *, ignore_index=None, reduction="mean", ctx
):
    """The cross entropy of ``labels`` [N, d...] under softmax(scores [N, C, d...]) over C;
    outputs (loss, log_prob)."""
    log_prob = _log_softmax(jnp.asarray(scores), 1)
    loss = _nll(log_prob, labels, weights, ignore_index, reduction)
    return (loss, log_prob)[: max(ctx.num_outputs, 1)]


@op("Det", since=11)
def Det(x):
    """The determinant of each square matrix of x [..., M, M]."""
    return jnp.linalg.det(jnp.asarray(x))


@op("FlexAttention", domain="ai.onnx.preview", fold=False)
def FlexAttention(
    Q, K, V, *, scale=None, score_mod=None, prob_mod=None, softmax_precision=None, ctx
):
    """Attention of Q [B, Hq, L, E] over K, V [B, Hkv, S, E] with the graphs ``score_mod``
    (applied to the scaled scores) and ``prob_mod`` (to the probabilities); float32 inside."""
    q = jnp.asarray(Q).transpose(0, 2, 1, 3)  # [B, L, Hq, E]
    scores = core.grouped_scores(q, jnp.asarray(K), scale or 1 / math.sqrt(q.shape[-1]))
    if score_mod is not None:
        scores = jnp.asarray(ctx.run(score_mod, [scores])[0]).astype(jnp.float32)
    probs = core.masked_softmax(scores)
    if prob_mod is not None:
        probs = jnp.asarray(ctx.run(prob_mod, [probs])[0]).astype(jnp.float32)
    return core.grouped_values(probs, jnp.asarray(V)).transpose(0, 2, 1, 3).astype(V.dtype)


@op("ConvInteger", since=10)
def ConvInteger(
    x,
    w,
    x_zero_point=None,
    w_zero_point=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    """Conv of (x - x_zero_point) and (w - w_zero_point) (per output channel) in int32."""
    x = jnp.asarray(x).astype(jnp.int32)
    w = jnp.asarray(w).astype(jnp.int32)
    if x_zero_point is not None:
        x = x - jnp.asarray(x_zero_point).astype(jnp.int32).reshape(())
    if w_zero_point is not None:
        zp = jnp.asarray(w_zero_point).astype(jnp.int32)
        w = w - (zp.reshape(()) if zp.size == 1 else zp.reshape((-1,) + (1,) * (w.ndim - 1)))
    n = x.ndim - 2
    strides = _spatial(strides, n, 1)
    dilations = _spatial(dilations, n, 1)
    padding = _window_pads(auto_pad, x.shape[2:], w.shape[2:], strides, dilations, pads)
    return lax.conv_general_dilated(
        x,
        w,
        window_strides=strides,
        padding=padding,
        rhs_dilation=dilations,
        feature_group_count=group,
        preferred_element_type=jnp.int32,
    )


@op("MaxUnpool", since=9, static=(2,))
def MaxUnpool(X, I, output_shape=None, *, kernel_shape, pads=None, strides=None):
    """The values of X put back at the flat indices I (MaxPool's) of a zero tensor of the size
    the pooling came from, padded at the end to ``output_shape``."""
    n = X.ndim - 2
    strides = _spatial(strides, n, 1)
    pads = list(pads) if pads else [0] * (2 * n)
    spatial = [
        (X.shape[2 + i] - 1) * strides[i] + kernel_shape[i] - pads[i] - pads[i + n]
        for i in range(n)
    ]
    shape = [*X.shape[:2], *spatial]
    y = jnp.zeros((math.prod(shape),), jnp.asarray(X).dtype)
    y = y.at[jnp.asarray(I).reshape(-1).astype(jnp.int32)].set(jnp.asarray(X).reshape(-1))
    y = y.reshape(shape)
    if output_shape is not None:
        y = jnp.pad(y, [(0, t - h) for t, h in zip(ints(output_shape), shape, strict=True)])
    return y


@op("Col2Im", since=18, static=(1, 2))
def Col2Im(input, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """The sum of the blocks input [N, C * prod(block), L] at their places in an image
    [N, C, *image_shape] (the inverse of im2col)."""
    image, block = ints(image_shape), ints(block_shape)
    n = len(image)
    dilations = _spatial(dilations, n, 1)
    strides = _spatial(strides, n, 1)
    pads = list(pads) if pads else [0] * (2 * n)
    counts = [
        (image[i] + pads[i] + pads[i + n] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
        for i in range(n)
    ]
    # For each (block offset, block position) its place in the padded image, flattened.
    offsets = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), -1)
    places = np.stack(np.meshgrid(*[np.arange(c) for c in counts], indexing="ij"), -1)
    offsets, places = offsets.reshape(-1, n), places.reshape(-1, n)
    coords = places[None] * np.asarray(strides) + offsets[:, None] * np.asarray(dilations)
    coords = coords - np.asarray(pads[:n])  # [K, L, n] in the unpadded image
    inside = np.all((coords >= 0) & (coords < np.asarray(image)), axis=-1)  # [K, L]
    flat = np.ravel_multi_index(tuple(np.clip(coords, 0, np.asarray(image) - 1).T), image).T
    x = jnp.asarray(input)
    batch, k = x.shape[0], math.prod(block)
    x = x.reshape(batch, -1, k, x.shape[-1]) * inside  # [N, C, K, L]
    out = jnp.zeros((batch, x.shape[1], math.prod(image)), x.dtype)
    out = out.at[:, :, flat.reshape(-1)].add(x.reshape(batch, x.shape[1], -1))
    return out.reshape(batch, x.shape[1], *image)


@op("DeformConv", since=19)
def DeformConv(
    X,
    W,
    offset,
    B=None,
    mask=None,
    *,
    dilations=None,
    group=1,
    kernel_shape=None,
    offset_group=1,
    pads=None,
    strides=None,
):
    """2-D deformable convolution: each kernel tap of each output reads X [N, C, H, W]
    bilinearly (0 outside) at its place moved by offset [N, G*2*K, oH, oW] (dy, dx per tap),
    times mask [N, G*K, oH, oW]; W [M, C / group, kH, kW]."""
    x, w = jnp.asarray(X), jnp.asarray(W)
    n, c, height, width = x.shape
    kh, kw = w.shape[2:]
    strides, dilations = _spatial(strides, 2, 1), _spatial(dilations, 2, 1)
    pads = list(pads) if pads else [0] * 4
    off = jnp.asarray(offset).astype(jnp.float32)
    oh, ow = off.shape[2:]
    k = kh * kw
    off = off.reshape(n, offset_group, k, 2, oh, ow)
    tap_y = (np.arange(k) // kw * dilations[0])[:, None, None]
    tap_x = (np.arange(k) % kw * dilations[1])[:, None, None]
    base_y = (np.arange(oh) * strides[0] - pads[0])[None, :, None] + tap_y  # [K, oH, 1]
    base_x = (np.arange(ow) * strides[1] - pads[1])[None, None, :] + tap_x  # [K, 1, oW]
    y = base_y + off[:, :, :, 0]  # [N, G, K, oH, oW]
    xx = base_x + off[:, :, :, 1]
    y0, x0 = jnp.floor(y), jnp.floor(xx)
    planes = x.reshape(n, offset_group, c // offset_group, height * width).astype(jnp.float32)
    cols = 0.0
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        yc, xc = y0 + dy, x0 + dx
        weight = (1 - jnp.abs(y - yc)) * (1 - jnp.abs(xx - xc))
        inside = (yc >= 0) & (yc < height) & (xc >= 0) & (xc < width)
        flat = (jnp.clip(yc, 0, height - 1) * width + jnp.clip(xc, 0, width - 1)).astype(jnp.int32)
        values = jnp.take_along_axis(planes, flat.reshape(n, offset_group, 1, -1), axis=3)
        scale = jnp.where(inside, weight, 0.0).reshape(n, offset_group, 1, -1)
        cols = cols + values * scale  # [N, G, C / G, K * oH * oW]
    cols = cols.reshape(n, c, k, oh, ow)
    if mask is not None:
        m = jnp.asarray(mask).astype(jnp.float32).reshape(n, offset_group, 1, k, oh, ow)
        cols = (cols.reshape(n, offset_group, c // offset_group, k, oh, ow) * m).reshape(
            n, c, k, oh, ow
        )
    wg = w.reshape(group, w.shape[0] // group, c // group, k).astype(jnp.float32)
    cg = cols.reshape(n, group, c // group, k, oh, ow)
    out = jnp.einsum("gmck,ngckhw->ngmhw", wg, cg, precision=precision())
    out = out.reshape(n, w.shape[0], oh, ow)
    if B is not None:
        out = out + jnp.asarray(B).astype(jnp.float32)[None, :, None, None]
    return out.astype(x.dtype)


@op("QLinearConv", since=10)
def QLinearConv(
    x,
    x_scale,
    x_zero_point,
    w,
    w_scale,
    w_zero_point,
    y_scale,
    y_zero_point,
    B=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    """quantize(ConvInteger(x, w) * x_scale * w_scale (per output channel) + B, y_scale, y_zp)
    with an exact int32 convolution; rounds half to even and saturates to y_zero_point's type."""
    acc = ConvInteger(
        x,
        w,
        x_zero_point,
        w_zero_point,
        auto_pad=auto_pad,
        dilations=dilations,
        group=group,
        pads=pads,
        strides=strides,
    )
    if B is not None:
        acc = acc + _channel(jnp.asarray(B).astype(jnp.int32), acc.ndim)
    ws = jnp.asarray(w_scale).astype(jnp.float32)
    ws = ws.reshape(()) if ws.size == 1 else _channel(ws, acc.ndim)
    factor = jnp.asarray(x_scale).astype(jnp.float32).reshape(()) * ws
    y = jnp.round(acc.astype(jnp.float32) * factor / jnp.asarray(y_scale).astype(jnp.float32))
    zp = jnp.asarray(y_zero_point)
    info = jnp.iinfo(zp.dtype)
    return jnp.clip(y + zp.astype(jnp.float32), info.min, info.max).astype(zp.dtype)
