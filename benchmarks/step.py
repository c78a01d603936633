"""One decoder step, jitted JAX vs onnxruntime on the same graph and inputs, in one process.

Usage: python benchmarks/step.py [--model PATH.onnx] [--repeats N] [--json OUT.json]

Shapes: a decode step (1 new token after 32 cached) at batch 1 and 4, and a prefill of 32
tokens at batch 1. Prints the median step time of each, the ratio JAX / onnxruntime (below 1 means
JAX is faster), and the trace and compile time of each shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import onnxruntime as ort

import transmuter_jax as tj
from transmuter_jax.testing import example_inputs

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "tests", "fixtures", "llama-genai-fp32", "model.onnx")
SHAPES = [  # (label, batch, new tokens, cached tokens)
    ("decode b1", 1, 1, 32),
    ("decode b4", 4, 1, 32),
    ("prefill 32", 1, 32, 0),
]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT, help="ONNX decoder with a KV cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = tj.load(args.model)
    load_s = time.perf_counter() - start
    session = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.outputs]
    print(
        f"model {os.path.relpath(args.model)}  (load {load_s:.2f} s, jax {jax.__version__}, "
        f"onnxruntime {ort.__version__}, {os.cpu_count()} cores)"
    )
    header = (
        f"{'shape':<12}{'jax ms':>10}{'ort ms':>10}{'jax/ort':>9}{'trace s':>9}{'compile s':>11}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for label, batch, length, past in SHAPES:
        inputs = example_inputs(model, batch=batch, length=length, past=past)
        before = len(model.compile_stats)
        jax_ms = _median_ms(
            lambda inputs=inputs: jax.block_until_ready(model(inputs)), args.repeats
        )
        stat = model.compile_stats[before] if len(model.compile_stats) > before else None
        ort_ms = _median_ms(lambda inputs=inputs: session.run(names, inputs), args.repeats)
        row = {
            "shape": label,
            "batch": batch,
            "length": length,
            "past": past,
            "jax_ms": jax_ms,
            "ort_ms": ort_ms,
            "ratio": jax_ms / ort_ms,
            "trace_s": stat.trace_s if stat else None,
            "compile_s": stat.compile_s if stat else None,
        }
        rows.append(row)
        print(
            f"{label:<12}{jax_ms:>10.2f}{ort_ms:>10.2f}{row['ratio']:>9.2f}"
            f"{row['trace_s'] or 0:>9.2f}{row['compile_s'] or 0:>11.2f}"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"model": args.model, "load_s": load_s, "rows": rows}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
