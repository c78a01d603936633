"""Graph-structure ops: Constant, If, Loop and Scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import DynamicShapeError
from ..registry import op
from ..trace import is_static
from ._util import xp

# A Loop with a known trip count at most this long is unrolled at trace time.
UNROLL_LIMIT = 1024


@op("Constant")
def Constant(
    *,
    value=None,
    value_float=None,
    value_floats=None,
    value_int=None,
    value_ints=None,
    value_string=None,
    value_strings=None,
):
    if value is not None:
        return np.asarray(value)
    if value_float is not None:
        return np.asarray(value_float, np.float32)
    if value_floats is not None:
        return np.asarray(value_floats, np.float32)
    if value_int is not None:
        return np.asarray(value_int, np.int64)
    if value_ints is not None:
        return np.asarray(value_ints, np.int64)
    if value_string is not None:
        return np.asarray(value_string, object)
    if value_strings is not None:
        return np.asarray(value_strings, object)
    raise ValueError("Constant has no value attribute")


def _scalar_bool(cond) -> bool:
    return bool(np.asarray(cond).reshape(-1)[0])


@op("If", prefer_static=(0,), fold=False)
def If(cond, *, then_branch, else_branch, ctx):
    if is_static(cond):
        return tuple(ctx.run(then_branch if _scalar_bool(cond) else else_branch))
    pred = jnp.reshape(cond, (-1,))[0].astype(bool)
    try:
        return tuple(
            jax.lax.cond(
                pred,
                lambda: [jnp.asarray(v) for v in ctx.run(then_branch)],
                lambda: [jnp.asarray(v) for v in ctx.run(else_branch)],
            )
        )
    except TypeError as error:
        raise DynamicShapeError(
            f"the branches of {ctx.label} give different shapes or types and its condition "
            "is only known when the graph runs; give its condition as a static input"
        ) from error


@op("Loop", prefer_static=(0, 1), fold=False)
def Loop(trip_count, cond, *initial, body, ctx):
    n_carried = len(initial)
    n_scan = len(body.output) - 1 - n_carried
    carried = list(initial)
    if trip_count is not None and not is_static(trip_count):
        return _while_loop(trip_count, cond, carried, n_scan, body, ctx)
    limit = int(np.asarray(trip_count).reshape(-1)[0]) if trip_count is not None else None
    if cond is not None and not is_static(cond):
        return _while_loop(trip_count, cond, carried, n_scan, body, ctx)
    running = True if cond is None else _scalar_bool(cond)
    scans: list[list] = [[] for _ in range(n_scan)]
    i = 0
    active = None  # a traced flag once the condition depends on the graph's inputs
    while running and (limit is None or i < limit):
        if i >= UNROLL_LIMIT:
            raise DynamicShapeError(f"{ctx.label} runs more than {UNROLL_LIMIT} iterations")
        cond_in = np.asarray(True) if active is None else active
        out = ctx.run(body, [np.asarray(i, np.int64), cond_in, *carried])
        new = out[1 : 1 + n_carried]
        if active is not None:
            new = [jnp.where(active, n, c) for n, c in zip(new, carried, strict=True)]
        carried = new
        for s, v in zip(scans, out[1 + n_carried :], strict=True):
            s.append(v)
        i += 1
        if is_static(out[0]) and active is None:
            running = _scalar_bool(out[0])
        else:
            if n_scan or limit is None:
                raise DynamicShapeError(
                    f"{ctx.label} stops on a condition known only when the graph runs, so the "
                    "number of its iterations is not static"
                )
            active = jnp.logical_and(True if active is None else active, jnp.reshape(out[0], ()))
    stacked = []
    for s, _info in zip(scans, body.output[1 + n_carried :], strict=True):
        if s:
            m = np if all(is_static(v) for v in s) else jnp
            stacked.append(m.stack(s))
        else:
            stacked.append(np.zeros((0,), np.float32))
    return tuple(carried) + tuple(stacked)


def _while_loop(trip_count, cond, carried, n_scan, body, ctx):
    if n_scan:
        raise DynamicShapeError(
            f"{ctx.label} has scan outputs and a trip count or condition known only when the "
            "graph runs, so the shapes of its outputs are not static"
        )
    limit = jnp.asarray(jnp.iinfo(jnp.int32).max if trip_count is None else trip_count).reshape(())
    start = jnp.asarray(True if cond is None else cond).reshape(()).astype(bool)

    def step(state):
        i, _, values = state
        out = ctx.run(body, [i.astype(jnp.int32), jnp.asarray(True), *values])
        new = [
            jnp.asarray(v).astype(jnp.asarray(c).dtype)
            for v, c in zip(out[1:], values, strict=True)
        ]
        return i + 1, jnp.reshape(out[0], ()).astype(bool), new

    state = (jnp.asarray(0, jnp.int32), start, [jnp.asarray(c) for c in carried])
    _, _, values = jax.lax.while_loop(lambda s: jnp.logical_and(s[1], s[0] < limit), step, state)
    return tuple(values)


def _scan_slices(values, axes, directions, steps):
    """The per-iteration slices of the scan inputs: step t of each along its axis."""
    for t in range(steps):
        yield [
            xp(v).take(v, steps - 1 - t if d else t, axis=a)
            for v, a, d in zip(values, axes, directions, strict=True)
        ]


def _scan(states, scans, body, in_axes, in_dirs, out_axes, out_dirs, ctx):
    """Runs ``body`` once per step of the scan inputs, unrolled at trace time."""
    m = len(scans)
    in_axes = [a % np.ndim(v) for a, v in zip(in_axes or [0] * m, scans, strict=True)]
    in_dirs = list(in_dirs or [0] * m)
    steps = scans[0].shape[in_axes[0]] if scans else 0
    if steps > UNROLL_LIMIT:
        raise DynamicShapeError(f"{ctx.label} scans more than {UNROLL_LIMIT} steps")
    n = len(states)
    outputs: list[list] = [[] for _ in range(len(body.output) - n)]
    for slices in _scan_slices(scans, in_axes, in_dirs, steps):
        out = ctx.run(body, [*states, *slices])
        states = list(out[:n])
        for acc, value in zip(outputs, out[n:], strict=True):
            acc.append(value)
    k = len(outputs)
    out_axes, out_dirs = list(out_axes or [0] * k), list(out_dirs or [0] * k)
    stacked = []
    for acc, axis, d in zip(outputs, out_axes, out_dirs, strict=True):
        acc = acc[::-1] if d else acc
        mod = np if all(is_static(v) for v in acc) else jnp
        axis = axis % (np.ndim(acc[0]) + 1) if acc else 0
        stacked.append(mod.stack(acc, axis=axis) if acc else np.zeros((0,), np.float32))
    return (*states, *stacked)


@op("Scan", since=9, fold=False)
def Scan(
    *inputs,
    body,
    num_scan_inputs,
    scan_input_axes=None,
    scan_input_directions=None,
    scan_output_axes=None,
    scan_output_directions=None,
    ctx,
):
    """Runs ``body`` over the steps of the last ``num_scan_inputs`` inputs, carrying the first
    ones as states; outputs (final states, stacked scan outputs). Unrolled at trace time."""
    n = len(inputs) - num_scan_inputs
    return _scan(
        list(inputs[:n]),
        list(inputs[n:]),
        body,
        scan_input_axes,
        scan_input_directions,
        scan_output_axes,
        scan_output_directions,
        ctx,
    )


@op("Scan", since=8, fold=False)
def Scan_8(sequence_lens, *inputs, body, num_scan_inputs, directions=None, ctx):
    """Scan with a batch axis 0 (opset 8): each batch row is scanned along axis 1."""
    if sequence_lens is not None:
        raise NotImplementedError(f"{ctx.label}: Scan-8 with sequence_lens")
    n = len(inputs) - num_scan_inputs
    batch = inputs[0].shape[0]
    rows = []
    for b in range(batch):
        states = [xp(v).take(v, b, axis=0) for v in inputs[:n]]
        scans = [xp(v).take(v, b, axis=0) for v in inputs[n:]]
        rows.append(_scan(states, scans, body, None, directions, None, None, ctx))
    return tuple(
        (np if all(is_static(r[i]) for r in rows) else jnp).stack([r[i] for r in rows])
        for i in range(len(rows[0]))
    )
