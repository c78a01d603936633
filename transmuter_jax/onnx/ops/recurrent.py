"""Recurrent ops: RNN, GRU and LSTM, each one lax.scan over time per direction.

Shapes (layout 0): X [T, B, I]; W [D, G*H, I]; R [D, G*H, H]; B [D, 2*G*H]; initial states
[D, B, H]; Y [T, D, B, H]. Layout 1 puts the batch first: X [B, T, I], Y [B, T, D, H], states
[B, D, H]. Steps past sequence_lens[b] output 0 and keep the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import op
from ._util import precision


def _activation(name, alpha, beta):
    """The ONNX recurrent activation ``name`` with its alpha and beta (None: the default)."""
    name = name.lower()
    if name == "sigmoid":
        return jax.nn.sigmoid
    if name == "tanh":
        return jnp.tanh
    if name == "relu":
        return jax.nn.relu
    if name == "leakyrelu":
        return lambda x: jnp.where(x >= 0, x, (0.01 if alpha is None else alpha) * x)
    if name == "thresholdedrelu":
        return lambda x: jnp.where(x > (1.0 if alpha is None else alpha), x, 0)
    if name == "scaledtanh":
        return lambda x: (1.0 if alpha is None else alpha) * jnp.tanh((beta or 1.0) * x)
    if name == "hardsigmoid":
        a, b = 0.2 if alpha is None else alpha, 0.5 if beta is None else beta
        return lambda x: jnp.clip(a * x + b, 0, 1)
    if name == "elu":
        return lambda x: jnp.where(x >= 0, x, (1.0 if alpha is None else alpha) * jnp.expm1(x))
    if name == "softsign":
        return lambda x: x / (1 + jnp.abs(x))
    if name == "softplus":
        return jax.nn.softplus
    if name == "affine":
        return lambda x: (1.0 if alpha is None else alpha) * x + (beta or 0.0)
    raise NotImplementedError(f"recurrent activation {name!r}")


def _activations(names, alphas, betas, defaults, directions):
    """One list of activation functions per direction."""
    names = list(names or defaults * directions)
    if len(names) == len(defaults):
        names = names * directions
    alphas, betas = list(alphas or ()), list(betas or ())
    fns = []
    for i, name in enumerate(names):
        alpha = alphas[i] if i < len(alphas) else None
        beta = betas[i] if i < len(betas) else None
        fns.append(_activation(name, alpha, beta))
    per = len(defaults)
    return [fns[d * per : (d + 1) * per] for d in range(directions)]


def _directions(direction):
    return {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]


def _recur(cell, x, states, lens, reverse):
    """Runs ``cell(x_t, states) -> (h_t, states)`` over x [T, B, I]; steps at or past lens[b]
    give 0 and keep the states. Returns (Y [T, B, H], final states)."""
    t = x.shape[0]
    steps = jnp.arange(t)
    if reverse:  # the last valid step of each row comes first
        index = jnp.where(
            steps[:, None] < lens[None, :], lens[None, :] - 1 - steps[:, None], steps[:, None]
        )
        x = jnp.take_along_axis(x, index[:, :, None], axis=0)

    def step(carry, inputs):
        x_t, i = inputs
        h, new = cell(x_t, carry)
        live = (i < lens)[:, None]
        kept = tuple(jnp.where(live, n, c) for n, c in zip(new, carry, strict=True))
        return kept, jnp.where(live, h, 0)

    final, ys = jax.lax.scan(step, tuple(states), (x, steps))
    if reverse:
        ys = jnp.take_along_axis(ys, index[:, :, None], axis=0)
    return ys, final


def _run(cell_for, X, W, R, B, sequence_lens, initials, *, direction, layout, hidden, gates):
    """The shared frame of RNN, GRU and LSTM: layouts, directions and the default inputs.

    cell_for(d, w, r, wb, rb) -> cell for direction d. Returns (Y, *final states).
    """
    x = jnp.asarray(X)
    if layout:
        x = jnp.swapaxes(x, 0, 1)  # [T, B, I]
        initials = [None if s is None else jnp.swapaxes(jnp.asarray(s), 0, 1) for s in initials]
    t, b = x.shape[:2]
    dirs = _directions(direction)
    lens = jnp.full((b,), t, jnp.int32)
    if sequence_lens is not None:
        lens = jnp.asarray(sequence_lens).astype(jnp.int32)
    ys, finals = [], []
    for d, reverse in enumerate(dirs):
        w, r = jnp.asarray(W)[d], jnp.asarray(R)[d]
        bias = jnp.zeros((2 * gates * hidden,), x.dtype) if B is None else jnp.asarray(B)[d]
        states = [
            jnp.zeros((b, hidden), x.dtype) if s is None else jnp.asarray(s)[d] for s in initials
        ]
        cell = cell_for(d, w, r, bias[: gates * hidden], bias[gates * hidden :])
        y, final = _recur(cell, x, states, lens, reverse)
        ys.append(y)
        finals.append(final)
    y = jnp.stack(ys, axis=1)  # [T, D, B, H]
    outs = [jnp.stack([f[i] for f in finals]) for i in range(len(initials))]  # [D, B, H]
    if layout:
        y = jnp.transpose(y, (2, 0, 1, 3))  # [B, T, D, H]
        outs = [jnp.swapaxes(o, 0, 1) for o in outs]
    return (y, *outs)


def _dot(a, w):
    return jnp.matmul(a, w.T, precision=precision())


def _clip(v, clip):
    return v if clip is None else jnp.clip(v, -clip, clip)


@op("RNN", since=7)
def RNN(
    X,
    W,
    R,
    B=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    ctx,
):
    """H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb); outputs (Y, Y_h)."""
    hidden = hidden_size or jnp.shape(R)[-1]
    fns = _activations(
        activations, activation_alpha, activation_beta, ["Tanh"], len(_directions(direction))
    )

    def cell_for(d, w, r, wb, rb):
        def cell(x_t, carry):
            (h,) = carry
            h = fns[d][0](_clip(_dot(x_t, w) + _dot(h, r) + wb + rb, clip))
            return h, (h,)

        return cell

    outs = _run(
        cell_for,
        X,
        W,
        R,
        B,
        sequence_lens,
        [initial_h],
        direction=direction,
        layout=layout,
        hidden=hidden,
        gates=1,
    )
    return outs[: max(ctx.num_outputs, 1)]


@op("GRU", since=7)
def GRU(
    X,
    W,
    R,
    B=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    linear_before_reset=0,
    ctx,
):
    """Gates z, r and candidate h in that order; H_t = (1 - z) h + z H_{t-1}; outputs (Y, Y_h)."""
    hidden = hidden_size or jnp.shape(R)[-1]
    dirs = len(_directions(direction))
    fns = _activations(activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"], dirs)

    def cell_for(d, w, r, wb, rb):
        f, g = fns[d]
        n = hidden

        def cell(x_t, carry):
            (h,) = carry
            xw = _dot(x_t, w) + wb  # [B, 3H]
            hr = _dot(h, r[: 2 * n]) + rb[: 2 * n]
            z = f(_clip(xw[:, :n] + hr[:, :n], clip))
            reset = f(_clip(xw[:, n : 2 * n] + hr[:, n:], clip))
            if linear_before_reset:
                cand = xw[:, 2 * n :] + reset * (_dot(h, r[2 * n :]) + rb[2 * n :])
            else:
                cand = xw[:, 2 * n :] + _dot(reset * h, r[2 * n :]) + rb[2 * n :]
            cand = g(_clip(cand, clip))
            h = (1 - z) * cand + z * h
            return h, (h,)

        return cell

    outs = _run(
        cell_for,
        X,
        W,
        R,
        B,
        sequence_lens,
        [initial_h],
        direction=direction,
        layout=layout,
        hidden=hidden,
        gates=3,
    )
    return outs[: max(ctx.num_outputs, 1)]


@op("LSTM", since=7)
def LSTM(
    X,
    W,
    R,
    B=None,
    sequence_lens=None,
    initial_h=None,
    initial_c=None,
    P=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    input_forget=0,
    layout=0,
    ctx,
):
    """Gates i, o, f and cell c in that order, peepholes P [D, 3H] (i, o, f); outputs
    (Y, Y_h, Y_c)."""
    hidden = hidden_size or jnp.shape(R)[-1]
    dirs = len(_directions(direction))
    fns = _activations(
        activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh", "Tanh"], dirs
    )
    peep = jnp.zeros((dirs, 3 * hidden)) if P is None else jnp.asarray(P)

    def cell_for(d, w, r, wb, rb):
        f, g, act = fns[d]
        n = hidden
        pi, po, pf = peep[d, :n], peep[d, n : 2 * n], peep[d, 2 * n :]

        def cell(x_t, carry):
            h, c = carry
            gates = _dot(x_t, w) + _dot(h, r) + wb + rb  # [B, 4H]
            i = f(_clip(gates[:, :n] + pi * c, clip))
            forget = f(_clip(gates[:, 2 * n : 3 * n] + pf * c, clip))
            if input_forget:
                forget = 1 - i
            c = forget * c + i * g(_clip(gates[:, 3 * n :], clip))
            o = f(_clip(gates[:, n : 2 * n] + po * c, clip))
            h = o * act(c)
            return h, (h, c)

        return cell

    outs = _run(
        cell_for,
        X,
        W,
        R,
        B,
        sequence_lens,
        [initial_h, initial_c],
        direction=direction,
        layout=layout,
        hidden=hidden,
        gates=4,
    )
    return outs[: max(ctx.num_outputs, 1)]


# --- linear attention and causal convolution (opset 27) ---------------------------------------


def _bhtd(x, heads):
    """[B, T, H*D] -> [B, H, T, D] in float32."""
    b, t, d = x.shape
    return jnp.asarray(x).reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3).astype(jnp.float32)


def _per_step(x, b, t, heads):
    """decay or beta [B, T, H or H*D or 1] -> [T, B, H or 1, 1 or D] in float32."""
    x = jnp.asarray(x).astype(jnp.float32)
    last = x.shape[-1]
    per = last // heads if last >= heads else 1
    x = x.reshape(b, t, max(last // per, 1), per)
    return jnp.moveaxis(x, 1, 0)


@op("LinearAttention", since=27)
def LinearAttention(
    query,
    key,
    value,
    past_state=None,
    decay=None,
    beta=None,
    *,
    chunk_size=64,
    kv_num_heads=None,
    q_num_heads=None,
    scale=None,
    update_rule="gated_delta",
):
    """Linear attention with a state S [B, Hkv, Dk, Dv] updated per token (decayed by
    exp(decay), delta-corrected by beta) and read by the queries of each KV head's group;
    outputs (Y [B, T, Hq * Dv], present_state). ``chunk_size`` does not change the result."""
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    dtype = jnp.asarray(query).dtype
    b, t, _ = query.shape
    q, k, v = _bhtd(query, q_num_heads), _bhtd(key, kv_num_heads), _bhtd(value, kv_num_heads)
    dk, dv, group = q.shape[-1], v.shape[-1], q_num_heads // kv_num_heads
    if past_state is None:
        state = jnp.zeros((b, kv_num_heads, dk, dv), jnp.float32)
        state_dtype = dtype
    else:
        state, state_dtype = jnp.asarray(past_state).astype(jnp.float32), past_state.dtype
    ones = jnp.ones((t, b, 1, 1), jnp.float32)
    g = _per_step(decay, b, t, kv_num_heads) if gated else ones
    beta_t = _per_step(beta, b, t, kv_num_heads) if delta else ones
    factor = float(scale) if scale else 1.0 / float(dk) ** 0.5

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_step = inputs  # q_t [B, Hq, Dk]; k_t [B, Hkv, Dk]
        if gated:
            s = s * jnp.exp(g_t)[..., None]
        if delta:
            v_t = beta_step[..., 0:1] * (v_t - jnp.einsum("bhdm,bhd->bhm", s, k_t))
        s = s + k_t[..., :, None] * v_t[..., None, :]
        qg = q_t.reshape(b, kv_num_heads, group, dk)
        return s, factor * jnp.einsum("bhgd,bhdm->bhgm", qg, s).reshape(b, q_num_heads, dv)

    xs = (jnp.moveaxis(q, 2, 0), jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0), g, beta_t)
    state, ys = jax.lax.scan(step, state, xs)  # ys: [T, B, Hq, Dv]
    y = jnp.transpose(ys, (1, 0, 2, 3)).reshape(b, t, q_num_heads * dv).astype(dtype)
    return y, state.astype(state_dtype)


@op("CausalConvWithState", since=27)
def CausalConvWithState(input, weight, bias=None, past_state=None, *, activation="none"):
    """Depthwise causal convolution of input [B, C, L] by weight [C, 1, K] after the last K - 1
    inputs past_state [B, C, K - 1] (zeros without); outputs (y, present_state)."""
    x, w = jnp.asarray(input), jnp.asarray(weight)
    b, c, _ = x.shape
    k = w.shape[2]
    pad = jnp.zeros((b, c, k - 1), x.dtype) if past_state is None else jnp.asarray(past_state)
    padded = jnp.concatenate([pad.astype(x.dtype), x], axis=2)
    y = jax.lax.conv_general_dilated(
        padded, w.astype(x.dtype), (1,), "VALID", feature_group_count=c, precision=precision()
    )
    if bias is not None:
        y = y + jnp.asarray(bias)[None, :, None]
    if activation in ("silu", "swish"):
        y32 = y.astype(jnp.float32)
        y = (y32 * jax.nn.sigmoid(y32)).astype(x.dtype)
    return y.astype(x.dtype), padded[:, :, padded.shape[2] - (k - 1) :]
