"""com.microsoft mixture-of-experts ops: MoE, and QMoE on integer-quantized expert weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import op
from ._util import precision

MS = "com.microsoft"


def _routing(router_probs, k, normalize):
    """Mixing weights [T, E]: the softmax of the router logits, kept for the top k experts of
    each token (renormalized over them when ``normalize``), 0 elsewhere."""
    probs = jax.nn.softmax(jnp.asarray(router_probs).astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, k)  # [T, k]
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    rows = jnp.arange(probs.shape[0])[:, None]
    return jnp.zeros_like(probs).at[rows, index].set(top)


def _linear(x, w, b):
    """x [T, K] through every expert's w [E, N, K] (+ b [E, N]) -> [T, E, N] in float32."""
    y = jnp.einsum("tk,enk->ten", x, w.astype(jnp.float32), precision=precision())
    return y if b is None else y + jnp.asarray(b).astype(jnp.float32)


def _activate(h, gate, kind, alpha, beta, limit, fusion):
    """The expert activation of fc1's output h [T, E, N] (times fc3's ``gate``, if given); gelu
    is the tanh approximation, as in onnxruntime's MoE."""
    if kind == "swiglu":
        if gate is not None:
            g, lin = h, gate
        elif fusion == 1:
            g, lin = h[..., 0::2], h[..., 1::2]
        else:
            half = h.shape[-1] // 2
            g, lin = h[..., :half], h[..., half:]
        if limit is not None:
            g, lin = jnp.minimum(g, limit), jnp.clip(lin, -limit, limit)
        return g * jax.nn.sigmoid(alpha * g) * (lin + beta)
    acts = {
        "relu": jax.nn.relu,
        "gelu": lambda v: jax.nn.gelu(v, approximate=True),
        "silu": jax.nn.silu,
        "identity": lambda v: v,
    }
    if kind not in acts:
        raise NotImplementedError(f"MoE with activation_type={kind!r}")
    out = acts[kind](h)
    return out if gate is None else out * gate


def _mixture(x, router_probs, w1, b1, w2, b2, w3, b3, *, k, normalize, sparse_mixer, **act):
    """The weighted sum over the top-k experts of fc2(act(fc1(x))) for each token row of x."""
    if sparse_mixer:
        raise NotImplementedError("MoE with use_sparse_mixer=1")
    x = jnp.asarray(x)
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [T, H]
    weights = _routing(router_probs, k, normalize)  # [T, E]
    gate = None if w3 is None else _linear(rows, w3, b3)
    h = _activate(_linear(rows, w1, b1), gate, **act)  # [T, E, I]
    y = jnp.einsum("tei,ehi->teh", h, w2.astype(jnp.float32), precision=precision())
    if b2 is not None:
        y = y + jnp.asarray(b2).astype(jnp.float32)
    out = jnp.einsum("te,teh->th", weights, y, precision=precision())
    return out.reshape(x.shape).astype(x.dtype)


@op("MoE", domain=MS)
def MoE(
    input,
    router_probs,
    fc1_experts_weights,
    fc1_experts_bias=None,
    fc2_experts_weights=None,
    fc2_experts_bias=None,
    fc3_experts_weights=None,
    fc3_experts_bias=None,
    *,
    activation_type="relu",
    k=1,
    normalize_routing_weights=0,
    use_sparse_mixer=0,
    activation_alpha=1.0,
    activation_beta=0.0,
    swiglu_fusion=0,
    swiglu_limit=None,
    swiglu_limit_after_activation=0,
):
    """Mixture of experts over input [T, H] or [B, S, H]; expert weights [E, N, K] (rows are
    outputs). Every expert runs on every token and weighs 0 outside the token's top k."""
    if swiglu_limit_after_activation:
        raise NotImplementedError("MoE with swiglu_limit_after_activation=1")
    return _mixture(
        input,
        router_probs,
        jnp.asarray(fc1_experts_weights),
        fc1_experts_bias,
        jnp.asarray(fc2_experts_weights),
        fc2_experts_bias,
        None if fc3_experts_weights is None else jnp.asarray(fc3_experts_weights),
        fc3_experts_bias,
        k=k,
        normalize=normalize_routing_weights,
        sparse_mixer=use_sparse_mixer,
        kind=activation_type,
        alpha=activation_alpha,
        beta=activation_beta,
        limit=swiglu_limit,
        fusion=swiglu_fusion,
    )


def _unpack(packed, bits):
    """uint8 [..., D] holding 8 / bits values per byte, low bits first -> int32 [..., D * 8 / bits]."""
    packed = jnp.asarray(packed).astype(jnp.int32)
    if bits == 8:
        return packed
    shifts = jnp.arange(8 // bits, dtype=jnp.int32) * bits
    values = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)


def _dequantize(packed, scales, zero_points, bits, block_size):
    """uint8 [E, N, K * bits / 8] -> float32 [E, N, K]: (q - zero_point) * scale, with a scale
    per row [E, N] or per block of ``block_size`` along K [E, N, K / block_size]; zero points
    packed like the weights (default 2^(bits - 1))."""
    q = _unpack(packed, bits).astype(jnp.float32)  # [E, N, K]
    scales = jnp.asarray(scales).astype(jnp.float32)  # [E, N] or [E, N, K / block_size]
    if zero_points is None:
        zp = jnp.full((), 1 << (bits - 1), jnp.float32)
    else:
        zp = _unpack(zero_points, bits)[..., : scales.shape[-1]].astype(jnp.float32)
    if not block_size:
        return (q - zp[..., None]) * scales[..., None]
    e, n, kk = q.shape
    blocks = q.reshape(e, n, kk // block_size, block_size)
    return ((blocks - zp[..., None]) * scales[..., None]).reshape(e, n, kk)


@op("QMoE", domain=MS)
def QMoE(
    input,
    router_probs,
    fc1_experts_weights,
    fc1_scales=None,
    fc1_experts_bias=None,
    fc2_experts_weights=None,
    fc2_scales=None,
    fc2_experts_bias=None,
    fc3_experts_weights=None,
    fc3_scales=None,
    fc3_experts_bias=None,
    fc1_zero_points=None,
    fc2_zero_points=None,
    fc3_zero_points=None,
    router_weights=None,
    *rest,
    activation_type="relu",
    k=1,
    normalize_routing_weights=0,
    use_sparse_mixer=0,
    activation_alpha=1.0,
    activation_beta=0.0,
    swiglu_fusion=0,
    swiglu_limit=None,
    swiglu_limit_after_activation=0,
    expert_weight_bits=4,
    fc1_expert_weight_bits=None,
    fc2_expert_weight_bits=None,
    fc3_expert_weight_bits=None,
    block_size=None,
    quant_type="int",
    accuracy_level=0,
    weights_prepacked=-1,
):
    """MoE on expert weights quantized to 4 or 8 bit integers (``quant_type='int'``), per row
    or per block of K; dequantized exactly, then as MoE."""
    if quant_type != "int" or router_weights is not None or any(r is not None for r in rest):
        raise NotImplementedError("QMoE other than integer weights with router_probs only")
    if swiglu_limit_after_activation:
        raise NotImplementedError("QMoE with swiglu_limit_after_activation=1")

    def weights(w, scales, zp, bits):
        if w is None:
            return None
        bits = bits or expert_weight_bits
        if bits not in (4, 8):
            raise NotImplementedError(f"QMoE with {bits}-bit weights")
        return _dequantize(w, scales, zp, bits, block_size or 0)

    return _mixture(
        input,
        router_probs,
        weights(fc1_experts_weights, fc1_scales, fc1_zero_points, fc1_expert_weight_bits),
        fc1_experts_bias,
        weights(fc2_experts_weights, fc2_scales, fc2_zero_points, fc2_expert_weight_bits),
        fc2_experts_bias,
        weights(fc3_experts_weights, fc3_scales, fc3_zero_points, fc3_expert_weight_bits),
        fc3_experts_bias,
        k=k,
        normalize=normalize_routing_weights,
        sparse_mixer=use_sparse_mixer,
        kind=activation_type,
        alpha=activation_alpha,
        beta=activation_beta,
        limit=swiglu_limit,
        fusion=swiglu_fusion,
    )
