"""The default model's matrix products as one graph: transmuter_jax against onnxruntime.

Usage: python benchmarks/chain.py [--kinds int4,fp32] [--rows 1 8] [--layers 30] [--lm-head]
           [--repeats 30] [--json OUT]

Each layer of SmolLM2-135M has five products (qkv 576 -> 960, o 576 -> 576, gate and up 576 ->
1536, down 1536 -> 576); this builds one ONNX graph of ``--layers`` of them with random weights
(int4: MatMulNBits with blocks of 32 and accuracy_level 4, as the onnxruntime-genai builder
writes them; fp32: MatMul), joined by a Slice, a Mul and a residual Add, and optionally the
576 -> 49152 lm_head. Unlike ``nbits.py`` (one product a call, timed from Python), the products
run back to back inside one program, their weights in the last-level cache or memory as in a
decode step, so the figure is what a step pays for its products. Both runtimes get the same
graph and as many threads as this process has cores; the ratio is onnxruntime's time over ours
(above 1: we are faster), median of ``--repeats`` calls after a warm-up, in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def graph(kind: str, layers: int, lm_head: bool, rng):
    """One ONNX model of ``layers`` layers' products (``kind``: int4 or fp32)."""
    from onnx import TensorProto, helper, numpy_helper

    inits, nodes = [], []

    def product(x: str, name: str, k: int, n: int) -> str:
        if kind == "fp32":
            w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            inits.append(numpy_helper.from_array(w, f"{name}_w"))
            nodes.append(helper.make_node("MatMul", [x, f"{name}_w"], [name]))
            return name
        blocks = -(-k // 32)
        b = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
        s = (rng.random((n, blocks), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
        inits.append(numpy_helper.from_array(b, f"{name}_b"))
        inits.append(numpy_helper.from_array(s, f"{name}_s"))
        nodes.append(
            helper.make_node(
                "MatMulNBits", [x, f"{name}_b", f"{name}_s"], [name], domain="com.microsoft",
                K=k, N=n, bits=4, block_size=32, accuracy_level=4,
            )
        )  # fmt: skip
        return name

    for name, value in (("start", 0), ("stop", 576), ("axis", -1)):
        inits.append(numpy_helper.from_array(np.array([value], np.int64), name))
    x = "x"
    for layer in range(layers):
        qkv = product(x, f"qkv{layer}", 576, 960)
        nodes.append(helper.make_node("Slice", [qkv, "start", "stop", "axis"], [f"q{layer}"]))
        o = product(f"q{layer}", f"o{layer}", 576, 576)
        gate, up = product(o, f"gate{layer}", 576, 1536), product(o, f"up{layer}", 576, 1536)
        nodes.append(helper.make_node("Mul", [gate, up], [f"gu{layer}"]))
        down = product(f"gu{layer}", f"down{layer}", 1536, 576)
        nodes.append(helper.make_node("Add", [down, x], [f"r{layer}"]))
        x = f"r{layer}"
    out = product(x, "lm_head", 576, 49152) if lm_head else x
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "chain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 576])],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
            inits,
        ),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="int4,fp32", help="int4, fp32 or both")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--lm-head", action="store_true", help="add the 576 -> 49152 product")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.layers < 0 or args.repeats < 1 or any(r < 1 for r in args.rows):
        parser.error("--layers must be >= 0, --repeats and --rows >= 1")

    import jax
    import onnx
    import onnxruntime as ort
    from nbits import cpu_features, timed, write_results

    import transmuter_jax as tj

    threads = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_features()}; {threads} cores; load {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="chain-") as folder:
        for kind in args.kinds.split(","):
            if kind not in ("int4", "fp32"):
                parser.error(f"--kinds: {kind!r} is neither int4 nor fp32")
            path = os.path.join(folder, f"{kind}.onnx")
            onnx.save(
                graph(kind, args.layers, args.lm_head, rng),
                path,
                save_as_external_data=True,
                location=f"{kind}.data",
            )
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            model = tj.load(path)
            for m in args.rows:
                x = (rng.standard_normal((m, 576)) * 0.1).astype(np.float32)
                xj = jax.device_put(x)
                ours = timed(
                    lambda f=model, xj=xj: jax.block_until_ready(f({"x": xj})), args.repeats
                )
                theirs = timed(lambda s=session, x=x: s.run(None, {"x": x}), args.repeats)
                row = dict(kind=kind, rows=m, layers=args.layers, lm_head=args.lm_head)
                row.update(ours_ms=ours * 1e3, onnxruntime_ms=theirs * 1e3, ratio=theirs / ours)
                rows_out.append(row)
                print(
                    f"{kind} rows={m:3d} layers={args.layers}{' + lm_head' if args.lm_head else ''}"
                    f": ours {ours * 1e3:8.3f} ms, onnxruntime {theirs * 1e3:8.3f} ms, "
                    f"ratio {theirs / ours:5.2f}x",
                    flush=True,
                )
    if args.json:
        write_results(args.json, threads, rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
