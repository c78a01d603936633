"""Greedy generation, transmuter_jax vs onnxruntime running the same graph in a Python loop.

Usage: python benchmarks/generate.py [--repo FOLDER] [--model FILE.onnx] [--new 64] [--json OUT]

For batch 1 and 8 (prompts of 32 random tokens, no eos): decode tokens/s (aggregate over rows),
time to first token cold (compile included) and warm, compiled step shapes, and the ratio to
onnxruntime. The onnxruntime loop feeds the whole prompt, then one token a step, each step's
present cache becoming the next past (its usual Python loop).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort

import transmuter_jax as tj
from transmuter_jax import generation

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "tests", "fixtures", "llama-genai-fp32")


def _jax_run(ctx, prompts) -> tuple[float, float, int]:
    """(time to first token, decode seconds after it, new tokens per row)."""
    marks = []
    start = time.perf_counter()
    out = generation.generate(
        ctx,
        prompts,
        list(range(len(prompts))),
        on_token=lambda e: marks.append(time.perf_counter()),
    )
    return marks[0] - start, marks[-1] - marks[0], len(out[0])


def _ort_run(session, ctx, prompts, new: int) -> tuple[float, float]:
    """onnxruntime greedy loop: (time to first token, decode seconds after it)."""
    names = [o.name for o in session.get_outputs()]
    batch = len(prompts)
    ids = np.array(prompts, np.int64)
    feeds = {
        e.input: np.zeros((batch, e.heads, 0, e.head_size), e.dtype) for e in ctx.cache.entries
    }
    signature = {i.name for i in ctx.model.inputs}
    start = time.perf_counter()
    first = None
    total = 0
    for _ in range(new):
        step = ids.shape[1]
        feeds["input_ids"] = ids
        feeds["attention_mask"] = np.ones((batch, total + step), np.int64)
        if "position_ids" in signature:
            feeds["position_ids"] = np.broadcast_to(np.arange(total, total + step), (batch, step))
        outputs = dict(zip(names, session.run(names, feeds), strict=True))
        ids = outputs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        for entry in ctx.cache.entries:
            feeds[entry.input] = outputs[entry.output]
        total += step
        if first is None:
            first = time.perf_counter()
    return first - start, time.perf_counter() - first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=DEFAULT, help="folder with config.json")
    parser.add_argument("--model", default="model.onnx", help="decoder file in the folder")
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    path = os.path.join(args.repo, args.model)
    model = tj.load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    print(f"model {os.path.relpath(path)}, {args.new} new tokens, prompts of 32 tokens")
    header = (
        f"{'batch':>5} {'jax tok/s':>10} {'ort tok/s':>10} {'jax/ort':>8} {'ttft cold s':>12} "
        f"{'ttft warm ms':>13} {'ort ttft ms':>12} {'shapes':>7}"
    )
    print(header)
    rows = []
    for batch in (1, 8):
        prompts = rng.integers(3, 400, (batch, 32)).tolist()
        ctx = generation.context(args.repo, model, max_new_tokens=args.new, eos_token_id=[])
        ctx = generation.compile(ctx, batch)
        cold, _, _ = _jax_run(ctx, prompts)
        ttft, decode, new = _jax_run(ctx, prompts)
        jax_rate = batch * (new - 1) / decode
        ort_run = _ort_run(session, ctx, prompts, args.new)  # warm its allocator first
        ort_ttft, ort_decode = _ort_run(session, ctx, prompts, args.new)
        ort_rate = batch * (args.new - 1) / ort_decode
        row = {
            "batch": batch,
            "jax_tokens_per_s": jax_rate,
            "ort_tokens_per_s": ort_rate,
            "ratio": jax_rate / ort_rate,
            "jax_ttft_cold_s": cold,
            "jax_ttft_warm_ms": ttft * 1e3,
            "ort_ttft_ms": ort_ttft * 1e3,
            "compiled_shapes": ctx.compiled.shapes,
        }
        del ort_run
        rows.append(row)
        print(
            f"{batch:>5} {jax_rate:>10.1f} {ort_rate:>10.1f} {row['ratio']:>8.2f} {cold:>12.2f} "
            f"{ttft * 1e3:>13.1f} {ort_ttft * 1e3:>12.1f} {ctx.compiled.shapes:>7}"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"model": path, "new": args.new, "rows": rows}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
