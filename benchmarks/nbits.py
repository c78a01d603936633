"""MatMulNBits micro-benchmark: transmuter_jax's int4 kernel against onnxruntime's (MLAS).

Usage: python benchmarks/nbits.py [--rows 1 8 64] [--repeats 200] [--shapes K,N ...]
           [--stored] [--graph N] [--json out.json]

The default model's int4 product shapes (K, N; block size 32, accuracy_level 4: int8
activations, no zero points) with random weights, at 1, 8 and 64 rows. onnxruntime runs a
one-node ONNX model (MatMulNBits) with as many intra-op threads as this process has cores;
transmuter_jax runs ``kernels.matmul_nbits`` jitted, on the weights rearranged as the model loads
them (``kernels.nbits_pack``, ``nbits_pack_scales``; ``--stored``: as stored). Both are timed per
call (median of ``--repeats`` calls after a warm-up), in the same run, and the ratio is
onnxruntime's time over ours (above 1: we are faster). Also prints the CPU's vector extensions,
the weight read rate and the fraction of outputs equal to onnxruntime's bit for bit. A call
carries each runtime's own overhead (a jitted call's dispatch, ``session.run``: microseconds,
most of a small product's time); ``--graph N`` also times N products with distinct weights in one
graph (N MatMulNBits nodes of one session.run against N calls in a jitted program that runs them
GRAPH_LOOPS times: one dispatch for all), per product: the kernels with next to no call overhead,
each product's weights its own (read from L3 or memory, as a model's layers are).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# The default model's products (SmolLM2-135M, genai int4): qkv, o_proj, gate/up, down, lm_head.
SHAPES = [(576, 960), (576, 576), (576, 1536), (1536, 576), (576, 49152)]
BLOCK = 32
# --graph: the jitted program runs its N products this many times over (one dispatch for them
# all, as a model's decode loop dispatches once for many steps); onnxruntime runs its graph once
# a session.run.
GRAPH_LOOPS = 10


def cpu_features() -> str:
    """The vector extensions the kernels can use here, from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next(line for line in handle if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni")
    return " ".join(f for f in wanted if f in flags)


def weights(rng, k: int, n: int):
    blocks = -(-k // BLOCK)
    b = rng.integers(0, 256, (n, blocks, BLOCK // 2), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    return b, scales


def onnxruntime_session(k: int, n: int, b, scales, threads: int, more=()):
    """One MatMulNBits node on ``a`` (output ``y``), and one more (``y1``, ...) for each pair of
    weights in ``more``: the nodes of one graph, run one after another."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nodes, outputs, inits = [], [], []
    for i, (bi, si) in enumerate([(b, scales), *more]):
        suffix = str(i) if i else ""
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                ["a", "b" + suffix, "scales" + suffix],
                ["y" + suffix],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=BLOCK,
                accuracy_level=4,
            )
        )
        outputs.append(helper.make_tensor_value_info("y" + suffix, TensorProto.FLOAT, ["m", n]))
        inits += [
            numpy_helper.from_array(bi, "b" + suffix),
            numpy_helper.from_array(si, "scales" + suffix),
        ]
    graph = helper.make_graph(
        nodes,
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        outputs,
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )


def timed(fn, repeats: int) -> float:
    """Median seconds per call of ``fn``."""
    for _ in range(max(3, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_results(path: str, threads: int, results: list, **extra) -> None:
    """The run's rows as JSON at ``path``, with the CPU's features, threads and load."""
    with open(path, "w") as handle:
        record = dict(cpu=cpu_features(), threads=threads, load=os.getloadavg(), **extra)
        json.dump(dict(record, results=results), handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--shapes", nargs="+", help="K,N pairs (default: the model's)")
    parser.add_argument("--stored", action="store_true", help="weights as stored, not packed")
    parser.add_argument(
        "--graph",
        type=int,
        default=0,
        metavar="N",
        help="also time N products with distinct weights in one graph (onnxruntime: N nodes of "
        "one session; ours: N calls of one jitted program), per product: no call overhead",
    )
    parser.add_argument("--json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from transmuter_jax import kernels
    from transmuter_jax.onnx.ops.quant import int8_product

    threads = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_features()}; {threads} cores; kernels {kernels.available()}")
    rng = np.random.default_rng(0)
    rows_out = []
    packed = not args.stored
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SHAPES
    for k, n in shapes:
        b, scales = weights(rng, k, n)
        session = onnxruntime_session(k, n, b, scales, threads)
        ref = lambda x, b, s, z, k=k, n=n: int8_product(x, b, s, z, k, n, BLOCK)  # noqa: E731
        fn = jax.jit(
            lambda x, b, s, k=k, n=n, ref=ref: kernels.matmul_nbits(
                x, b, s, None, n=n, block_size=BLOCK, reference=ref, int8=True, packed=packed
            )
        )
        bj = jax.device_put(kernels.nbits_pack(b) if packed else b)
        blocks = -(-k // BLOCK)
        sj = jax.device_put(kernels.nbits_pack_scales(scales, n, blocks) if packed else scales)
        if args.graph:  # N products with distinct weights (cold caches, as a model's layers)
            pairs = [(b, scales)] + [weights(rng, k, n) for _ in range(args.graph - 1)]
            graph_session = onnxruntime_session(k, n, b, scales, threads, pairs[1:])
            graph_b = [jax.device_put(kernels.nbits_pack(w) if packed else w) for w, _ in pairs]
            graph_s = [
                jax.device_put(kernels.nbits_pack_scales(sc, n, blocks) if packed else sc)
                for _, sc in pairs
            ]

            def products(x, bs, ss, ref=ref, n=n):
                return [
                    kernels.matmul_nbits(
                        x, bi, si, None, n=n, block_size=BLOCK, reference=ref, int8=True,
                        packed=packed,
                    )
                    for bi, si in zip(bs, ss, strict=True)
                ]  # fmt: skip

            def graph_loop(x, bs, ss, products=products):
                """The N products GRAPH_LOOPS times in one program, each pass's input made
                from the last pass's outputs (so that the passes run in turn)."""

                def one(_, c):
                    ys = products(x + c, bs, ss)
                    return c + sum(y[0, 0] for y in ys) * 0.0

                return jax.lax.fori_loop(0, GRAPH_LOOPS, one, jnp.float32(0))

            graph_fn = jax.jit(products)
            graph_looped = jax.jit(graph_loop)
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            xj = jax.device_put(x)
            ours = np.asarray(fn(xj, bj, sj))
            theirs = session.run(None, {"a": x})[0]
            diff = float(np.abs(ours - theirs).max() / (np.abs(theirs).max() + 1e-30))
            equal = float((ours == theirs).mean())
            t_ours = timed(
                lambda fn=fn, xj=xj, bj=bj, sj=sj: fn(xj, bj, sj).block_until_ready(), args.repeats
            )
            t_ort = timed(lambda s=session, x=x: s.run(None, {"a": x}), args.repeats)
            rate = (b.nbytes + scales.nbytes) / t_ours / 1e9
            row = dict(
                k=k,
                n=n,
                rows=m,
                ours_us=t_ours * 1e6,
                onnxruntime_us=t_ort * 1e6,
                ratio=t_ort / t_ours,
                weight_gbps=rate,
                max_rel_diff=diff,
                bit_equal=equal,
            )
            rows_out.append(row)
            print(
                f"K={k:5d} N={n:6d} rows={m:3d}: ours {t_ours * 1e6:8.1f} us, onnxruntime "
                f"{t_ort * 1e6:8.1f} us, ratio {t_ort / t_ours:5.2f}x, weights {rate:5.1f} GB/s, "
                f"max rel diff {diff:.1e}, bit-equal {equal:.3f}",
                flush=True,
            )
            if args.graph:
                calls = max(10, args.repeats // args.graph)
                ours_all = graph_fn(xj, graph_b, graph_s)
                theirs_all = graph_session.run(None, {"a": x})
                row["graph_bit_equal"] = float(
                    np.mean(
                        [
                            np.mean(np.asarray(o) == t)
                            for o, t in zip(ours_all, theirs_all, strict=True)
                        ]
                    )
                )
                g_ours = (
                    timed(
                        lambda x=xj, f=graph_looped, gb=graph_b, gs=graph_s: jax.block_until_ready(
                            f(x, gb, gs)
                        ),
                        calls,
                    )
                    / GRAPH_LOOPS
                )
                g_ort = timed(lambda x=x, g=graph_session: g.run(None, {"a": x}), calls)
                row.update(
                    graph_products=args.graph,
                    graph_ours_us=g_ours / args.graph * 1e6,
                    graph_onnxruntime_us=g_ort / args.graph * 1e6,
                    graph_ratio=g_ort / g_ours,
                )
                print(
                    f"  in one graph of {args.graph}: ours {row['graph_ours_us']:8.1f} us, "
                    f"onnxruntime {row['graph_onnxruntime_us']:8.1f} us a product, ratio "
                    f"{g_ort / g_ours:5.2f}x, bit-equal {row['graph_bit_equal']:.3f}",
                    flush=True,
                )
    if args.json:
        write_results(args.json, threads, rows_out, packed=packed)


if __name__ == "__main__":
    main()
