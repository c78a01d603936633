"""ai.onnx.preview.training optimizers: Adagrad, Adam and Momentum, one step each.

Inputs are the learning rate R, the step count T, then the tensors X, their gradients G and
their optimizer states, each group of n tensors in turn; outputs the new X, then the new states.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..registry import op

TRAINING = "ai.onnx.preview.training"


def _groups(data, per):
    """(r, t, [(x, g, state...) for each of the n optimized tensors])."""
    r, t, *rest = data
    n = len(rest) // per
    return r, t, [tuple(rest[k * n + i] for k in range(per)) for i in range(n)]


def _outputs(results):
    return tuple(out[k] for k in range(len(results[0])) for out in results)


@op("Adagrad", domain=TRAINING)
def Adagrad(*data, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    """x - r / (1 + t decay) * g' / (sqrt(h + g'^2) + epsilon), g' = g + norm_coefficient x."""
    r, t, groups = _groups(data, 3)
    rate = r / (1 + t * decay_factor)
    results = []
    for x, g, h in groups:
        g = norm_coefficient * x + g
        h = h + g * g
        results.append(((x - rate * g / (jnp.sqrt(h) + epsilon)).astype(x.dtype), h))
    return _outputs(results)


@op("Adam", domain=TRAINING)
def Adam(
    *data, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0, norm_coefficient_post=0.0
):
    """One Adam step with bias correction after the first (t > 0), and post-step decay."""
    r, t, groups = _groups(data, 4)
    corrected = r * jnp.sqrt(1 - beta**t) / (1 - alpha**t)
    rate = jnp.where(t > 0, corrected, r)
    results = []
    for x, g, v, h in groups:
        g = norm_coefficient * x + g
        v = alpha * v + (1 - alpha) * g
        h = beta * h + (1 - beta) * g * g
        x = (1 - norm_coefficient_post) * (x - rate * v / (jnp.sqrt(h) + epsilon))
        results.append((x, v, h))
    return _outputs(results)


@op("Momentum", domain=TRAINING)
def Momentum(*data, alpha, beta, mode, norm_coefficient):
    """One step of momentum (``standard``) or Nesterov momentum (``nesterov``)."""
    r, t, groups = _groups(data, 3)
    scale = jnp.where(t > 0, beta, 1.0)
    results = []
    for x, g, v in groups:
        g = norm_coefficient * x + g
        v = alpha * v + scale * g
        step = g + alpha * v if mode == "nesterov" else v
        results.append((x - r * step, v))
    return _outputs(results)
