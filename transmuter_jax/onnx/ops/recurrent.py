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
