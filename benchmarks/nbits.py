"""MatMulNBits micro-benchmark: transmuter_jax's int4 kernel against onnxruntime's (MLAS).

Usage: python benchmarks/nbits.py [--rows 1 8 64] [--repeats 200] [--shapes K,N ...]
           [--stored] [--json out.json]

The default model's int4 product shapes (K, N; block size 32, accuracy_level 4: int8
activations, no zero points) with random weights, at 1, 8 and 64 rows. onnxruntime runs a
one-node ONNX model (MatMulNBits) with as many intra-op threads as this process has cores;
transmuter_jax runs ``kernels.matmul_nbits`` jitted, on the weights rearranged as the model loads
them (``kernels.nbits_pack``, ``nbits_pack_scales``; ``--stored``: as stored). Both are timed per
call (median of ``--repeats`` calls after a warm-up), in the same run, and the ratio is
onnxruntime's time over ours (above 1: we are faster). Also prints the CPU's vector extensions,
the weight read rate and the fraction of outputs equal to onnxruntime's bit for bit.
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


def onnxruntime_session(k: int, n: int, b, scales, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(
        "MatMulNBits",
        ["a", "b", "scales"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=BLOCK,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "scales")],
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
    parser.add_argument("--json")
    args = parser.parse_args()

    import jax

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
    if args.json:
        write_results(args.json, threads, rows_out, packed=packed)


if __name__ == "__main__":
    main()
