"""The CPU kernels against their pure-JAX equivalents, inside models, and without them."""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_cases import check_op, run_jax, run_ort

import transmuter_jax as tj
from transmuter_jax import kernels
from transmuter_jax.generation import select
from transmuter_jax.kernels import build
from transmuter_jax.onnx import fuse, prepack
from transmuter_jax.onnx.ops import nn as onnx_nn
from transmuter_jax.onnx.ops.quant import INT8_ENV, _nbits_weight, int8_product
from transmuter_jax.testing import example_inputs

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels not available")
FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _close(actual, expected, k: int):
    """Float32 products of length k against a float64 reference."""
    scale = np.sqrt(max(k, 1)) * 1e-6 * (1 + np.abs(expected).max(initial=0))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=scale * 10)


# ---------------------------------------------------------------- packed float32 products


@pytest.mark.parametrize("layout", ["transposed", "sliced", "reversed"])
def test_pack_reads_any_strides(rng, layout):
    """Weights read through a Transpose (tied embeddings), slices and negative strides."""
    base = rng.standard_normal((90, 70)).astype(np.float32)
    w = {"transposed": base.T, "sliced": base[3:80:2, 5:68], "reversed": base[::-1, ::-2]}[layout]
    packed = kernels.pack(w)
    assert packed.ctypes.data % 64 == 0
    assert not packed[-1, :, w.shape[1] % kernels.STRIP or kernels.STRIP :].any()  # zero padding
    np.testing.assert_array_equal(np.asarray(kernels.unpack(jnp.asarray(packed), w.shape[1])), w)


@pytest.mark.parametrize(
    ("k", "n"), [(1, 1), (7, 33), (33, 31), (100, 64), (576, 70), (129, 257), (64, 5)]
)
def test_pack_roundtrip(rng, k, n):
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = kernels.pack(w)
    assert packed.shape == (-(-n // kernels.STRIP), k, kernels.STRIP)
    np.testing.assert_array_equal(np.asarray(kernels.unpack(jnp.asarray(packed), n)), w)
    idx = np.array([[0, n - 1], [-1, n // 2]])
    np.testing.assert_array_equal(
        np.asarray(kernels.columns(jnp.asarray(packed), idx, n)), w.T[idx % n]
    )
    idx = np.array([0, k - 1, -1])
    np.testing.assert_array_equal(np.asarray(kernels.rows(jnp.asarray(packed), idx, n)), w[idx])


@needs_kernels
@pytest.mark.parametrize("m", [*range(1, 18), 31, 64, 130])
@pytest.mark.parametrize(("k", "n"), [(7, 33), (33, 95), (576, 70), (130, 257)])
def test_matmul_kernel(rng, m, k, n):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    y = jax.jit(kernels.matmul, static_argnums=2)(x, jnp.asarray(kernels.pack(w)), n)
    _close(y, x.astype(np.float64) @ w, k)


@needs_kernels
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (300, 100), (1536, 70)])
def test_matmul_kernel_rows_are_independent(rng, k, n):
    """Each row of every batch up to MATMUL_MAX_ROWS is bit for bit the row computed alone:
    the paths for many rows (K in blocks, pairs of panels) sum in the single-row order, so a
    slot's decode does not depend on how many slots run beside it (AVX2 leaves the one-pass
    path above 6 rows, AVX-512 above 12)."""
    x = rng.standard_normal((kernels.MATMUL_MAX_ROWS, k)).astype(np.float32)
    packed = jnp.asarray(kernels.pack(rng.standard_normal((k, n)).astype(np.float32)))
    fn = jax.jit(kernels.matmul, static_argnums=2)
    picks = (0, 6, 12, 96, kernels.MATMUL_MAX_ROWS - 1)
    solo = {r: np.asarray(fn(x[r : r + 1], packed, n))[0] for r in picks}
    for m in (2, 7, 8, 13, 16, 40, 97, kernels.MATMUL_MAX_ROWS):
        got = np.asarray(fn(x[:m], packed, n))
        for r in (r for r in picks if r < m):
            np.testing.assert_array_equal(got[r], solo[r], err_msg=f"row {r} of {m}")


@needs_kernels
@pytest.mark.parametrize("rows", [kernels.MATMUL_MAX_ROWS, kernels.MATMUL_MAX_ROWS + 1])
def test_matmul_many_rows_go_to_xla(rng, rows):
    """Up to MATMUL_MAX_ROWS rows the kernel runs; more (over all leading dimensions) leave the
    product to XLA's dot on the unpacked weight, with the same result."""
    x = rng.standard_normal((1, rows, 24)).astype(np.float32)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    fn = jax.jit(kernels.matmul, static_argnums=2)
    packed = jnp.asarray(kernels.pack(w))
    hlo = fn.lower(x, packed, 40).as_text()
    assert ("tj_gemm_f32" in hlo) == (rows <= kernels.MATMUL_MAX_ROWS)
    _close(fn(x, packed, 40), x.astype(np.float64) @ w, 24)


@needs_kernels
@pytest.mark.parametrize("shape", [(2, 3, 40), (40,), (1, 1, 40), (0, 40), (3, 0)])
def test_matmul_kernel_batch_dims(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    k, n = shape[-1], 37
    w = rng.standard_normal((k, n)).astype(np.float32)
    y = jax.jit(kernels.matmul, static_argnums=2)(x, jnp.asarray(kernels.pack(w)), n)
    assert y.shape == (*shape[:-1], n)
    _close(y, x.astype(np.float64) @ w, k)


@needs_kernels
def test_matmul_vmap_and_grad(rng):
    k, n = 45, 70
    x = rng.standard_normal((4, 3, k)).astype(np.float32)
    w = rng.standard_normal((2, k, n)).astype(np.float32)
    packed = jnp.asarray(np.stack([kernels.pack(v) for v in w]))
    over_x = jax.jit(jax.vmap(lambda x: kernels.matmul(x, packed[0], n)))(x)
    _close(over_x, x.astype(np.float64) @ w[0], k)
    over_w = jax.jit(jax.vmap(lambda p: kernels.matmul(x[0], p, n)))(packed)
    _close(over_w, np.stack([x[0].astype(np.float64) @ v for v in w]), k)

    def loss(x, p):
        return jnp.sum(jnp.sin(kernels.matmul(x, p, n)))

    def loss_ref(x, w):
        return jnp.sum(jnp.sin(x @ w))

    gx, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, packed[0])
    rx, rw = jax.grad(loss_ref, argnums=(0, 1))(x, w[0])
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        np.asarray(kernels.unpack(gp, n)), np.asarray(rw), rtol=1e-4, atol=1e-4
    )


@needs_kernels
@pytest.mark.parametrize(
    ("batch", "steps", "counts"),
    [
        (1, 48, [42]),
        (1, 16, [16]),
        (1, 5, [1]),
        (3, 16, [16, 3, 9]),
        (2, 64, [1, 64]),
        (4, 2, [1, 2, 2, 1]),
        (2, 7, [0, 99]),  # clamped to [1, S]
        (3, 40, [33, 40, 7]),
    ],
)
@pytest.mark.parametrize(("k", "n"), [(576, 70), (130, 257)])
def test_matmul_token_rows_compute_each_rows_tokens_alone(rng, batch, steps, counts, k, n):
    """Within token_rows, a product over the tokens computes each row's first counts[b] tokens
    with the bits of the whole product, and gives every later token a copy of the row's last
    computed one (padding); a product not over the tokens computes every row."""
    x = rng.standard_normal((batch, steps, k)).astype(np.float32)
    packed = jnp.asarray(kernels.pack(rng.standard_normal((k, n)).astype(np.float32)))
    counts = np.array(counts, np.int32)

    def fn(x, counts, tokens):
        with kernels.token_rows(counts, steps):
            return kernels.matmul(x, packed, n, tokens=tokens)

    run = jax.jit(fn, static_argnums=2)
    whole = np.asarray(jax.jit(kernels.matmul, static_argnums=2)(x, packed, n))
    got = np.asarray(run(x, counts, True))
    for b, count in enumerate(np.clip(counts, 1, steps)):
        np.testing.assert_array_equal(got[b, :count], whole[b, :count])
        pad = got[b, count:]
        np.testing.assert_array_equal(pad, np.broadcast_to(whole[b, count - 1], pad.shape))
    np.testing.assert_array_equal(np.asarray(run(x, counts, False)), whole)
    hlo = jax.jit(fn, static_argnums=2).lower(x, counts, True).as_text()
    assert ("tj_gemm_rows_f32" in hlo) == (steps > 1)


@needs_kernels
@pytest.mark.parametrize(
    "shape", [(2, 8, 24), (8, 24), (1, 8, 24), (8, 8, 24), (2, 8, 3, 24), (16, 24), (2, 9, 24)]
)
def test_matmul_token_rows_only_where_the_rows_are_the_steps_tokens(rng, shape):
    """The rows are skipped only where x is [B, S, K] (or [S, K] for one row) for the step's B
    and S; where B equals S, [S, B] sequence-first rows would look alike: every row runs."""
    batch = shape[0] if len(shape) > 2 else 1
    counts = np.ones(batch, np.int32)
    x = rng.standard_normal(shape).astype(np.float32)
    packed = jnp.asarray(kernels.pack(rng.standard_normal((24, 10)).astype(np.float32)))

    def fn(x):
        with kernels.token_rows(counts, 8):
            return kernels.matmul(x, packed, 10, tokens=True)

    hlo = jax.jit(fn).lower(x).as_text()
    skips = shape in ((2, 8, 24), (8, 24), (1, 8, 24))
    assert ("tj_gemm_rows_f32" in hlo) == skips


@needs_kernels
def test_matmul_token_rows_under_vmap_and_grad(rng):
    """vmap over x keeps each block's row (the counts repeat); gradients of the computed rows
    are those of the plain product."""
    k, n, steps = 20, 12, 6
    x = rng.standard_normal((3, 2, steps, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = jnp.asarray(kernels.pack(w))
    counts = np.array([2, 6], np.int32)

    def one(x):
        with kernels.token_rows(counts, steps):
            return kernels.matmul(x, packed, n, tokens=True)

    got = np.asarray(jax.jit(jax.vmap(one))(x))
    for v in range(3):
        np.testing.assert_array_equal(got[v], np.asarray(jax.jit(one)(x[v])))
    real = np.arange(steps)[None, :, None] < counts[:, None, None]  # the rows computed
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.where(real, jnp.sin(one(x)), 0))))(x[0])
    expected = jax.grad(lambda x: jnp.sum(jnp.where(real, jnp.sin(x @ w), 0)))(x[0])
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize(
    "live",
    [
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0, 0, 0, 0],  # the first: computed in place
        [0, 0, 0, 0, 0, 0, 0, 1],  # gathered
        [1, 1, 0, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],  # none: the first computed, kept finite
    ],
)
@pytest.mark.parametrize(("steps", "k", "n"), [(1, 576, 70), (3, 130, 257), (1, 40, 49)])
def test_matmul_live_rows_compute_the_live_rows_alone(rng, live, steps, k, n):
    """Within live_rows, a product over the tokens computes the rows of live batch rows with the
    bits of the whole product and gives every other batch row a copy of a computed one (finite);
    a product not over the tokens, or of another batch, computes every row."""
    batch = len(live)
    x = rng.standard_normal((batch, steps, k)).astype(np.float32)
    packed = jnp.asarray(kernels.pack(rng.standard_normal((k, n)).astype(np.float32)))
    live = np.array(live, bool)

    def fn(x, live, tokens):
        with kernels.live_rows(live):
            return kernels.matmul(x, packed, n, tokens=tokens)

    run = jax.jit(fn, static_argnums=2)
    whole = np.asarray(jax.jit(kernels.matmul, static_argnums=2)(x, packed, n))
    got = np.asarray(run(x, live, True))
    computed = np.flatnonzero(live) if live.any() else [0]
    for b in range(batch):
        want = whole[b] if b in computed else whole[computed[0]]
        np.testing.assert_array_equal(got[b], want)
    np.testing.assert_array_equal(np.asarray(run(x, live, False)), whole)
    assert "tj_gemm_live_f32" in run.lower(x, live, True).as_text()
    other = rng.standard_normal((batch + 1, steps, k)).astype(np.float32)  # not the step's batch
    assert "tj_gemm_live_f32" not in run.lower(other, live, True).as_text()
    flat = x[:, 0]  # [B, K]: the batch's rows too
    got = np.asarray(run(flat, live, True))
    for b in computed:
        np.testing.assert_array_equal(got[b], whole[b, 0])


@needs_kernels
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 576, 1536), (8, 576, 70), (64, 130, 257), (5, 40, 31)]
)
def test_matmul_gate_up_has_the_values_of_three_calls(rng, m, k, n):
    """kernels.matmul_gate_up: silu_mul of the two products, bit for bit the three calls'; each
    row at 1, 8 and 64 rows that of its solo run."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    gate, up = (jnp.asarray(kernels.pack(rng.standard_normal((k, n)).astype(np.float32)))
                for _ in range(2))  # fmt: skip
    fused = jax.jit(kernels.matmul_gate_up, static_argnums=3)
    three = jax.jit(
        lambda x, g, u, n: kernels.silu_mul(kernels.matmul(x, g, n), kernels.matmul(x, u, n)),
        static_argnums=3,
    )
    got = np.asarray(fused(x, gate, up, n))
    np.testing.assert_array_equal(got, np.asarray(three(x, gate, up, n)))
    assert "tj_gemm_gate_up_f32" in fused.lower(x, gate, up, n).as_text()
    for r in {0, m // 2, m - 1}:
        np.testing.assert_array_equal(got[r], np.asarray(fused(x[r : r + 1], gate, up, n))[0])
    g = x @ kernels.unpack(gate, n)
    want = np.asarray(g * jax.nn.sigmoid(g) * (x @ kernels.unpack(up, n)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("live", [[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]])
def test_matmul_gate_up_live_rows_compute_the_live_rows_alone(rng, live):
    """Within live_rows, the fused gate and up over the tokens compute the live batch rows with
    the bits of the whole product, the others a copy of a computed row; a padded prompt's token
    rows (token_rows) run the three calls."""
    k, n = 96, 70
    live = np.array(live, bool)
    x = rng.standard_normal((len(live), 1, k)).astype(np.float32)
    gate, up = (jnp.asarray(kernels.pack(rng.standard_normal((k, n)).astype(np.float32)))
                for _ in range(2))  # fmt: skip

    def fn(x, live):
        with kernels.live_rows(live):
            return kernels.matmul_gate_up(x, gate, up, n, tokens=True)

    whole = np.asarray(jax.jit(kernels.matmul_gate_up, static_argnums=3)(x, gate, up, n))
    got = np.asarray(jax.jit(fn)(x, live))
    computed = np.flatnonzero(live) if live.any() else [0]
    for b in range(len(live)):
        np.testing.assert_array_equal(got[b], whole[b] if b in computed else whole[computed[0]])
    assert "tj_gemm_gate_up_live_f32" in jax.jit(fn).lower(x, live).as_text()

    def prompt(x):
        with kernels.token_rows(np.array([2], np.int32), 4):
            return kernels.matmul_gate_up(x, gate, up, n, tokens=True)

    tokens = rng.standard_normal((1, 4, k)).astype(np.float32)
    hlo = jax.jit(prompt).lower(tokens).as_text()
    assert "tj_gemm_rows_f32" in hlo and "tj_gemm_gate_up" not in hlo
    every = jax.jit(kernels.matmul_gate_up, static_argnums=3)(tokens, gate, up, n)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(prompt)(tokens))[0, :2], np.asarray(every)[0, :2]
    )


@needs_kernels
@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize(("k", "steps"), [(576, 1), (96, 2)])
def test_matmul_nbits_live_rows_compute_the_live_rows_alone(rng, zero_points, k, steps):
    """MatMulNBits (int8 activations, the default model's block 32) over x [B, S, K] within
    live_rows: the live batch rows' results bit for bit those of the whole product, the others
    copies of a computed row; x [B, K] computes every row."""
    n, block, batch = 70, 32, 6
    b, scales, zp = _nbits(rng, k, n, block, zero_points)
    x = (rng.standard_normal((batch, steps, k)) * 3).astype(np.float32)
    ref = lambda x, b, s, z: int8_product(x, b, s, z, k, n, block)  # noqa: E731

    def fn(x, live):
        with kernels.live_rows(live):
            return kernels.matmul_nbits(x, b, scales, zp, n=n, block_size=block, reference=ref,
                                        int8=True)  # fmt: skip

    whole = _int8_call(x, b, scales, zp, k, n, block)
    run = jax.jit(fn)
    for live in ([0, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0], [1] * batch):
        live = np.array(live, bool)
        got = np.asarray(run(x, live))
        first = int(np.flatnonzero(live)[0])
        for r in range(batch):
            np.testing.assert_array_equal(got[r], whole[r] if live[r] else whole[first])
    assert "tj_matmul_nbits_live" in run.lower(x, live).as_text()
    assert "tj_matmul_nbits_live" not in run.lower(x[:, 0], live).as_text()


def _attention_case(rng, b, s, n, nk, h, cached):
    q = rng.standard_normal((b, s, n, h)).astype(np.float32)
    k = rng.standard_normal((b, nk, s, h)).astype(np.float32)
    v = rng.standard_normal((b, nk, s, h)).astype(np.float32)
    old_k = rng.standard_normal((b, nk, cached, h)).astype(np.float32)
    old_v = rng.standard_normal((b, nk, cached, h)).astype(np.float32)
    past = rng.integers(0, cached + 1, b).astype(np.int32)
    total = (past + rng.integers(0, s + 1, b)).astype(np.int32)
    past[0], total[0] = cached, cached + s
    return q, k, v, total, old_k, old_v, past


@needs_kernels
@pytest.mark.parametrize(
    ("b", "s", "n", "nk", "h", "cached", "causal", "window"),
    [
        (1, 42, 9, 3, 64, 0, True, 0),
        (2, 70, 4, 4, 32, 0, True, 0),
        (3, 17, 8, 2, 64, 0, True, 5),
        (2, 33, 6, 3, 48, 0, False, 0),
        (1, 2, 2, 1, 16, 0, True, 0),
        (1, 256, 9, 3, 64, 0, True, 0),
        (3, 1, 9, 3, 64, 64, True, 0),  # decoding
        (2, 1, 4, 2, 32, 37, True, 7),
        (2, 20, 4, 2, 32, 50, True, 0),  # a prompt's later chunk, a verify step
        (2, 5, 6, 3, 16, 9, False, 0),
        (2, 150, 6, 6, 64, 0, False, 0),  # an encoder's: key blocks, rows past the groups
        (1, 131, 4, 2, 32, 20, True, 0),
        (4, 1, 40, 2, 64, 300, True, 0),  # decoding, a group of more heads than a block
        (3, 7, 14, 2, 64, 100, True, 0),  # eight-key blocks across the cache and the step
    ],
)
def test_attention_kernel_equals_the_reference_and_each_row_alone(
    rng, b, s, n, nk, h, cached, causal, window
):
    """The attention kernel over a cache's valid rows and the step's own: within float32
    tolerance of the jax.numpy reference (masked keys, rows without keys as zeros), and each
    batch row bit for bit what it gives alone."""
    if h % kernels.build.vector_lanes():
        pytest.skip("head size not a multiple of this CPU's vector")
    q, k, v, total, old_k, old_v, past = _attention_case(rng, b, s, n, nk, h, cached)
    static = {"scale": 0.125, "causal": causal, "window": window}

    def call(q, k, v, total, old_k, old_v, past):
        old = (old_k, old_v, past) if cached else None
        return kernels.attention(q, k, v, total, old=old, **static)

    fn = jax.jit(call)
    args = (q, k, v, total, old_k, old_v, past)
    got = np.asarray(fn(*args))
    want = np.asarray(kernels._attention_reference(*args, **static))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    for i in range(b):
        one = np.asarray(fn(*(a[i : i + 1] for a in args)))
        np.testing.assert_array_equal(got[i : i + 1], one)


@needs_kernels
@pytest.mark.parametrize(
    ("b", "s", "n", "nk", "h", "cached", "causal"),
    [
        (2, 150, 6, 6, 64, 0, False),  # an encoder's: key blocks, rows past the groups
        (3, 17, 8, 2, 64, 0, True),
        (2, 20, 4, 2, 32, 50, True),  # a later chunk over a cache
        (3, 1, 9, 3, 64, 64, True),  # decoding
        (1, 37, 6, 3, 48, 0, False),  # eight-key blocks and single keys
    ],
)
def test_attention_kernel_reads_keys_and_values_tokens_first(rng, b, s, n, nk, h, cached, causal):
    """k and v given as [B, S, Nk, H] (a projection's heads as written): bit for bit the
    outputs of the same keys and values given head first, within tolerance of the reference."""
    if h % kernels.build.vector_lanes():
        pytest.skip("head size not a multiple of this CPU's vector")
    q, k, v, total, old_k, old_v, past = _attention_case(rng, b, s, n, nk, h, cached)
    old = (old_k, old_v, past) if cached else None
    static = {"scale": 0.125, "causal": causal}
    heads = jax.jit(lambda q, k, v, t: kernels.attention(q, k, v, t, old=old, **static))
    tokens = jax.jit(
        lambda q, k, v, t: kernels.attention(q, k, v, t, old=old, tokens_first=True, **static)
    )
    want = np.asarray(heads(q, k, v, total))
    got = np.asarray(tokens(q, np.swapaxes(k, 1, 2).copy(), np.swapaxes(v, 1, 2).copy(), total))
    np.testing.assert_array_equal(got, want)
    reference = kernels._attention_reference(q, k, v, total, old_k, old_v, past, window=0, **static)
    np.testing.assert_allclose(got, np.asarray(reference), rtol=2e-5, atol=2e-5)


@needs_kernels
def test_attention_kernel_is_refused_where_it_does_not_apply(rng):
    """Other dtypes, a head size off the CPU's vector, shapes that do not match: None (the
    op's own path)."""
    lanes = kernels.build.vector_lanes()
    q = jnp.zeros((1, 4, 2, lanes), jnp.float32)
    k = jnp.zeros((1, 1, 4, lanes), jnp.float32)
    total = jnp.array([4], jnp.int32)
    assert kernels.attention(q, k, k, total, scale=1.0, causal=True) is not None
    half = q.astype(jnp.bfloat16)
    assert kernels.attention(half, k, k, total, scale=1.0, causal=True) is None
    odd = jnp.zeros((1, 4, 2, lanes + 1), jnp.float32)
    odd_k = jnp.zeros((1, 1, 4, lanes + 1), jnp.float32)
    assert kernels.attention(odd, odd_k, odd_k, total, scale=1.0, causal=True) is None
    assert kernels.attention(q, k[:, :, :3], k[:, :, :3], total, scale=1.0, causal=True) is None
    other = (jnp.zeros((1, 2, 5, lanes), jnp.float32),) * 2 + (jnp.array([5], jnp.int32),)
    assert kernels.attention(q, k, k, total, scale=1.0, causal=True, old=other) is None
    with kernels.off():
        assert kernels.attention(q, k, k, total, scale=1.0, causal=True) is None


@needs_kernels
def test_attention_kernel_under_vmap_and_grad(rng):
    q = rng.standard_normal((2, 1, 6, 2, 16)).astype(np.float32)
    k = rng.standard_normal((2, 1, 1, 6, 16)).astype(np.float32)
    total = np.array([6], np.int32)
    none = (np.zeros((1, 1, 0, 16), np.float32),) * 2 + (np.zeros(1, np.int32),)

    def one(q, k):
        return kernels.attention(q, k, k, total, scale=0.25, causal=True)

    def ref(q, k):
        return kernels._attention_reference(
            q, k, k, total, *none, scale=0.25, causal=True, window=0
        )

    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.vmap(one))(q, k)),
        np.asarray(jax.vmap(ref)(q, k)),
        rtol=1e-5,
        atol=1e-5,
    )
    grad = jax.grad(lambda q: jnp.sum(jnp.sin(one(q, k[0]))))(q[0])
    expected = jax.grad(lambda q: jnp.sum(jnp.sin(ref(q, k[0]))))(q[0])
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-4, atol=1e-4)


def _step_case(rng, b, s, n, nk, h, cached, half, positions=64):
    qkv = rng.standard_normal((b, s, n + 2 * nk, h)).astype(np.float32)
    old_k = rng.standard_normal((b, nk, cached, h)).astype(np.float32)
    old_v = rng.standard_normal((b, nk, cached, h)).astype(np.float32)
    past = rng.integers(0, cached - s + 1, b).astype(np.int32)
    past[-1] = cached  # past the buffer's end: the write is clamped to its last rows
    total = (past + s).astype(np.int32)
    cos = rng.standard_normal((positions, half)).astype(np.float32)
    sin = rng.standard_normal((positions, half)).astype(np.float32)
    rot = (past[:, None] + np.arange(s)[None, :]).astype(np.int32)
    rot[0, 0] = -1  # from the table's end, as jnp.take
    rot[-1, -1] = positions + 3  # outside the table: NaN angles
    return qkv, total, old_k, old_v, past, cos, sin, rot


@needs_kernels
@pytest.mark.parametrize(
    ("b", "s", "n", "nk", "h", "cached", "half", "interleaved", "window"),
    [
        (1, 1, 9, 3, 64, 48, 32, False, 0),  # decoding
        (3, 1, 9, 3, 64, 48, 32, True, 0),
        (2, 1, 8, 2, 64, 40, 16, False, 0),  # a partial rotary
        (2, 4, 4, 2, 32, 20, 16, False, 5),  # a later chunk, a window
        (2, 1, 4, 4, 16, 9, 0, False, 0),  # no rotary
    ],
)
def test_attention_step_is_the_rotation_the_attention_and_the_write(
    rng, b, s, n, nk, h, cached, half, interleaved, window
):
    """One call of the step kernel: the buffers bit for bit the reference's (the rotated keys
    and the values written at each row's clamped past), and the output bit for bit the
    attention kernel's on the reference's rotated queries and keys (within tolerance of the
    jax.numpy attention), each batch row as alone."""
    if h % kernels.build.vector_lanes():
        pytest.skip("head size not a multiple of this CPU's vector")
    qkv, total, old_k, old_v, past, cos, sin, rot = _step_case(rng, b, s, n, nk, h, cached, half)
    static = {"scale": 0.125, "causal": True, "window": window}

    def call(qkv, total, old_k, old_v, past, rot):
        rotary = (cos, sin, rot, interleaved) if half else None
        return kernels.attention_step(qkv, total, (old_k, old_v, past), heads=n, rotary=rotary,
                                      **static)  # fmt: skip

    fn = jax.jit(call)
    args = (qkv, total, old_k, old_v, past, rot)
    out, keys, values = (np.asarray(a) for a in fn(*args))
    tables = (cos, sin) if half else (np.zeros((0, 0), np.float32),) * 2
    ref = jax.jit(
        functools.partial(
            kernels._attention_step_reference, heads=n, interleaved=interleaved, **static
        )
    )
    want = ref(qkv, *tables, rot, total, old_k, old_v, past)
    np.testing.assert_array_equal(keys, np.asarray(want[1]))
    np.testing.assert_array_equal(values, np.asarray(want[2]))
    assert not np.array_equal(keys, old_k)
    # the keys the reference rotated, through the attention kernel
    w = np.minimum(past, cached - s)
    new_k = np.stack([np.asarray(want[1])[i, :, w[i] : w[i] + s] for i in range(b)])
    new_v = np.stack([np.asarray(want[2])[i, :, w[i] : w[i] + s] for i in range(b)])
    rows = qkv[:, :, :n]
    if half:
        c, t = np.take(cos, rot, axis=0, mode="wrap"), np.take(sin, rot, axis=0, mode="wrap")
        inside = (rot >= -cos.shape[0]) & (rot < cos.shape[0])
        c[~inside], t[~inside] = np.nan, np.nan
        turn = jax.jit(lambda x, c, t: _rotated(x, c, t, half, interleaved))
        rows = np.asarray(turn(rows, c, t))
    fused = jax.jit(lambda q, k, v: kernels.attention(
        q, k, v, total, old=(old_k, old_v, past), **static))  # fmt: skip
    np.testing.assert_array_equal(out, np.asarray(fused(rows, new_k, new_v)))
    np.testing.assert_allclose(out, np.asarray(want[0]), rtol=2e-5, atol=2e-5)
    for i in range(b):
        one = [np.asarray(a) for a in fn(*(a[i : i + 1] for a in args))]
        np.testing.assert_array_equal(one[0], out[i : i + 1])
        np.testing.assert_array_equal(one[1], keys[i : i + 1])


def _rotated(x, c, t, half, interleaved):
    """x [B, S, N, H] rotated by the angles c, t [B, S, half], as the op's rotate."""
    c, t = c[:, :, None, :], t[:, :, None, :]
    if interleaved:
        a, o = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        turned = jnp.stack([a * c - o * t, o * c + a * t], -1).reshape(x.shape[:-1] + (2 * half,))
    else:
        a, o = x[..., :half], x[..., half : 2 * half]
        turned = jnp.concatenate([a * c - o * t, o * c + a * t], -1)
    return jnp.concatenate([turned, x[..., 2 * half :]], -1)


@needs_kernels
def test_attention_step_writes_the_buffer_in_place(rng):
    """Donated, the buffers come back in the same memory (no copy of the cache a step); kept
    by the caller, the old buffers are left as they were."""
    qkv, total, old_k, old_v, past, cos, sin, rot = _step_case(rng, 2, 1, 4, 2, 32, 24, 16)
    rot = np.clip(rot, 0, 63)

    def step(qkv, old_k, old_v):
        return kernels.attention_step(qkv, total, (old_k, old_v, past), heads=4, scale=0.25,
                                      causal=True, rotary=(cos, sin, rot, False))  # fmt: skip

    keys, values = jnp.asarray(old_k), jnp.asarray(old_v)
    where = (keys.unsafe_buffer_pointer(), values.unsafe_buffer_pointer())
    donated = jax.jit(step, donate_argnums=(1, 2))
    assert "tj_gqa_step_f32" in donated.lower(qkv, keys, values).as_text()
    out, new_k, new_v = donated(qkv, keys, values)
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == where
    kept_k, kept_v = jnp.asarray(old_k), jnp.asarray(old_v)

    def both(qkv, k, v):
        out, new_k, new_v = step(qkv, k, v)
        return new_k, k + 0.0, new_v, v + 0.0

    new_k2, before_k, new_v2, before_v = jax.jit(both)(qkv, kept_k, kept_v)
    np.testing.assert_array_equal(np.asarray(before_k), old_k)
    np.testing.assert_array_equal(np.asarray(before_v), old_v)
    np.testing.assert_array_equal(np.asarray(new_k2), np.asarray(new_k))
    np.testing.assert_array_equal(np.asarray(new_v2), np.asarray(new_v))


@needs_kernels
def test_attention_step_is_refused_where_it_does_not_apply(rng):
    """Other dtypes, a buffer shorter than the step, QKV heads that do not add up, a rotary
    wider than the head: None (the op's own path)."""
    qkv, total, old_k, old_v, past, cos, sin, rot = _step_case(rng, 1, 1, 4, 2, 32, 8, 16)
    old = (old_k, old_v, past)

    def step(qkv, old, heads=4, rotary=None):
        return kernels.attention_step(qkv, total, old, heads=heads, scale=1.0, causal=True,
                                      rotary=rotary)  # fmt: skip

    assert step(qkv, old) is not None
    assert step(qkv.astype(jnp.bfloat16), old) is None
    assert step(qkv, old, heads=3) is None
    assert step(qkv, (old_k[:, :, :0], old_v[:, :, :0], past)) is None
    wide = np.zeros((64, 17), np.float32)
    assert step(qkv, old, rotary=(wide, wide, rot, False)) is None
    with kernels.off():
        assert step(qkv, old) is None


# ---------------------------------------------------------------- a @ x^T


@needs_kernels
@pytest.mark.parametrize(
    ("shape_a", "shape_x", "scale"),
    [
        ((1, 6, 1, 64), (1, 6, 300, 64), None),
        ((2, 3, 5, 40), (2, 3, 77, 40), 0.35),
        ((4, 13), (9, 13), None),
        ((3, 16, 8), (3, 130, 8), 0.125),
    ],
)
def test_matmul_nt_kernel_equals_the_reference_and_each_row_alone(rng, shape_a, shape_x, scale):
    """a @ (x * scale)^T within float32 rounding (x * scale rounded first), each row of a and
    each batch row bit for bit its result alone."""
    a = rng.standard_normal(shape_a).astype(np.float32)
    x = rng.standard_normal(shape_x).astype(np.float32)
    fn = jax.jit(lambda a, x: kernels.matmul_nt(a, x, scale))
    got = np.asarray(fn(a, x))
    xs = x if scale is None else x * np.float32(scale)
    want = np.matmul(a.astype(np.float64), np.swapaxes(xs.astype(np.float64), -1, -2))
    _close(got, want, shape_a[-1])
    for i in range(shape_a[-2]):  # a row of a alone
        one = np.asarray(fn(a[..., i : i + 1, :], x))
        np.testing.assert_array_equal(got[..., i : i + 1, :], one)
    if len(shape_a) > 2:  # a batch row alone
        np.testing.assert_array_equal(got[:1], np.asarray(fn(a[:1], x[:1])))
    for n in (1, 3, 5, 8, 16, 17, 33, shape_x[-2] - 1):  # keys in vectors, fours, ones alike
        n = max(1, min(n, shape_x[-2]))
        np.testing.assert_array_equal(got[..., :n], np.asarray(fn(a, x[..., :n, :])))
        np.testing.assert_array_equal(got[..., -n:], np.asarray(fn(a, x[..., -n:, :])))


@needs_kernels
def test_matmul_nt_kernel_is_refused_where_it_does_not_apply(rng):
    a = jnp.zeros((2, 4, 8), jnp.float32)
    x = jnp.zeros((2, 5, 8), jnp.float32)
    assert kernels.matmul_nt(a, x) is not None
    many = jnp.zeros((2, kernels.NT_MAX_ROWS + 1, 8), jnp.float32)
    assert kernels.matmul_nt(many, x) is None  # a prompt's scores: XLA's dot
    assert kernels.matmul_nt(a.astype(jnp.bfloat16), x.astype(jnp.bfloat16)) is None
    assert kernels.matmul_nt(a[:1], x) is None  # batch dimensions that broadcast
    assert kernels.matmul_nt(a, x[..., :7]) is None
    with kernels.off():
        assert kernels.matmul_nt(a, x) is None


@needs_kernels
def test_matmul_nt_kernel_under_vmap_and_grad(rng):
    a = rng.standard_normal((3, 2, 1, 16)).astype(np.float32)
    x = rng.standard_normal((3, 2, 9, 16)).astype(np.float32)
    ref = functools.partial(kernels._matmul_nt_reference, scale=0.5)
    one = lambda a, x: kernels.matmul_nt(a, x, 0.5)  # noqa: E731
    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.vmap(one))(a, x)), np.asarray(jax.vmap(ref)(a, x)), rtol=1e-5
    )
    for argnum in (0, 1):
        grad = jax.grad(lambda *v: jnp.sum(jnp.sin(one(*v))), argnum)(a, x)
        want = jax.grad(lambda *v: jnp.sum(jnp.sin(ref(*v))), argnum)(a, x)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- few rows a @ x


@needs_kernels
@pytest.mark.parametrize(
    ("shape_a", "shape_x"),
    [
        ((1, 6, 1, 300), (1, 6, 300, 64)),
        ((2, 3, 5, 77), (2, 3, 77, 70)),
        ((3, 16, 8), (3, 8, 130)),
        ((4, 6, 3, 1500), (4, 6, 1500, 64)),
        ((2, 2, 7), (2, 7, 5)),
    ],
)
def test_matmul_nn_kernel_equals_the_reference_and_each_row_alone(rng, shape_a, shape_x):
    """a @ x within float32 rounding, each row of a, each batch row and each block of columns
    bit for bit its result alone (rows in fours and ones, columns in vectors and one by one)."""
    a = rng.standard_normal(shape_a).astype(np.float32)
    x = rng.standard_normal(shape_x).astype(np.float32)
    fn = jax.jit(kernels.matmul_nn)
    got = np.asarray(fn(a, x))
    _close(got, np.matmul(a.astype(np.float64), x.astype(np.float64)), shape_a[-1])
    for i in range(shape_a[-2]):  # a row of a alone
        np.testing.assert_array_equal(
            got[..., i : i + 1, :], np.asarray(fn(a[..., i : i + 1, :], x))
        )
    np.testing.assert_array_equal(got[:1], np.asarray(fn(a[:1], x[:1])))  # a batch row alone
    for n in (1, 3, 8, 16, 17, 33, shape_x[-1] - 1):  # columns in vectors and alone alike
        n = max(1, min(n, shape_x[-1]))
        np.testing.assert_array_equal(got[..., :n], np.asarray(fn(a, x[..., :n])))
    parts = jax.jit(kernels.matmul_nn)  # x in two parts along K, read where they are
    for cut in (0, 1, shape_x[-2] // 2, shape_x[-2]):
        two = parts(a, x[..., :cut, :], x[..., cut:, :])
        np.testing.assert_array_equal(got, np.asarray(two))


@needs_kernels
def test_matmul_nn_kernel_is_refused_where_it_does_not_apply(rng):
    a = jnp.zeros((2, 4, 8), jnp.float32)
    x = jnp.zeros((2, 8, 5), jnp.float32)
    assert kernels.matmul_nn(a, x) is not None
    many = jnp.zeros((2, kernels.NT_MAX_ROWS + 1, 8), jnp.float32)
    assert kernels.matmul_nn(many, x) is None  # a prompt's weighted values: XLA's dot
    assert kernels.matmul_nn(a.astype(jnp.bfloat16), x.astype(jnp.bfloat16)) is None
    assert kernels.matmul_nn(a[:1], x) is None  # batch dimensions that broadcast
    assert kernels.matmul_nn(a[0], x[0]) is None  # no batch dimension
    assert kernels.matmul_nn(a, x[:, :7]) is None
    assert kernels.matmul_nn(a, x[:, :5], x[:, 5:, :4]) is None  # parts of other widths
    assert kernels.matmul_nn(a, x[:, :5], x[:, 4:]) is None  # rows that are not K
    empty = np.asarray(jax.jit(kernels.matmul_nn)(a[..., :0], x[:, :0]))
    np.testing.assert_array_equal(empty, np.zeros((2, 4, 5), np.float32))  # K = 0: zeros
    with kernels.off():
        assert kernels.matmul_nn(a, x) is None


@needs_kernels
def test_matmul_nn_kernel_under_vmap_and_grad(rng):
    a = rng.standard_normal((3, 2, 1, 16)).astype(np.float32)
    x = rng.standard_normal((3, 2, 16, 9)).astype(np.float32)
    ref = kernels._matmul_nn_reference
    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.vmap(kernels.matmul_nn))(a, x)),
        np.asarray(jax.vmap(ref)(a, x)),
        rtol=1e-5,
    )
    for argnum in (0, 1):
        grad = jax.grad(lambda *v: jnp.sum(jnp.sin(kernels.matmul_nn(*v))), argnum)(a, x)
        want = jax.grad(lambda *v: jnp.sum(jnp.sin(ref(*v))), argnum)(a, x)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)


@needs_kernels
def test_matmul_of_two_activations_runs_the_kernel_and_equals_onnxruntime(rng):
    """An ONNX MatMul of a decode step's weights and values (no constant operand) runs
    matmul_nn and equals onnxruntime; a prompt's (many rows) runs XLA's dot."""
    for rows in (1, 3, kernels.NT_MAX_ROWS + 1):
        a = rng.standard_normal((2, 3, rows, 50)).astype(np.float32)
        x = rng.standard_normal((2, 3, 50, 64)).astype(np.float32)
        check_op("MatMul", {"a": a, "b": x}, rtol=1e-5, atol=1e-5)
        text = jax.jit(onnx_nn._matmul).lower(a, x).as_text()
        assert ("tj_matmul_nn_f32" in text) == (rows <= kernels.NT_MAX_ROWS)


def _grouped_attention(batch, heads, groups, rows, keys, size, repeat: bool) -> onnx.ModelProto:
    """Attention over a cache and the step's rows joined (``Concat``, the present), whose keys
    and values are repeated for groups of query heads as optimum's exports write it (Unsqueeze,
    Expand, Reshape; ``repeat``), or given repeated already."""
    kv = heads // groups
    f32 = TensorProto.FLOAT
    shape_kv = [batch, kv if repeat else heads, keys - rows, size]
    shape_new = [batch, kv if repeat else heads, rows, size]
    nodes = [
        helper.make_node("Concat", ["past_k", "new_k"], ["k"], axis=2),
        helper.make_node("Concat", ["past_v", "new_v"], ["v"], axis=2),
    ]
    inits = []
    if repeat:
        inits = [
            numpy_helper.from_array(np.array([2], np.int64), "axes"),
            numpy_helper.from_array(np.array([batch, kv, groups, keys, size], np.int64), "wide"),
            numpy_helper.from_array(np.array([batch, heads, keys, size], np.int64), "merged"),
        ]
        for name in ("k", "v"):
            nodes += [
                helper.make_node("Unsqueeze", [name, "axes"], [f"{name}_u"]),
                helper.make_node("Expand", [f"{name}_u", "wide"], [f"{name}_e"]),
                helper.make_node("Reshape", [f"{name}_e", "merged"], [f"{name}_r"]),
            ]
    k, v = ("k_r", "v_r") if repeat else ("k", "v")
    nodes += [
        helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", v], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "grouped",
        [
            helper.make_tensor_value_info("q", f32, [batch, heads, rows, size]),
            helper.make_tensor_value_info("past_k", f32, shape_kv),
            helper.make_tensor_value_info("new_k", f32, shape_new),
            helper.make_tensor_value_info("past_v", f32, shape_kv),
            helper.make_tensor_value_info("new_v", f32, shape_new),
        ],
        [helper.make_tensor_value_info("y", f32, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
@pytest.mark.parametrize(("heads", "groups", "rows"), [(9, 3, 1), (6, 2, 3), (4, 4, 4), (4, 4, 5)])
def test_heads_repeated_for_grouped_queries_are_read_once(tmp_path, rng, heads, groups, rows):
    """Keys and values repeated for groups of query heads (optimum's repeat_kv), joined from a
    cache and the step's rows (the present), are read once per group and where their parts are:
    the output equals onnxruntime's and, bit for bit, the same attention over keys and values
    given repeated; the compiled program writes no repeated copy (no array of the repeated
    size) where the group's rows fit the kernels, and no joined one."""
    batch, keys, size = 2, 37, 16
    kv = heads // groups
    feeds = {"q": rng.standard_normal((batch, heads, rows, size)).astype(np.float32)}
    for name in ("k", "v"):
        feeds[f"past_{name}"] = rng.standard_normal((batch, kv, keys - rows, size)).astype(
            np.float32
        )
        feeds[f"new_{name}"] = rng.standard_normal((batch, kv, rows, size)).astype(np.float32)
    model = _grouped_attention(batch, heads, groups, rows, keys, size, repeat=True)
    got = run_jax(model, feeds)["y"]
    np.testing.assert_allclose(got, run_ort(model, feeds)["y"], rtol=1e-5, atol=1e-6)
    given = _grouped_attention(batch, heads, groups, rows, keys, size, repeat=False)
    wide = {k: np.repeat(v, groups, axis=1) if k != "q" else v for k, v in feeds.items()}
    np.testing.assert_array_equal(got, run_jax(given, wide)["y"])
    path = tmp_path / "grouped.onnx"
    onnx.save(model, path)
    loaded = tj.load(str(path))
    run = jax.jit(lambda params, inputs: loaded.trace({}, params, inputs))
    text = run.lower(loaded.params, feeds).compile().as_text()
    once = groups * rows <= kernels.NT_MAX_ROWS  # else (a prompt) XLA's products, repeated
    assert (f"f32[{batch},{heads},{keys},{size}]" not in text) == once  # the repeated values
    if once:
        assert f"f32[{batch},{kv},{keys},{size}]" not in text  # the joined ones
    assert "tj_matmul_nt_f32" in text and "tj_matmul_nn_f32" in text


# ---------------------------------------------------------------- axes swapped


@needs_kernels
@pytest.mark.parametrize(
    "shape", [(2, 300, 6, 64), (1, 1500, 6, 64), (3, 457, 5, 16), (1, 4096, 1, 32)]
)
def test_swap_axes_kernel_equals_swapaxes(rng, shape):
    """[A, B, C, D] -> [A, C, B, D], the values themselves; gradients and vmap through XLA's."""
    x = rng.standard_normal(shape).astype(np.float32)
    got = kernels.swap_axes(jnp.asarray(x))
    assert got is not None
    np.testing.assert_array_equal(np.asarray(got), np.swapaxes(x, 1, 2))
    jitted = jax.jit(kernels.swap_axes)(x)
    np.testing.assert_array_equal(np.asarray(jitted), np.swapaxes(x, 1, 2))
    grad = jax.grad(lambda v: jnp.sum(kernels.swap_axes(v) * np.arange(v.size).reshape(
        shape[0], shape[2], shape[1], shape[3])))(x)  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(grad), np.swapaxes(np.arange(x.size, dtype=np.float32).reshape(
            shape[0], shape[2], shape[1], shape[3]), 1, 2))  # fmt: skip
    many = jax.vmap(kernels.swap_axes)(np.stack([x, 2 * x]))
    np.testing.assert_array_equal(np.asarray(many[1]), np.swapaxes(2 * x, 1, 2))


@needs_kernels
def test_swap_axes_refuses_what_xla_copies_as_well(rng):
    small = jnp.zeros((1, 10, 6, 64), jnp.float32)  # a decode step's heads
    short = jnp.zeros((2, 4096, 64, 4), jnp.float32)  # runs of 4 values
    ints = jnp.zeros((2, 300, 6, 64), jnp.int32)
    rank3 = jnp.zeros((300, 6, 64), jnp.float32)
    for x in (small, short, ints, rank3):
        assert kernels.swap_axes(x) is None


@needs_kernels
@pytest.mark.parametrize("shape", [(8, 49152), (1, 49152), (3, 17), (2, 5, 33), (4, 1), (5, 16)])
def test_argmax_kernel_equals_jnp_argmax(rng, shape):
    """The first largest value of each row, the first NaN of a row that has one (NaN rows, rows
    of -inf, ties of +inf, the largest in the tail past the vectors), as jnp.argmax; vmap adds
    rows; the greedy choice takes the kernel."""
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1, shape[-1])  # a view: the rows of x
    rows, v = flat.shape
    flat[0, -1] = 9.0  # the largest last (past the whole vectors where V is not a multiple)
    if v > 7 and rows > 1:
        flat[-1, [2, 7]] = np.nan  # the first NaN
    if v > 7 and rows > 2:
        flat[1] = -np.inf  # every value -inf: the first
        flat[2, [1, 5]] = np.inf  # tied: the first
    want = np.argmax(x, axis=-1)
    got = jax.jit(kernels.argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    many = jax.vmap(kernels.argmax)(flat)
    np.testing.assert_array_equal(np.asarray(many), np.argmax(flat, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(select.argmax)(x)), want)
    assert "tj_argmax_f32" in jax.jit(select.argmax).lower(x).as_text()


@needs_kernels
def test_argmax_kernel_refuses_other_dtypes_and_empty_rows():
    assert kernels.argmax(jnp.zeros((2, 8), jnp.bfloat16)) is None
    assert kernels.argmax(jnp.zeros((2, 0), jnp.float32)) is None
    assert kernels.argmax(jnp.zeros((), jnp.float32)) is None
    ties = jnp.zeros((2, 8), jnp.bfloat16).at[1, 3].set(1.0)  # the jnp path: the same rule
    np.testing.assert_array_equal(np.asarray(select.argmax(ties)), [0, 3])


def _head_split_model(batch: int, t: int, heads: int, size: int) -> onnx.ModelProto:
    """A projection split into heads that the graph returns (a present's keys), also read as
    keys (scores of 4 queries over them, the fused TransposedMatMul) and as values."""
    f32 = TensorProto.FLOAT
    node = helper.make_node
    shape = numpy_helper.from_array(np.array([batch, t, heads, size], np.int64), "heads")
    nodes = [
        node("Reshape", ["y", "heads"], ["split"]),
        node("Transpose", ["split"], ["present"], perm=[0, 2, 1, 3]),
        node("Transpose", ["split"], ["kt"], perm=[0, 2, 3, 1]),
        node("MatMul", ["q", "kt"], ["scores"]),
        node("Transpose", ["split"], ["vt"], perm=[0, 2, 1, 3]),
        node("MatMul", ["p", "vt"], ["values"]),
    ]
    graph = helper.make_graph(
        nodes,
        "split",
        [
            helper.make_tensor_value_info("y", f32, [batch, t, heads * size]),
            helper.make_tensor_value_info("q", f32, [batch, heads, 4, size]),
            helper.make_tensor_value_info("p", f32, [batch, heads, 4, t]),
        ],
        [helper.make_tensor_value_info(n, f32, None) for n in ("present", "scores", "values")],
        [shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
def test_a_returned_head_split_is_copied_once_for_every_reader(tmp_path, rng):
    """The present's keys (a head split the graph returns) and the products reading them share one
    copy (kernels.swap_axes; XLA:CPU made a plain copy and then a transposed one for the output
    and another for each kernel); equal to onnxruntime."""
    batch, t, heads, size = 2, 300, 6, 64
    proto = _head_split_model(batch, t, heads, size)
    feeds = {
        "y": rng.standard_normal((batch, t, heads * size)).astype(np.float32),
        "q": rng.standard_normal((batch, heads, 4, size)).astype(np.float32),
        "p": rng.random((batch, heads, 4, t), dtype=np.float32),
    }
    got, want = run_jax(proto, feeds), run_ort(proto, feeds)
    np.testing.assert_array_equal(got["present"], want["present"])
    for name in ("scores", "values"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
    path = tmp_path / "split.onnx"
    onnx.save(proto, path)
    loaded = tj.load(str(path))
    run = jax.jit(lambda params, inputs: loaded.trace({}, params, inputs))
    text = run.lower(loaded.params, feeds).compile().as_text()
    assert text.count('custom_call_target="tj_swap_axes_f32"') == 1
    heads_major = f"f32[{batch},{heads},{t},{size}]"
    made = [line for line in text.splitlines() if f"= {heads_major}" in line]
    assert len(made) == 1, made  # the kernel's output alone


# ---------------------------------------------------------------- softmax


@needs_kernels
@pytest.mark.parametrize("shape", [(6, 40, 300), (3, 7, 13), (5,), (2, 1, 449), (4, 2048)])
def test_softmax_kernel_equals_the_reference_and_each_row_alone(rng, shape):
    """Within a few float32 ulp of float64 (masked keys and rows off the vector width too), each
    row bit for bit its result alone, a row of -inf or with NaN all NaN as the ops give."""
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0, : min(3, shape[-1] - 1)] = -np.inf  # masked keys
    fn = jax.jit(kernels.softmax)
    got = np.asarray(fn(x))
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=4e-6, atol=1e-30)
    rows = got.reshape(-1, shape[-1])
    for i in range(min(len(flat), 12)):
        np.testing.assert_array_equal(rows[i], np.asarray(fn(flat[i]))[...])
    special = np.array([[np.nan, 1, 2], [-np.inf] * 3, [3, 1, 2]], np.float32)
    np.testing.assert_array_equal(
        np.isnan(np.asarray(fn(special))), np.isnan(np.asarray(kernels._softmax_reference(special)))
    )


@needs_kernels
def test_softmax_kernel_runs_the_ops_softmax_and_is_refused_elsewhere(rng):
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    assert kernels.softmax(x.astype(np.float16)) is None
    with kernels.off():
        assert kernels.softmax(x) is None
    check_op("Softmax", {"x": x}, axis=-1)  # against onnxruntime, through the kernel
    check_op("Softmax", {"x": x}, axis=1)  # another axis: jax.numpy
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(kernels.softmax(x))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(kernels._softmax_reference(x))))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-6)
    batched = jax.vmap(kernels.softmax)(x)
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(kernels.softmax(x)))


# ---------------------------------------------------------------- SwiGLU's gate


def _silu_mul_inputs(rng, shape):
    gate = (rng.standard_normal(shape) * 6).astype(np.float32)
    flat = gate.reshape(-1)
    extremes = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4]
    flat[: len(extremes)] = extremes
    return gate, rng.standard_normal(shape).astype(np.float32)


@needs_kernels
@pytest.mark.parametrize("shape", [(3, 7, 41), (2, 5000), (1, 1, 1536), (13,)])
def test_silu_mul_kernel_equals_the_reference_and_each_row_alone(rng, shape):
    """(g * sigmoid(g)) * u within a few float32 ulp (shapes off the vector width, and one
    large enough for the pool), and each leading row's bits equal to its result alone."""
    gate, up = _silu_mul_inputs(rng, shape)
    fn = jax.jit(kernels.silu_mul)
    assert "tj_silu_mul_f32" in str(jax.make_jaxpr(kernels.silu_mul)(gate, up))
    got = np.asarray(fn(gate, up))
    g, u = gate.astype(np.float64), up.astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(got, want, rtol=1.6e-6, atol=1e-30)  # exp below -87.3: 0
    if len(shape) > 1:
        for i in range(shape[0]):
            np.testing.assert_array_equal(
                got[i : i + 1], np.asarray(fn(gate[i : i + 1], up[i : i + 1]))
            )


@needs_kernels
def test_silu_mul_kernel_is_refused_where_it_does_not_apply(rng):
    """Broadcast operands, other dtypes and the kernels off: jax.numpy, same function."""
    gate, up = _silu_mul_inputs(rng, (4, 24))
    for args in [(gate, up[:1]), (gate.astype(np.float16), up.astype(np.float16))]:
        assert "tj_silu_mul_f32" not in str(jax.make_jaxpr(kernels.silu_mul)(*args))
        want = kernels._silu_mul_reference(*args)
        np.testing.assert_array_equal(np.asarray(kernels.silu_mul(*args)), np.asarray(want))
    with kernels.off():
        assert "tj_silu_mul_f32" not in str(jax.make_jaxpr(kernels.silu_mul)(gate, up))


@needs_kernels
def test_silu_mul_kernel_under_vmap_and_grad(rng):
    gate, up = _silu_mul_inputs(rng, (3, 2, 20))
    ref = kernels._silu_mul_reference
    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.vmap(kernels.silu_mul))(gate, up)),
        np.asarray(jax.vmap(ref)(gate, up)),
        rtol=2e-6,
        atol=1e-30,
    )
    np.testing.assert_allclose(  # vmap over the gate alone
        np.asarray(jax.vmap(kernels.silu_mul, in_axes=(0, None))(gate, up[0])),
        np.asarray(jax.vmap(ref, in_axes=(0, None))(gate, up[0])),
        rtol=2e-6,
        atol=1e-30,
    )
    for argnum in (0, 1):
        grad = jax.grad(lambda *a: jnp.sum(kernels.silu_mul(*a)), argnum)(gate, up)
        want = jax.grad(lambda *a: jnp.sum(ref(*a)), argnum)(gate, up)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- MatMulNBits


def _nbits(rng, k, n, block, zero_points):
    blocks = -(-k // block)
    b = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.1 + 0.01).astype(np.float32)
    zp = None
    if zero_points == "packed":
        zp = rng.integers(0, 256, (n, -(-blocks // 2)), dtype=np.uint8)
    elif zero_points == "float":
        zp = (rng.random((n, blocks), dtype=np.float32) * 15).astype(np.float32)
    return b, scales, zp


def _nbits_reference(x, b, scales, zp, k, n, block):
    weight = np.asarray(_nbits_weight(b, scales, zp, None, k, n, block, 4), np.float64)
    return np.asarray(x, np.float64) @ weight.T


@needs_kernels
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("zero_points", [None, "packed", "float"])
@pytest.mark.parametrize(
    ("k", "n", "block"),
    [(32, 1, 32), (72, 10, 32), (128, 24, 16), (128, 24, 64), (576, 37, 32), (300, 20, 128)],
)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17])
def test_matmul_nbits_kernel(rng, monkeypatch, portable, zero_points, k, n, block, m):
    """Both code paths (VNNI where the CPU has it, and the portable one) against float64."""
    monkeypatch.setenv(kernels.PORTABLE_ENV, "1" if portable else "0")
    b, scales, zp = _nbits(rng, k, n, block, zero_points)
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert kernels.nbits_supported(4, block, k, None, scales, zp)

    def fn(x, b, scales, zp):
        ref = lambda x, b, s, z: x @ _nbits_weight(b, s, z, None, k, n, block, 4).T
        return kernels.matmul_nbits(x, b, scales, zp, n=n, block_size=block, reference=ref)

    y = jax.jit(fn)(x, b, scales, zp)
    _close(y, _nbits_reference(x, b, scales, zp, k, n, block), k)


def _int8_call(x, b, scales, zp, k, n, block):
    ref = lambda x, b, s, z: int8_product(x, b, s, z, k, n, block)
    fn = lambda x, b, s, z: kernels.matmul_nbits(
        x, b, s, z, n=n, block_size=block, reference=ref, int8=True
    )
    return np.asarray(jax.jit(fn)(x, b, scales, zp))


@needs_kernels
@pytest.mark.parametrize("zero_points", [None, "packed", "float"])
@pytest.mark.parametrize(("k", "block"), [(576, 32), (72, 32), (128, 16), (300, 128), (256, 64)])
@pytest.mark.parametrize("m", [1, 3, 8, 13])
@pytest.mark.parametrize("portable", [False, True])
def test_matmul_nbits_int8_kernel(rng, monkeypatch, portable, zero_points, k, block, m):
    """int8 activations (accuracy_level 4): the kernel agrees with the pure-JAX path, and each
    row's result is bit for bit the one it gets alone."""
    monkeypatch.setenv(kernels.PORTABLE_ENV, "1" if portable else "0")
    n = 21
    b, scales, zp = _nbits(rng, k, n, block, zero_points)
    x = (rng.standard_normal((m, k)) * rng.random((m, 1)) * 4).astype(np.float32)
    x[0, : block // 2] = 0  # a block of zeros has scale 0
    y = _int8_call(x, b, scales, zp, k, n, block)
    want = np.asarray(
        jax.jit(int8_product, static_argnums=(4, 5, 6))(x, b, scales, zp, k, n, block)
    )
    _close(y, want, k)
    assert np.abs(want - _nbits_reference(x, b, scales, zp, k, n, block)).max() > 1e-3
    for r in {0, m - 1}:
        np.testing.assert_array_equal(_int8_call(x[r : r + 1], b, scales, zp, k, n, block)[0], y[r])


@needs_kernels
@pytest.mark.parametrize(("k", "zero_points"), [(576, None), (1536, None), (96, "packed")])
def test_matmul_nbits_int8_rows_at_batch_1_8_64(rng, monkeypatch, k, zero_points):
    """The default model's int4 products (block 32): each row of batches of 8 and 64 is bit for
    bit its solo run, and the SIMD code equals the portable code at every batch."""
    n, block = 70, 32
    b, scales, zp = _nbits(rng, k, n, block, zero_points)
    x = (rng.standard_normal((64, k)) * 3).astype(np.float32)
    solo = {r: _int8_call(x[r : r + 1], b, scales, zp, k, n, block)[0] for r in (0, 7, 63)}
    for m in (8, 64):
        got = _int8_call(x[:m], b, scales, zp, k, n, block)
        for r in (r for r in solo if r < m):
            np.testing.assert_array_equal(got[r], solo[r])
        monkeypatch.setenv(kernels.PORTABLE_ENV, "1")
        np.testing.assert_array_equal(_int8_call(x[:m], b, scales, zp, k, n, block), got)
        monkeypatch.setenv(kernels.PORTABLE_ENV, "0")
    want = np.asarray(
        jax.jit(int8_product, static_argnums=(4, 5, 6))(x, b, scales, zp, k, n, block)
    )
    _close(_int8_call(x, b, scales, zp, k, n, block), want, k)


def test_int8_product_rows_are_independent(rng):
    """The pure-JAX int8 path: a row's result does not depend on the other rows, bit for bit."""
    k, n, block = 576, 50, 32
    b, scales, zp = _nbits(rng, k, n, block, "packed")
    x = rng.standard_normal((40, k)).astype(np.float32)
    fn = jax.jit(int8_product, static_argnums=(4, 5, 6))
    whole = np.asarray(fn(x, b, scales, zp, k, n, block))
    for rows in (x[:1], x[:8], x[[0, 5, 7]]):
        np.testing.assert_array_equal(np.asarray(fn(rows, b, scales, zp, k, n, block))[0], whole[0])


@needs_kernels
def test_matmul_nbits_int8_portable_equals_simd(rng, monkeypatch):
    """The kernel's SIMD and portable int8 code do the same float steps: equal bit for bit."""
    k, n, block = 576, 67, 32
    b, scales, zp = _nbits(rng, k, n, block, "packed")
    x = rng.standard_normal((5, k)).astype(np.float32)
    monkeypatch.setenv(kernels.PORTABLE_ENV, "0")
    simd = _int8_call(x, b, scales, zp, k, n, block)
    monkeypatch.setenv(kernels.PORTABLE_ENV, "1")
    np.testing.assert_array_equal(_int8_call(x, b, scales, zp, k, n, block), simd)


@pytest.mark.parametrize("kernels_on", [True, False])
def test_matmul_nbits_int8_matches_onnxruntime_level_4(rng, monkeypatch, kernels_on):
    """accuracy_level 4 quantizes the input to int8 by default, as onnxruntime's CPU kernels do;
    with the kernels and with the pure-JAX path."""
    if kernels_on and not kernels.enabled():
        pytest.skip("CPU kernels not available")
    if not kernels_on:
        monkeypatch.setattr(kernels, "enabled", lambda: False)
    monkeypatch.delenv(INT8_ENV, raising=False)
    k, n, block = 576, 40, 32
    b, scales, _ = _nbits(rng, k, n, block, None)
    for m in (1, 4, 130):
        inputs = {"a": rng.standard_normal((m, k)).astype(np.float32), "b": b, "scales": scales}
        check_op(
            "MatMulNBits",
            inputs,
            domain="com.microsoft",
            constants=("b", "scales"),
            rtol=1e-5,
            atol=1e-4,
            K=k,
            N=n,
            block_size=block,
            accuracy_level=4,
        )


def _mlas_vnni_cpu() -> bool:
    """Whether onnxruntime's MLAS runs its AVX512-VNNI int8 kernels here (the float steps the
    block-32 kernel follows)."""
    try:
        flags = next(
            line
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= set(flags)


def _ms_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """``graph`` as a model of opset 21 with com.microsoft's ops, IR version 10 (what
    onnxruntime's MatMulNBits and SkipSimplifiedLayerNormalization sessions load)."""
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def _nbits_session(k, n, b, scales, zp):
    inputs = ["a", "b", "scales"] + (["zp"] if zp is not None else [])
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=4,
    )
    inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "scales")]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp"))
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    return _ms_model(graph)


def _avx2_fma_cpu() -> bool:
    try:
        line = next(
            line
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma"} <= set(line.split())


@needs_kernels
@pytest.mark.parametrize("op", ["SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"])
@pytest.mark.parametrize("k", [64, 576, 100])
def test_rms_norms_follow_onnxruntime(rng, op, k):
    """onnxruntime's two RMS norms, with its float steps: bit for bit on CPUs with AVX2 and FMA
    (where onnxruntime runs its vector code), within float32 rounding elsewhere."""
    skip = op.startswith("Skip")
    names = ["x", "s", "g"] if skip else ["x", "g"]
    node = helper.make_node(op, names, ["y"], domain="com.microsoft" if skip else "", epsilon=1e-6)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, k])]
    if skip:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [3, 5, k]))
    gamma = (rng.standard_normal(k) * 0.5 + 1).astype(np.float32)
    graph = helper.make_graph(
        [node],
        "norm",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(gamma, "g")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    feeds = {"x": (rng.standard_normal((3, 5, k)) * 3).astype(np.float32)}
    if skip:
        feeds["s"] = rng.standard_normal((3, 5, k)).astype(np.float32)
    want = _ort(proto, feeds)["y"]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.onnx")
        onnx.save(proto, path)
        got = np.asarray(tj.load(path)(feeds)["y"])
    if _avx2_fma_cpu() and (skip or k % 8 == 0):  # other lengths: XLA's own steps
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("k", [13, 64, 576])
def test_the_skip_norm_gives_its_sum_from_the_same_call(rng, k):
    """SkipSimplifiedLayerNormalization with its sum output (the genai builder's residual
    stream): the sum bit for bit onnxruntime's (one float add an element), the norm as the
    norm's own test has it, both from one kernel call."""
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y", "", "", "sum"],
        domain="com.microsoft", epsilon=1e-6,
    )  # fmt: skip
    shape = [2, 3, k]
    gamma = (rng.standard_normal(k) * 0.5 + 1).astype(np.float32)
    graph = helper.make_graph(
        [node],
        "norm",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "s")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "sum")],
        [numpy_helper.from_array(gamma, "g")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    feeds = {
        "x": (rng.standard_normal(shape) * 3).astype(np.float32),
        "s": rng.standard_normal(shape).astype(np.float32),
    }
    want = _ort(proto, feeds)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.onnx")
        onnx.save(proto, path)
        got = {n: np.asarray(v) for n, v in tj.load(path)(feeds).items()}
    np.testing.assert_array_equal(got["sum"], want["sum"])
    if _avx2_fma_cpu():
        np.testing.assert_array_equal(got["y"], want["y"])
    else:
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)
    x, s, g = (jnp.asarray(feeds["x"]), jnp.asarray(feeds["s"]), jnp.asarray(gamma))

    def ref(a, b, g):
        v = a + b
        return v * jax.lax.rsqrt(jnp.mean(jnp.square(v), -1, keepdims=True) + 1e-6) * g, v

    def pair(a, b):
        return kernels.skip_rms_norm(a, b, g, 1e-6, ref)

    text = jax.jit(pair).lower(x, s).as_text()
    assert text.count("tj_skip_rms_norm") == 1 and "tj_rms_norm" not in text
    y, total = jax.jit(pair)(x, s)
    np.testing.assert_array_equal(np.asarray(total), got["sum"])
    np.testing.assert_array_equal(np.asarray(y), got["y"])
    # vmapped over both (folded into the call) and over x alone (the reference): the same rows
    for b, axes in ((s, (0, 0)), (s[0], (0, None))):
        yv, tv = jax.vmap(pair, in_axes=axes)(x, b)
        want_y, want_t = jax.vmap(lambda a, c: ref(a, c, g), in_axes=axes)(x, b)
        np.testing.assert_allclose(np.asarray(yv), np.asarray(want_y), rtol=2e-6, atol=2e-6)
        np.testing.assert_array_equal(np.asarray(tv), np.asarray(want_t))
    grad = jax.grad(lambda a: jnp.sum(pair(a, s)[0]) + jnp.sum(pair(a, s)[1] ** 2))(x)
    want_grad = jax.grad(lambda a: jnp.sum(ref(a, s, g)[0]) + jnp.sum(ref(a, s, g)[1] ** 2))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", [1, 3, 4, 5, 8, 18, 48])
def test_nbits_pack_round_trips(rng, blocks):
    """The kernel's layout of int4 weights (blocks of 32) holds the same values: unpacking it
    gives the stored bytes back, and it differs from them where a group of 4 blocks exists."""
    b = rng.integers(0, 256, (5, blocks, 16), dtype=np.uint8)
    packed = kernels.nbits_pack(b)
    assert packed.shape == b.shape and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(kernels.nbits_unpack(packed)), b)
    if blocks >= 4:
        assert (packed != b).any()
    # byte 4o + i of a group of 4 blocks holds the two runs of part o: values 16j + 4(t % 2) + i
    # (+ 64 for t >= 2, with o = 4j + t) and 8 further, low nibble first
    if blocks >= 4:
        values = np.stack([b[0, :4] & 15, b[0, :4] >> 4], -1).reshape(128)
        first = np.array([64 * (o % 4 >= 2) + 16 * (o // 4) + 4 * (o % 2) for o in range(16)])
        first = (first[:, None] + np.arange(4)).reshape(64)
        np.testing.assert_array_equal(packed[0, :4].reshape(64) & 15, values[first])
        np.testing.assert_array_equal(packed[0, :4].reshape(64) >> 4, values[first + 8])


@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (5, 3), (16, 18), (37, 4), (49, 7)])
def test_nbits_scales_and_zero_points_tiles_round_trip(rng, n, blocks):
    """Scales and 4-bit zero points of packed weights in tiles of 16 columns: block b of column c
    sits at [c // 16, b, c % 16], zero past N, and unpacking gives the stored arrays back."""
    scales = rng.random((n, blocks), dtype=np.float32)
    tiles = kernels.nbits_pack_scales(scales.reshape(-1), n, blocks)  # flat, as ONNX allows
    assert tiles.shape == (-(-n // 16), blocks, 16) and tiles.dtype == np.float32
    c = rng.integers(0, n, 8)
    b = rng.integers(0, blocks, 8)
    np.testing.assert_array_equal(tiles[c // 16, b, c % 16], scales[c, b])
    assert not tiles.reshape(-1, blocks, 16).transpose(0, 2, 1).reshape(-1, blocks)[n:].any()
    np.testing.assert_array_equal(np.asarray(kernels.nbits_unpack_scales(tiles, n)), scales)
    zp = rng.integers(0, 256, (n, -(-blocks // 2)), dtype=np.uint8)
    if blocks % 2:
        zp[:, -1] &= 15  # the unused high nibble: not kept
    zt = kernels.nbits_pack_zero_points(zp, n, blocks)
    assert zt.shape == tiles.shape and zt.dtype == np.uint8
    np.testing.assert_array_equal(zt[c // 16, b, c % 16], (zp[c, b // 2] >> (4 * (b % 2))) & 15)
    np.testing.assert_array_equal(np.asarray(kernels.nbits_unpack_zero_points(zt, n)), zp)


@needs_kernels
@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize(("k", "n"), [(576, 576), (1536, 70), (96, 21), (608, 33)])
def test_matmul_nbits_block32_follows_onnxruntime(rng, monkeypatch, zero_points, k, n):
    """Blocks of 32 with int8 input take MLAS's float steps: on CPUs where onnxruntime runs its
    AVX512-VNNI kernel, the results equal onnxruntime's bit for bit, with the weights as stored
    or prepacked, SIMD or portable code, at 1 to 64 rows; elsewhere they agree within float32
    rounding."""
    b, scales, zp = _nbits(rng, k, n, 32, zero_points)
    session = ort.InferenceSession(
        _nbits_session(k, n, b, scales, zp).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    blocks = -(-k // 32)
    packed = (
        kernels.nbits_pack(b),
        kernels.nbits_pack_scales(scales, n, blocks),
        None if zp is None else kernels.nbits_pack_zero_points(zp, n, blocks),
    )
    ref = lambda x, b, s, z: int8_product(x, b, s, z, k, n, 32)
    for m in (1, 4, 5, 64):
        x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
        theirs = session.run(["y"], {"a": x})[0]
        for portable in ("0", "1"):
            monkeypatch.setenv(kernels.PORTABLE_ENV, portable)
            for weights, is_packed in (((b, scales, zp), False), (packed, True)):
                fn = lambda x, w, s, z, p=is_packed: kernels.matmul_nbits(
                    x, w, s, z, n=n, block_size=32, reference=ref, int8=True, packed=p
                )
                ours = np.asarray(jax.jit(fn)(x, *weights))
                if _mlas_vnni_cpu():
                    np.testing.assert_array_equal(ours, theirs)
                else:
                    _close(ours, theirs.astype(np.float64), k)


def _packed_nbits(b, scales, zp, n, k):
    blocks = -(-k // 32)
    return (
        kernels.nbits_pack(b),
        kernels.nbits_pack_scales(scales, n, blocks),
        None if zp is None else kernels.nbits_pack_zero_points(zp, n, blocks),
    )


@needs_kernels
@pytest.mark.parametrize("portable", ["0", "1"])
@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (96, 21), (608, 33)])
def test_matmul_nbits_gate_up_equals_its_three_calls(rng, monkeypatch, portable, zero_points, k, n):
    """SwiGLU's gate and up products and their activation in one call: bit for bit the gated
    activation of the two products' calls, at 1, 8 and 64 rows, each row as its solo run, and
    within live_rows the live rows alone."""
    monkeypatch.setenv(kernels.PORTABLE_ENV, portable)
    gate = _packed_nbits(*_nbits(rng, k, n, 32, zero_points), n, k)
    up = _packed_nbits(*_nbits(rng, k, n, 32, zero_points), n, k)

    def ref(x, *weights):
        g = int8_product(x, *weights[:3], k, n, 32)
        return kernels.silu_mul(g, int8_product(x, *weights[3:], k, n, 32))

    def one(x, w):
        return kernels.matmul_nbits(x, *w, n=n, block_size=32, reference=None, int8=True,
                                    packed=True)  # fmt: skip

    three = jax.jit(lambda x: kernels.silu_mul(one(x, gate), one(x, up)))
    fused = jax.jit(
        lambda x: kernels.matmul_nbits_gate_up(
            x, gate, up, n=n, block_size=32, reference=ref, int8=True
        )  # fmt: skip
    )
    x = (rng.standard_normal((64, k)) * 3).astype(np.float32)
    assert "tj_matmul_nbits_gate_up" in fused.lower(x).as_text()
    whole = np.asarray(fused(x))
    np.testing.assert_array_equal(whole, np.asarray(three(x)))
    for m in (1, 8):
        np.testing.assert_array_equal(np.asarray(fused(x[:m])), whole[:m])
    for r in (0, 5, 63):
        np.testing.assert_array_equal(np.asarray(fused(x[r : r + 1]))[0], whole[r])
    # the reference (gradients, vmap over the weights): XLA's float steps, within rounding
    np.testing.assert_allclose(whole, np.asarray(jax.jit(ref)(x, *_stored(gate, up, n))),
                               rtol=5e-4, atol=1e-3)  # fmt: skip
    steps = x[:12].reshape(6, 2, k)
    live = np.array([0, 1, 0, 0, 1, 1], bool)

    def in_live(x, live):
        with kernels.live_rows(live):
            return kernels.matmul_nbits_gate_up(x, gate, up, n=n, block_size=32, reference=ref,
                                                int8=True)  # fmt: skip

    run = jax.jit(in_live)
    assert "tj_matmul_nbits_gate_up_live" in run.lower(steps, live).as_text()
    got = np.asarray(run(steps, live))
    for r in np.flatnonzero(live):
        np.testing.assert_array_equal(got[r], whole[2 * r : 2 * r + 2])


def _stored(gate, up, n):
    """The packed weights of gate and up as stored (b, scales, zero points each)."""
    return [
        a
        for b, s, z in (gate, up)
        for a in kernels.nbits_unpack_all(
            jnp.asarray(b), jnp.asarray(s), None if z is None else jnp.asarray(z), n
        )  # fmt: skip
    ]


@needs_kernels
def test_matmul_nbits_vmap_and_grad(rng):
    k, n, block = 64, 12, 32
    b, scales, zp = _nbits(rng, k, n, block, "packed")
    x = rng.standard_normal((3, 2, k)).astype(np.float32)
    ref = lambda x, b, s, z: x @ _nbits_weight(b, s, z, None, k, n, block, 4).T

    def fn(x, scales):
        return kernels.matmul_nbits(x, b, scales, zp, n=n, block_size=block, reference=ref)

    _close(jax.vmap(fn, (0, None))(x, scales), _nbits_reference(x, b, scales, zp, k, n, block), k)
    batched = np.stack([scales, 2 * scales])
    want = np.stack([_nbits_reference(x[0], b, s, zp, k, n, block) for s in batched])
    _close(jax.vmap(fn, (None, 0))(x[0], batched), want, k)
    grads = jax.grad(lambda x, s: jnp.sum(fn(x, s) ** 2), argnums=(0, 1))(x, scales)
    want = jax.grad(lambda x, s: jnp.sum(ref(x, b, s, zp) ** 2), argnums=(0, 1))(x, scales)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------- concurrency


@needs_kernels
def test_concurrent_kernel_calls(rng):
    """Independent products in one program and programs run from several threads at once."""
    k, n = 300, 650
    ws = [rng.standard_normal((k, n)).astype(np.float32) for _ in range(4)]
    packed = [jnp.asarray(kernels.pack(w)) for w in ws]
    b, scales, _ = _nbits(rng, k, n, 32, None)
    ref = lambda x, b, s, z: x @ _nbits_weight(b, s, z, None, k, n, 32, 4).T

    @jax.jit
    def program(x):
        ys = [kernels.matmul(x, p, n) for p in packed]
        ys.append(kernels.matmul_nbits(x, b, scales, None, n=n, block_size=32, reference=ref))
        return ys

    x = rng.standard_normal((3, k)).astype(np.float32)
    want = [x.astype(np.float64) @ w for w in ws]
    want.append(_nbits_reference(x, b, scales, None, k, n, 32))
    errors = []

    def worker():
        try:
            for _ in range(20):
                for got, expected in zip(program(x), want, strict=True):
                    _close(got, expected, k)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "kernel calls deadlocked"
    assert not errors, errors[0]


# ---------------------------------------------------------------- inside models


def _ort(path_or_proto, feeds):
    proto = (
        path_or_proto if isinstance(path_or_proto, onnx.ModelProto) else onnx.load(path_or_proto)
    )
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _packed_ops(model: tj.Model) -> set[str]:
    return {op for domain, op in model.op_types if domain == prepack.DOMAIN}


def _products_model(rng) -> onnx.ModelProto:
    """Every supported use of a packed weight, and one weight that must stay as it is."""
    k, n, v = 40, 70, 90
    w = rng.standard_normal((k, n)).astype(np.float32)  # MatMul, Transpose -> Gather
    e = rng.standard_normal((v, k)).astype(np.float32)  # Gather, Transpose -> MatMul
    g = rng.standard_normal((n, k)).astype(np.float32)  # Gemm transB=1
    o = rng.standard_normal((k, n)).astype(np.float32)  # MatMul and Add: not packed
    q = rng.standard_normal((k, k)).astype(np.float32)  # both orientations: not packed
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(9)]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y0"]),
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("Gather", ["wt", "ids"], ["y1"]),
        helper.make_node("Gather", ["e", "ids"], ["y2"]),
        helper.make_node("Transpose", ["e"], ["et"]),
        helper.make_node("MatMul", ["x", "et"], ["y3"]),
        helper.make_node("Gemm", ["x", "g", "c"], ["y4"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("MatMul", ["x", "o"], ["y5"]),
        helper.make_node("Add", ["o", "o"], ["y6"]),
        helper.make_node("MatMul", ["x", "q"], ["y7"]),
        helper.make_node("Transpose", ["q"], ["qt"]),
        helper.make_node("MatMul", ["x", "qt"], ["y8"]),
    ]
    inits = [
        numpy_helper.from_array(a, name)
        for name, a in [
            ("w", w),
            ("e", e),
            ("g", g),
            ("o", o),
            ("q", q),
            ("c", rng.standard_normal(n).astype(np.float32)),
        ]
    ]
    graph = helper.make_graph(nodes, "products", [x, ids], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
def test_packed_graph_matches_onnxruntime(rng, tmp_path, monkeypatch):
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    proto = _products_model(rng)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    feeds = {
        "x": rng.standard_normal((3, 40)).astype(np.float32),
        "ids": np.array([[0, 5, -1], [69, 3, 2]]),
    }
    model = tj.load(path)
    assert _packed_ops(model) == {"PackedMatMul", "PackedGather", "PackedGemm"}
    assert model.params["w"].shape == (3, 40, kernels.STRIP)  # held once, packed
    assert model.params["o"].shape == (40, 70)  # also read by Add: not packed
    assert model.params["q"].shape == (40, 40)  # read as w and as w^T: not packed
    got = model(feeds)
    want = _ort(proto, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-4)


def _wide_model(rng, frames: int | str) -> onnx.ModelProto:
    """An encoder's shape: x [batch, frames, 16] times w; x reshaped to [batch, frames, -1]
    from its own Shape (Gather, Concat: rows known only by propagating data) times v; a short input
    y [batch, 8, 16] times u."""
    k = 16
    weights = {n: rng.standard_normal((k, 24)).astype(np.float32) for n in ("w", "v", "u")}
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", frames, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, k])
    index = numpy_helper.from_array(np.array([0, 1], np.int64), "leading")
    rest = numpy_helper.from_array(np.array([-1], np.int64), "rest")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "leading"], ["batch"]),
        helper.make_node("Concat", ["batch", "rest"], ["sizes"], axis=0),
        helper.make_node("Reshape", ["x", "sizes"], ["again"]),
        helper.make_node("MatMul", ["again", "v"], ["xv"]),
        helper.make_node("MatMul", ["y", "u"], ["yu"]),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("xw", "xv", "yu")]
    inits = [numpy_helper.from_array(a, n) for n, a in weights.items()] + [index, rest]
    graph = helper.make_graph(nodes, "wide", [x, y], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
@pytest.mark.parametrize("frames", [kernels.MATMUL_MAX_ROWS + 88, 40, "frames"])
def test_weights_of_products_always_too_tall_for_the_kernel_stay_as_stored(rng, tmp_path, frames):
    """A product whose rows the graph's static input sizes put over MATMUL_MAX_ROWS always runs
    as XLA's dot: its weight stays as stored (the dot would unpack it on every call), also where
    only data propagation finds the rows; shorter products, and any where the input sizes are
    not static, are packed. The outputs are onnxruntime's either way."""
    proto = _wide_model(rng, frames)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    tall = frames == kernels.MATMUL_MAX_ROWS + 88
    for name in ("w", "v"):
        assert model.params[name].shape == ((16, 24) if tall else (1, 16, kernels.STRIP))
    assert model.params["u"].shape == (1, 16, kernels.STRIP)
    rows = frames if isinstance(frames, int) else 600
    feeds = {
        "x": rng.standard_normal((2, rows, 16)).astype(np.float32),
        "y": rng.standard_normal((2, 8, 16)).astype(np.float32),
    }
    got = model(feeds)
    want = _ort(proto, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-5)


def _branches_model(rng) -> onnx.ModelProto:
    """A merged decoder's shape: both branches of an If read the outer weights, each with its
    own Transpose of the tied embedding under the same name; one weight is also added."""
    k, v = 40, 90
    e = rng.standard_normal((v, k)).astype(np.float32)  # Gather, Transpose -> MatMul (twice)
    w = rng.standard_normal((k, k)).astype(np.float32)  # MatMul in both branches
    h = rng.standard_normal((k, k)).astype(np.float32)  # MatMul, and Add: not packed
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [3])
    cond = helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])

    def branch(name: str, added: bool) -> onnx.GraphProto:
        nodes = [
            helper.make_node("Gather", ["e", "ids"], [f"{name}_emb"]),
            helper.make_node("Add", [f"{name}_emb", "x"], [f"{name}_in"]),
            helper.make_node("MatMul", [f"{name}_in", "w"], [f"{name}_h"]),
            helper.make_node("Transpose", ["e"], ["et"], perm=[1, 0]),
            helper.make_node("MatMul", [f"{name}_h", "et"], [f"{name}_logits"]),
            helper.make_node("Add", ["h", "h"], ["hh"]) if added else None,
            helper.make_node("MatMul", [f"{name}_h", "hh" if added else "h"], [f"{name}_h2"]),
        ]
        nodes = [n for n in nodes if n is not None]
        outs = [
            helper.make_tensor_value_info(f"{name}_logits", TensorProto.FLOAT, None),
            helper.make_tensor_value_info(f"{name}_h2", TensorProto.FLOAT, None),
        ]
        return helper.make_graph(nodes, name, [], outs)

    node = helper.make_node(
        "If",
        ["use_cache_branch"],
        ["logits", "h2"],
        then_branch=branch("cached", False),
        else_branch=branch("first", True),
    )
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("logits", "h2")]
    inits = [numpy_helper.from_array(a, n) for n, a in [("e", e), ("w", w), ("h", h)]]
    graph = helper.make_graph([node], "merged", [x, ids, cond], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
def test_weights_read_in_if_branches_are_packed(rng, tmp_path, monkeypatch):
    # decoder_model_merged.onnx (optimum) reads every weight inside its If's branches: unpacked,
    # whisper's decoder ran XLA's dot at batch 4 at a quarter of the packed speed
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    proto = _branches_model(rng)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert model.params["e"].shape == (-(-90 // kernels.STRIP), 40, kernels.STRIP)
    assert model.params["w"].shape == (-(-40 // kernels.STRIP), 40, kernels.STRIP)
    assert model.params["h"].shape == (40, 40)  # also read by Add in one branch: not packed
    for branch in (True, False):
        feeds = {
            "x": rng.standard_normal((3, 40)).astype(np.float32),
            "ids": np.array([0, 89, 7]),
            "use_cache_branch": np.array([branch]),
        }
        got, want = model(feeds), _ort(proto, feeds)
        for name, value in want.items():
            np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-4)


def _gates_model() -> onnx.ModelProto:
    """SwiGLU gates to fuse (operands in either order, one in an If branch) and four look-alikes
    that must stay: a Sigmoid read elsewhere, a Sigmoid of another value, an inner product that
    is a graph output, and one read only by a nested graph."""
    info = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 8])  # noqa: E731
    node = helper.make_node

    def gate(tag, sig_of, first, second, up, *, outer_mul=None):
        return [
            node("Sigmoid", [sig_of], [f"s{tag}"]),
            node("Mul", [first, f"s{tag}"] if second else [f"s{tag}", first], [f"m{tag}"]),
            node("Mul", [f"m{tag}", up] if outer_mul is None else [up, f"m{tag}"], [f"y{tag}"]),
        ]

    branch_nodes = gate("4", "a", "a", True, "b")
    then_branch = helper.make_graph(branch_nodes + [node("Neg", ["m6"], ["z6"])], "then", [],
                                    [info("y4"), info("z6")])  # fmt: skip
    else_branch = helper.make_graph(
        [node("Identity", ["a"], ["e4"]), node("Identity", ["b"], ["e6"])],
        "else",
        [],
        [info("e4"), info("e6")],
    )
    nodes = [
        *gate("1", "a", "a", False, "b", outer_mul=True),  # Mul(s, a), Mul(b, m): fused
        *gate("2", "a", "a", True, "b"),
        node("Neg", ["s2"], ["n2"]),  # s2 read elsewhere: kept
        *gate("3", "c", "a", True, "b"),  # a * Sigmoid(c): kept
        *gate("5", "b", "b", True, "a"),  # m5 is a graph output: kept
        *gate("6", "c", "c", True, "a")[:2],  # m6 read by the If's branch only: kept
        node("Mul", ["m6", "a"], ["y6"]),
        node("If", ["cond"], ["y4", "z6"], then_branch=then_branch, else_branch=else_branch),
    ]
    inputs = [info("a"), info("b"), info("c")]
    inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    outputs = [info(n) for n in ("y1", "y2", "n2", "y3", "y5", "m5", "y6", "y4", "z6")]
    graph = helper.make_graph(nodes, "gates", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _count_ops(graph: onnx.GraphProto, op_type: str) -> int:
    count = sum(n.op_type == op_type for n in graph.node)
    return count + sum(
        _count_ops(sub, op_type)
        for n in graph.node
        for a in n.attribute
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else [])
    )


@needs_kernels
def test_swiglu_gates_are_fused_where_nothing_else_reads_them(rng, tmp_path):
    proto = _gates_model()
    path = tmp_path / "gates.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _count_ops(model.graph.proto, "SiluMul") == 2  # y1 and the branch's y4
    assert _count_ops(model.graph.proto, "Sigmoid") == 4
    with kernels.off():
        plain = tj.load(path)
    assert _count_ops(plain.graph.proto, "SiluMul") == 0
    for cond in (True, False):
        feeds = {n: (rng.standard_normal((2, 3, 8)) * 4).astype(np.float32) for n in "abc"}
        feeds["cond"] = np.array(cond)
        got, want = model(feeds), _ort(proto, feeds)
        with kernels.off():
            alone = plain(feeds)  # the ops one by one
        for name, value in want.items():  # onnxruntime's Sigmoid is an approximation
            np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(got[name], alone[name], rtol=2e-6, atol=1e-30)


def _attention_products_model() -> onnx.ModelProto:
    """Attention's products as optimum writes them: scores over K^T times a constant scale (a
    cache's keys), both operands transposed (an encoder's), values transposed; one K^T also a
    graph output (kept for it), a non-scalar scale (not fused), batch dimensions that broadcast
    (the fused op's plain path)."""
    node = helper.make_node
    f32 = TensorProto.FLOAT
    scale = numpy_helper.from_array(np.array(0.35, np.float32), "scale_value")
    inputs = [
        helper.make_tensor_value_info("q", f32, [2, 3, 4, 8]),  # [B, H, S, D]
        helper.make_tensor_value_info("k", f32, [2, 3, 10, 8]),  # a cache [B, H, L, D]
        helper.make_tensor_value_info("qs", f32, [2, 4, 3, 8]),  # [B, S, H, D]
        helper.make_tensor_value_info("ks", f32, [2, 10, 3, 8]),
        helper.make_tensor_value_info("p", f32, [2, 3, 4, 10]),
        helper.make_tensor_value_info("w", f32, [2, 3, 8, 10]),
        helper.make_tensor_value_info("q1", f32, [1, 3, 4, 8]),
    ]
    nodes = [
        node("Constant", [], ["c"], value=scale),
        node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        node("Mul", ["kt", "c"], ["kts"]),
        node("MatMul", ["q", "kts"], ["scores"]),  # fused, with the scale
        node("Transpose", ["qs"], ["qt"], perm=[0, 2, 1, 3]),
        node("Transpose", ["ks"], ["kst"], perm=[0, 2, 3, 1]),
        node("MatMul", ["qt", "kst"], ["both"]),  # fused, both operands
        node("Transpose", ["ks"], ["vt"], perm=[0, 2, 1, 3]),
        node("MatMul", ["p", "vt"], ["values"]),  # fused, the values
        node("Transpose", ["k"], ["kt2"], perm=[0, 1, 3, 2]),
        node("MatMul", ["q", "kt2"], ["shared"]),  # fused; kt2 is also an output
        node("Transpose", ["k"], ["kt3"], perm=[0, 1, 3, 2]),
        node("Mul", ["kt3", "w"], ["ktw"]),  # not a scalar: kt3 stays, the product is plain
        node("MatMul", ["q", "ktw"], ["weighted"]),
        node("MatMul", ["q1", "kt2"], ["broadcast"]),  # fused, computed by the plain path
    ]
    names = ["scores", "both", "values", "shared", "kt2", "weighted", "broadcast"]
    outputs = [helper.make_tensor_value_info(n, f32, None) for n in names]
    graph = helper.make_graph(nodes, "attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
def test_attention_products_over_transposed_operands_are_fused(rng, tmp_path):
    proto = _attention_products_model()
    path = tmp_path / "attention.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _count_ops(model.graph.proto, "TransposedMatMul") == 5
    assert _count_ops(model.graph.proto, "MatMul") == 1
    assert _count_ops(model.graph.proto, "Transpose") == 2  # kt2 (an output), kt3
    with kernels.off():
        plain = tj.load(path)
    assert _count_ops(plain.graph.proto, "TransposedMatMul") == 0
    feeds = {i.name: rng.standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in proto.graph.input}  # fmt: skip
    got, want = model(feeds), _ort(proto, feeds)
    with kernels.off():
        alone = plain(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[name], alone[name], rtol=1e-5, atol=1e-6)


@needs_kernels
def test_values_split_into_heads_take_matmul_nn_on_the_heads_copy(rng, tmp_path, monkeypatch):
    """p @ Transpose(v [B, T, N, H], (0, 2, 1, 3)) (fused into TransposedMatMul) runs
    kernels.matmul_nn on v's heads [B, N, T, H] (rows kept whole), not matmul_nt over a copy
    with v's last axis moved; equal to onnxruntime."""
    node = helper.make_node
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("p", f32, [2, 3, 4, 40]),
        helper.make_tensor_value_info("v", f32, [2, 40, 3, 16]),
    ]
    nodes = [
        node("Transpose", ["v"], ["vt"], perm=[0, 2, 1, 3]),
        node("MatMul", ["p", "vt"], ["values"]),
    ]
    outputs = [helper.make_tensor_value_info("values", f32, None)]
    proto = helper.make_model(
        helper.make_graph(nodes, "values", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    path = tmp_path / "values.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _count_ops(model.graph.proto, "TransposedMatMul") == 1
    calls = []
    for name in ("matmul_nn", "matmul_nt"):
        real = getattr(kernels, name)
        spy = lambda a, x, *rest, real=real, name=name: (
            calls.append((name, x.shape)) or real(a, x, *rest)
        )
        monkeypatch.setattr(kernels, name, spy)
    feeds = {
        "p": rng.random((2, 3, 4, 40), dtype=np.float32),
        "v": rng.standard_normal((2, 40, 3, 16)).astype(np.float32),
    }
    got = model(feeds)
    assert calls == [("matmul_nn", (2, 3, 40, 16))]
    np.testing.assert_allclose(
        np.asarray(got["values"]), _ort(proto, feeds)["values"], rtol=1e-5, atol=1e-6
    )


def _softmax_attention_model(h: int) -> onnx.ModelProto:
    """Attention without a mask, as exporters write it: an encoder's self-attention (q and k
    transposed and scaled, values transposed: the kernel), scores divided by a scale before the
    softmax (the kernel), cross-attention over more keys than queries (the ops' path); not
    fused: a softmax over another axis, probabilities that are also an output."""
    node = helper.make_node
    f32 = TensorProto.FLOAT

    def const(name, value):
        return node("Constant", [], [name], value=numpy_helper.from_array(
            np.array(value, np.float32), name + "_value"))  # fmt: skip

    inputs = [
        helper.make_tensor_value_info("x4", f32, [2, 37, 3, h]),  # [B, S, N, H] q, k and v
        helper.make_tensor_value_info("q", f32, [2, 3, 21, h]),  # [B, N, S, H]
        helper.make_tensor_value_info("kt", f32, [2, 3, h, 21]),
        helper.make_tensor_value_info("v", f32, [2, 3, 21, h]),
        helper.make_tensor_value_info("cross", f32, [2, 3, 50, h]),  # [B, N, T, H]
    ]
    nodes = [
        const("c1", 0.7),
        const("c2", 0.45),
        const("d", 2.5),
        node("Transpose", ["x4"], ["qt"], perm=[0, 2, 1, 3]),
        node("Mul", ["qt", "c1"], ["qs"]),
        node("Transpose", ["x4"], ["ktr"], perm=[0, 2, 3, 1]),
        node("Mul", ["ktr", "c2"], ["ks"]),
        node("MatMul", ["qs", "ks"], ["s1"]),
        node("Softmax", ["s1"], ["p1"], axis=-1),
        node("Transpose", ["x4"], ["vt"], perm=[0, 2, 1, 3]),
        node("MatMul", ["p1", "vt"], ["encoder"]),  # fused: the kernel
        node("MatMul", ["q", "kt"], ["s2"]),
        node("Div", ["s2", "d"], ["s2d"]),
        node("Softmax", ["s2d"], ["p2"], axis=-1),
        node("MatMul", ["p2", "v"], ["divided"]),  # fused: the kernel
        node("Transpose", ["cross"], ["ct"], perm=[0, 1, 3, 2]),
        node("MatMul", ["q", "ct"], ["s3"]),
        node("Softmax", ["s3"], ["p3"], axis=-1),
        node("MatMul", ["p3", "cross"], ["crossed"]),  # fused: 21 queries, 50 keys
        node("MatMul", ["q", "kt"], ["s4"]),
        node("Softmax", ["s4"], ["p4"], axis=2),
        node("MatMul", ["p4", "v"], ["other_axis"]),  # not fused
        node("MatMul", ["q", "kt"], ["s5"]),
        node("Softmax", ["s5"], ["p5"], axis=-1),
        node("MatMul", ["p5", "v"], ["shown"]),  # not fused: p5 is an output
    ]
    names = ["encoder", "divided", "crossed", "other_axis", "shown", "p5"]
    outputs = [helper.make_tensor_value_info(n, f32, None) for n in names]
    graph = helper.make_graph(nodes, "softmax_attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_kernels
def test_attention_without_a_mask_is_fused_into_the_kernel(rng, tmp_path, monkeypatch):
    """MatMul(Softmax(scores), values) without a mask is one SoftmaxAttention: self-attention
    runs the attention kernel, other shapes the ops; both give onnxruntime's results and the
    ops' own, one by one."""
    h = 2 * kernels.build.vector_lanes()
    proto = _softmax_attention_model(h)
    path = tmp_path / "softmax_attention.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _count_ops(model.graph.proto, "SoftmaxAttention") == 3
    assert _count_ops(model.graph.proto, "Softmax") == 2
    with kernels.off():
        plain = tj.load(path)
    assert _count_ops(plain.graph.proto, "SoftmaxAttention") == 0
    calls = []
    attention = kernels.attention

    def counted(*args, **kwargs):
        out = attention(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "attention", counted)
    feeds = {i.name: (rng.standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]) * 2).astype(np.float32)
        for i in proto.graph.input}  # fmt: skip
    got, want = model(feeds), _ort(proto, feeds)
    assert calls == [True, True]  # the two self-attentions; cross-attention takes the ops' path
    with kernels.off():
        alone = plain(feeds)
    split = copy.deepcopy(model.graph.proto)  # the ops put back (a padded cache's rewrite)
    assert fuse.split_softmax_attention(split) == 3
    assert _count_ops(split, "SoftmaxAttention") == 0 and _count_ops(split, "Softmax") == 5
    apart = model.with_graph(split)(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[name], alone[name], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(apart[name], alone[name], rtol=1e-5, atol=1e-5)


@needs_kernels
def test_int4_weights_prepacked_at_load(rng, tmp_path, monkeypatch):
    """MatMulNBits nodes that quantize their input (level 4, blocks of 32) read their weights in
    the kernel's layout, rearranged once at load, and give onnxruntime's results; switched to exact
    products after loading, the weights are read back in the stored layout."""
    k, n = 576, 40
    b, scales, zp = _nbits(rng, k, n, 32, "packed")
    proto = _nbits_session(k, n, b, scales, zp)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _packed_ops(model) == {"PackedMatMulNBits"}
    np.testing.assert_array_equal(np.asarray(model.params["b"]), kernels.nbits_pack(b))
    x = (rng.standard_normal((3, k)) * 2).astype(np.float32)
    want = _ort(proto, {"a": x})["y"]
    got = np.asarray(model({"a": x})["y"])
    if _mlas_vnni_cpu():
        np.testing.assert_array_equal(got, want)
    else:
        _close(got, want.astype(np.float64), k)
    monkeypatch.setenv(INT8_ENV, "0")
    assert _packed_ops(tj.load(path)) == set()  # exact products: not packed
    _close(model({"a": x})["y"], _nbits_reference(x, b, scales, zp, k, n, 32), k)
    monkeypatch.setenv(INT8_ENV, "1")
    monkeypatch.setattr(prepack, "PACK_MIN", 1 << 40)
    proto.graph.node[0].attribute.extend([helper.make_attribute("accuracy_level", 0)])
    del proto.graph.node[0].attribute[-2]  # accuracy_level 0: exact, not packed
    onnx.save(proto, path)
    assert _packed_ops(tj.load(path)) == set()


def _gate_up_model(rng, k, n, *, also_read: bool = False, fp32: bool = False) -> onnx.ModelProto:
    """SwiGLU's gate: (g * Sigmoid(g)) * u of two int8 MatMulNBits products of ``a`` (``fp32``:
    two MatMul; ``also_read``: u is a graph output too)."""
    nodes, inits = [], []
    for name in ("g", "u"):
        if fp32:
            w = (rng.standard_normal((k, n)) * 0.2).astype(np.float32)
            nodes.append(helper.make_node("MatMul", ["a", f"{name}_w"], [name]))
            inits.append(numpy_helper.from_array(w, f"{name}_w"))
            continue
        b, scales, _ = _nbits(rng, k, n, 32, None)
        nodes.append(helper.make_node(
            "MatMulNBits", ["a", f"{name}_b", f"{name}_s"], [name], domain="com.microsoft",
            K=k, N=n, bits=4, block_size=32, accuracy_level=4,
        ))  # fmt: skip
        inits += [
            numpy_helper.from_array(b, f"{name}_b"),
            numpy_helper.from_array(scales, f"{name}_s"),
        ]
    nodes += [
        helper.make_node("Sigmoid", ["g"], ["sig"]),
        helper.make_node("Mul", ["g", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "u"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])]
    if also_read:
        outputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, ["m", n]))
    graph = helper.make_graph(
        nodes, "gate", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        outputs, inits,
    )  # fmt: skip
    return _ms_model(graph)


@needs_kernels
@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("also_read", [False, True])
def test_gate_and_up_products_fuse_into_one_call(rng, tmp_path, monkeypatch, also_read, fp32):
    """Two int4 (or packed float32) products of one input gated by SiLU become one
    PackedGateUpNBits (PackedGateUp), not where a product's output is read elsewhere too, with
    onnxruntime's values."""
    k, n = 96, 40
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    proto = _gate_up_model(rng, k, n, also_read=also_read, fp32=fp32)
    path = str(tmp_path / "gate.onnx")
    onnx.save(proto, path)
    model = tj.load(path)
    product = "PackedMatMul" if fp32 else "PackedMatMulNBits"
    alone = "PackedGateUp" if fp32 else "PackedGateUpNBits"
    fused = {alone} if not also_read else {product, "SiluMul"}
    assert _packed_ops(model) == fused
    x = (rng.standard_normal((5, k)) * 2).astype(np.float32)
    want = _ort(proto, {"a": x})
    got = model({"a": x})
    for name in want:  # onnxruntime's own SiLU differs from the kernels' in the last bits
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-5, atol=1e-5)
    if not also_read:  # the values of the three calls, bit for bit
        with monkeypatch.context() as patch:
            patch.setattr(fuse, "gate_up", lambda graph: 0)
            plain = tj.load(path)
        assert _packed_ops(plain) == {product, "SiluMul"}
        np.testing.assert_array_equal(np.asarray(got["y"]), np.asarray(plain({"a": x})["y"]))


def _skip_norm_model(
    rng, k, n, *, swapped: bool, also_read: bool, fp32: bool = False
) -> onnx.ModelProto:
    """SkipSimplifiedLayerNormalization(MatMulNBits(a), skip, gamma) (``fp32``: of a MatMul;
    ``swapped``: the product its skip input; ``also_read``: the product a graph output too),
    outputs y and the sum."""
    gamma = (rng.standard_normal(n) * 0.5 + 1).astype(np.float32)
    inputs = ["skip", "p"] if swapped else ["p", "skip"]
    if fp32:
        w = (rng.standard_normal((k, n)) * 0.2).astype(np.float32)
        product = helper.make_node("MatMul", ["a", "w"], ["p"])
        weights = [(w, "w")]
    else:
        b, scales, _ = _nbits(rng, k, n, 32, None)
        product = helper.make_node("MatMulNBits", ["a", "b", "s"], ["p"], domain="com.microsoft",
                                   K=k, N=n, bits=4, block_size=32, accuracy_level=4)  # fmt: skip
        weights = [(b, "b"), (scales, "s")]
    nodes = [
        product,
        helper.make_node("SkipSimplifiedLayerNormalization", [*inputs, "gamma"],
                         ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-5),
    ]  # fmt: skip
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["m", n])
        for name in ("y", "sum", *(["p"] if also_read else []))
    ]
    inits = [numpy_helper.from_array(a, name) for a, name in [*weights, (gamma, "gamma")]]
    graph = helper.make_graph(nodes, "skip_norm", [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k]),
        helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["m", n]),
    ], outputs, inits)  # fmt: skip
    return _ms_model(graph)


@needs_kernels
@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize(("swapped", "also_read"), [(False, False), (True, False), (False, True)])
def test_a_product_and_the_norm_after_it_fuse_into_one_call(
    rng, tmp_path, monkeypatch, swapped, also_read, fp32
):
    """An int4 (or packed float32) product that a SkipSimplifiedLayerNormalization reads alone
    (as its input or its skip) becomes one PackedNBitsSkipNorm (PackedSkipNorm) with the two
    ops' values bit for bit and onnxruntime's within rounding; a product read elsewhere too
    stays apart."""
    k, n = 96, 40
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    proto = _skip_norm_model(rng, k, n, swapped=swapped, also_read=also_read, fp32=fp32)
    path = str(tmp_path / "skip_norm.onnx")
    onnx.save(proto, path)
    model = tj.load(path)
    product = "PackedMatMul" if fp32 else "PackedMatMulNBits"
    alone = "PackedSkipNorm" if fp32 else "PackedNBitsSkipNorm"
    assert _packed_ops(model) == ({product} if also_read else {alone})
    feeds = {
        "a": (rng.standard_normal((5, k)) * 2).astype(np.float32),
        "skip": rng.standard_normal((5, n)).astype(np.float32),
    }
    got = model(feeds)
    want = _ort(proto, feeds)
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-5, atol=1e-5)
    with monkeypatch.context() as patch:
        patch.setattr(fuse, "skip_norm", lambda graph: 0)
        plain = tj.load(path)
    assert _packed_ops(plain) == {product}
    apart = plain(feeds)
    for name in ("y", "sum"):
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(apart[name]))


def _fixture_graphs():
    for folder in ("llama-genai-fp32", "llama-optimum", "gemma3-genai-fp32", "gpt2-optimum"):
        path = FIXTURES / folder / "model.onnx"
        if path.exists():
            yield pytest.param(path, id=folder)


@needs_kernels
@pytest.mark.parametrize("path", list(_fixture_graphs()))
def test_fixture_with_every_weight_packed(path, monkeypatch):
    monkeypatch.setattr(prepack, "PACK_MIN", 0)
    model = tj.load(path)
    assert "PackedMatMul" in _packed_ops(model)
    if path.parent.name.startswith("llama"):  # SiLU-gated feed-forwards: one call each
        assert "PackedGateUp" in _packed_ops(model)
    for batch, length, past in [(1, 5, 0), (2, 1, 4)]:
        feeds = example_inputs(model, batch=batch, length=length, past=past)
        if batch > 1 and any(
            n.op_type == "GroupQueryAttention" for n in onnx.load(path).graph.node
        ):
            continue  # onnxruntime's GQA wants batch 1 with a past and several tokens only
        got = model(feeds)
        want = _ort(str(path), feeds)
        for name in want:
            np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=0, atol=1e-4)


def test_kernels_off_by_env(rng, monkeypatch, tmp_path):
    monkeypatch.setenv(build.ENV, "0")
    assert not kernels.enabled()
    proto = _products_model(rng)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert not _packed_ops(model)
    feeds = {
        "x": rng.standard_normal((3, 40)).astype(np.float32),
        "ids": np.array([[0, 5, -1], [69, 3, 2]]),
    }
    got = model(feeds)
    want = _ort(proto, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5, atol=1e-4)
    w = rng.standard_normal((40, 70)).astype(np.float32)  # the pure-JAX path of the kernels
    y = kernels.matmul(feeds["x"], jnp.asarray(kernels.pack(w)), 70)
    _close(y, feeds["x"].astype(np.float64) @ w, 40)


def test_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("TRANSMUTER_JAX_CACHE", str(tmp_path))
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(build, "compiler", lambda: str(broken))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build._load() is None
    assert any("building the CPU kernels failed" in str(w.message) for w in caught)
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert build._load() is None


# ---------------------------------------------------------------- the build cache

_PROBE = """
import jax.numpy as jnp, numpy as np
from transmuter_jax import kernels
from transmuter_jax.kernels import build
assert kernels.available(), "the kernels did not load"
w = np.arange(12, dtype=np.float32).reshape(3, 4)
y = kernels.matmul(np.ones((2, 3), np.float32), jnp.asarray(kernels.pack(w)), 4)
np.testing.assert_allclose(np.asarray(y), np.ones((2, 3)) @ w)
print(build.build(build.compiler()))
"""


def _probe(cache: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRANSMUTER_JAX_CACHE=str(cache))
    env.pop(build.ENV, None)
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=pathlib.Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@needs_kernels
def test_truncated_kernel_library_is_rebuilt_by_a_fresh_process(tmp_path):
    """A truncated library in the cache (once a SIGBUS in ctypes.CDLL) is rebuilt, not loaded."""
    built = build.build(build.compiler())
    folder = tmp_path / "kernels" / built.parent.name
    shutil.copytree(built.parent, folder, ignore=shutil.ignore_patterns("*.lock", "tmp*"))
    library = folder / build.LIBRARY
    good = library.read_bytes()
    assert build.verified(library)
    with open(library, "r+b") as handle:
        handle.truncate(len(good) // 3)
    assert not build.verified(library)
    done = _probe(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert pathlib.Path(done.stdout.split()[-1]) == library
    assert build.verified(library) and library.stat().st_size > len(good) // 3
    again = _probe(tmp_path)  # and the rebuilt library loads as it is
    assert again.returncode == 0, again.stderr[-2000:]


def test_kernel_library_checksum(tmp_path):
    """verified(): the library must match the sha256 kept beside it, byte for byte."""
    library = tmp_path / build.LIBRARY
    library.write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
    assert not build.verified(library)  # no checksum (an interrupted build)
    (tmp_path / build.CHECKSUM).write_text(hashlib.sha256(library.read_bytes()).hexdigest())
    assert build.verified(library)
    data = bytearray(library.read_bytes())
    data[100] ^= 1
    library.write_bytes(bytes(data))
    assert not build.verified(library)
    library.unlink()
    assert not build.verified(library)


def test_kernel_cache_key_names_the_cpu(monkeypatch):
    """A library built with -march=native for one CPU is never found by another."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler")
    identity = build.cpu_identity()
    if pathlib.Path("/proc/cpuinfo").exists():
        assert "flags=" in identity or "Features=" in identity  # x86 or Arm
    here = build._key(build.compiler())
    monkeypatch.setattr(build, "cpu_identity", lambda: identity + " avx512f")
    assert build._key(build.compiler()) != here


def test_a_product_of_another_k_is_refused_at_trace_time():
    """x of another K than the packed weight gets the product's own shape error when traced
    (as the unpacked path does), not the kernel's error when run."""
    packed = kernels.pack(np.ones((12, 40), np.float32))
    with pytest.raises(TypeError, match="contracting dimensions"):
        jax.jit(lambda x: kernels.matmul(x, packed, 40))(np.ones((2, 1), np.float32))
    got = jax.jit(lambda x: kernels.matmul(x, packed, 40))(np.ones((2, 12), np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.full((2, 40), 12.0, np.float32))


def _tied_nbits_model(k, n, b, scales, zp, *, other_reader=False):
    """An int4 output product whose weight is also the embedding table (through a Reshape and
    GatherBlockQuantized, as onnxruntime-genai's builder ties them); ``other_reader``: the scales
    are read by one more node, which no packing serves."""
    blocks = -(-k // 32)
    qz = ["zp"] if zp is not None else []
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(
            np.array([n, blocks * 16], np.int64))),
        helper.make_node("Reshape", ["b", "shape"], ["table"]),
        helper.make_node("GatherBlockQuantized", ["table", "ids", "scales", *qz], ["e"],
                         domain="com.microsoft", bits=4, block_size=32, gather_axis=0,
                         quantize_axis=1),
        helper.make_node("MatMulNBits", ["a", "b", "scales", *qz], ["y"], domain="com.microsoft",
                         K=k, N=n, bits=4, block_size=32, accuracy_level=4),
    ]  # fmt: skip
    outputs = [
        helper.make_tensor_value_info("e", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
    ]
    if other_reader:
        nodes.append(helper.make_node("Identity", ["scales"], ["s"]))
        outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "scales")]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp"))
    graph = helper.make_graph(
        nodes,
        "tied",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
        ],
        outputs,
        inits,
    )
    return _ms_model(graph)


@needs_kernels
@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize(("k", "n"), [(576, 40), (96, 19)])
def test_int4_tied_embedding_prepacked_at_load(rng, tmp_path, zero_points, k, n):
    """An embedding tied to an int4 product (a Reshape of its weight read by GatherBlockQuantized)
    no longer keeps the weight as stored: the gather reads the kernel's layouts and puts back only
    its rows. Both outputs equal onnxruntime's (the gather exactly, negative indices too)."""
    b, scales, zp = _nbits(rng, k, n, 32, zero_points)
    proto = _tied_nbits_model(k, n, b, scales, zp)
    path = tmp_path / "tied.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _packed_ops(model) == {"PackedMatMulNBits", "PackedGatherBlockQuantized"}
    assert _count_ops(model.graph.proto, "Reshape") == 0
    np.testing.assert_array_equal(np.asarray(model.params["b"]), kernels.nbits_pack(b))
    x = (rng.standard_normal((3, k)) * 2).astype(np.float32)
    ids = np.array([[0, n - 1, 5], [-1, -n, 7]], np.int64)
    want = _ort(proto, {"a": x, "ids": ids})
    got = model({"a": x, "ids": ids})
    np.testing.assert_array_equal(np.asarray(got["e"]), want["e"])
    if _mlas_vnni_cpu():
        np.testing.assert_array_equal(np.asarray(got["y"]), want["y"])
    else:
        _close(np.asarray(got["y"]), want["y"].astype(np.float64), k)
    with kernels.off():
        plain = tj.load(path)({"a": x, "ids": np.array([[n, -n - 1, 2], [1, 2, 3]], np.int64)})
    out_of_range = model({"a": x, "ids": np.array([[n, -n - 1, 2], [1, 2, 3]], np.int64)})
    np.testing.assert_array_equal(np.asarray(out_of_range["e"]), np.asarray(plain["e"]))


@needs_kernels
def test_int4_shared_scales_with_another_reader_stay_as_stored(rng, tmp_path):
    """Scales read by a node no packing serves keep the weight, scales and gather as stored."""
    k, n = 96, 24
    b, scales, zp = _nbits(rng, k, n, 32, None)
    proto = _tied_nbits_model(k, n, b, scales, zp, other_reader=True)
    path = tmp_path / "shared.onnx"
    onnx.save(proto, path)
    model = tj.load(path)
    assert _packed_ops(model) == set()
    x = rng.standard_normal((2, k)).astype(np.float32)
    ids = np.array([[0, 1, 2], [3, 4, 5]], np.int64)
    got, want = model({"a": x, "ids": ids}), _ort(proto, {"a": x, "ids": ids})
    np.testing.assert_array_equal(np.asarray(got["s"]), scales)
    np.testing.assert_array_equal(np.asarray(got["e"]), want["e"])


@needs_kernels
def test_matmul_nbits_block32_simd_equals_portable_on_hostile_rows(rng, monkeypatch):
    """Rows with NaN, infinities, zeros and tiny values: the SIMD code (its int8 quantization of
    the input included) gives the portable code's bits, row by row."""
    k, n = 160, 24
    b, scales, zp = _nbits(rng, k, n, 32, None)
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 70] = -np.inf
    x[3, :32] = 0.0
    x[4, 100] = 1e-40
    x[5, 150] = np.nan
    ref = lambda x, b, s, z: int8_product(x, b, s, z, k, n, 32)
    got = {}
    for portable in ("0", "1"):
        monkeypatch.setenv(kernels.PORTABLE_ENV, portable)  # read when traced: a new function
        fn = lambda x, b, s: kernels.matmul_nbits(
            x, b, s, None, n=n, block_size=32, reference=ref, int8=True
        )
        got[portable] = np.asarray(jax.jit(fn)(x, b, scales))
    np.testing.assert_array_equal(got["0"], got["1"])
    assert np.isfinite(got["0"][3]).all()


_AHEAD_PROBE = """
import sys
import jax, numpy as np
from transmuter_jax import kernels
rng = np.random.default_rng(0)
ws = [kernels.pack(rng.standard_normal((256, 96)).astype(np.float32)) for _ in range(3)]
x = rng.standard_normal((1, 256)).astype(np.float32)
step = jax.jit(lambda x, ws: [kernels.matmul(x, w, 96) for w in ws])
outs = [np.asarray(o) for _ in range(4) for o in step(x, ws)]  # the pool learns the order
sys.stdout.write(np.stack(outs).tobytes().hex())
"""


@needs_kernels
def test_prefetching_the_next_weights_changes_no_bits():
    runs = {}
    for ahead in ("0", "4096"):
        env = dict(os.environ, TRANSMUTER_JAX_KERNEL_AHEAD_KB=ahead)
        done = subprocess.run(
            [sys.executable, "-c", _AHEAD_PROBE], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs[ahead] = done.stdout
    assert runs["0"] == runs["4096"] and len(runs["0"]) == 2 * 12 * 96 * 4


@needs_kernels
@pytest.mark.parametrize("portable", ["0", "1"])
@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize(("k", "n"), [(576, 576), (1536, 576), (96, 40)])
def test_matmul_nbits_skip_norm_equals_its_two_calls(rng, monkeypatch, portable, zero_points, k, n):
    """An int4 product and the residual norm after it in one call: bit for bit the norm call's
    two outputs after the product's call, at 1, 8 and 64 rows, each row as its solo run, and
    within live_rows the live rows alone."""
    monkeypatch.setenv(kernels.PORTABLE_ENV, portable)
    w = _packed_nbits(*_nbits(rng, k, n, 32, zero_points), n, k)
    gamma = rng.standard_normal(n).astype(np.float32)
    eps = 1e-5

    def norm_ref(v, g):
        return v * jax.lax.rsqrt(jnp.mean(jnp.square(v), -1, keepdims=True) + eps) * g

    def skip_ref(a, b, g):
        return norm_ref(a + b, g), a + b

    def ref(x, skip, b, scales, zp, g):
        return skip_ref(int8_product(x, b, scales, zp, k, n, 32), skip, g)

    def two(x, skip):
        product = kernels.matmul_nbits(x, *w, n=n, block_size=32, reference=None, int8=True,
                                       packed=True)  # fmt: skip
        return kernels.skip_rms_norm(product, skip, gamma, eps, skip_ref)

    def one(x, skip):
        return kernels.matmul_nbits_skip_norm(x, *w, skip, gamma, n=n, block_size=32,
                                              epsilon=eps, reference=ref, int8=True,
                                              packed=True)  # fmt: skip

    x = (rng.standard_normal((64, k)) * 3).astype(np.float32)
    skip = (rng.standard_normal((64, n)) * 2).astype(np.float32)
    fused, apart = jax.jit(one), jax.jit(two)
    assert "tj_matmul_nbits_skip_norm" in fused.lower(x, skip).as_text()
    whole = [np.asarray(a) for a in fused(x, skip)]
    for got, want in zip(whole, apart(x, skip), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))
    for m in (1, 8):
        for got, want in zip(fused(x[:m], skip[:m]), whole, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want[:m])
    for r in (0, 5, 63):
        for got, want in zip(fused(x[r : r + 1], skip[r : r + 1]), whole, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[0], want[r])
    # the reference (gradients, vmap over the weights): XLA's float steps, within rounding
    stored = _stored(w, w, n)[:3]
    for got, want in zip(whole, jax.jit(ref)(x, skip, *stored, gamma), strict=True):
        np.testing.assert_allclose(got, np.asarray(want), rtol=5e-4, atol=2e-3)
    steps, skips = x[:12].reshape(6, 2, k), skip[:12].reshape(6, 2, n)
    live = np.array([0, 1, 0, 0, 1, 1], bool)

    def in_live(x, skip, live):
        with kernels.live_rows(live):
            return one(x, skip)

    run = jax.jit(in_live)
    assert "tj_matmul_nbits_skip_norm_live" in run.lower(steps, skips, live).as_text()
    got = [np.asarray(a) for a in run(steps, skips, live)]
    for r in np.flatnonzero(live):
        for g, want in zip(got, whole, strict=True):
            np.testing.assert_array_equal(g[r], want[2 * r : 2 * r + 2])


@needs_kernels
@pytest.mark.parametrize(("k", "n"), [(576, 576), (1536, 576), (40, 70)])
def test_matmul_skip_norm_equals_its_two_calls(rng, k, n):
    """A float32 product (weights in strips) and the residual norm after it in one call: bit for
    bit the norm call's two outputs after the product's call, at 1, 8 and 64 rows, each row as
    its solo run, and within live_rows the live rows alone; more rows than MATMUL_MAX_ROWS or a
    prompt's padded rows are left to the two calls (None)."""
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    packed = jnp.asarray(kernels.pack(w))
    gamma = rng.standard_normal(n).astype(np.float32)
    eps = 1e-5

    def skip_ref(a, b, g):
        v = a + b
        return v * jax.lax.rsqrt(jnp.mean(jnp.square(v), -1, keepdims=True) + eps) * g, v

    def ref(x, skip, w, g):
        return skip_ref(x @ w, skip, g)

    def two(x, skip):
        return kernels.skip_rms_norm(kernels.matmul(x, packed, n), skip, gamma, eps, skip_ref)

    def one(x, skip, tokens=False):
        return kernels.matmul_skip_norm(x, packed, skip, gamma, n, eps, ref, tokens=tokens)

    x = rng.standard_normal((64, k)).astype(np.float32)
    skip = rng.standard_normal((64, n)).astype(np.float32)
    fused = jax.jit(one)
    assert "tj_gemm_skip_norm_f32" in fused.lower(x, skip).as_text()
    whole = [np.asarray(a) for a in fused(x, skip)]
    for got, want in zip(whole, jax.jit(two)(x, skip), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))
    for m in (1, 8):
        for got, want in zip(fused(x[:m], skip[:m]), whole, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want[:m])
    for r in (0, 5, 63):
        for got, want in zip(fused(x[r : r + 1], skip[r : r + 1]), whole, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[0], want[r])
    for got, want in zip(whole, jax.jit(ref)(x, skip, w, gamma), strict=True):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-4)
    steps, skips = x[:12].reshape(6, 2, k), skip[:12].reshape(6, 2, n)
    live = np.array([0, 1, 0, 0, 1, 1], bool)

    def in_live(x, skip, live):
        with kernels.live_rows(live):
            return one(x, skip, tokens=True)

    run = jax.jit(in_live)
    assert "tj_gemm_skip_norm_live_f32" in run.lower(steps, skips, live).as_text()
    got = [np.asarray(a) for a in run(steps, skips, live)]
    for r in np.flatnonzero(live):
        for g, want in zip(got, whole, strict=True):
            np.testing.assert_array_equal(g[r], want[2 * r : 2 * r + 2])
    big = np.zeros((kernels.MATMUL_MAX_ROWS + 1, k), np.float32)
    assert one(big, np.zeros((len(big), n), np.float32)) is None
    with kernels.token_rows(np.array([1], np.int32), 4):
        assert one(x[None, :4], skip[None, :4], tokens=True) is None
