"""Greedy generation, transmuter_jax vs onnxruntime running the same graph in a Python loop.

Usage: python benchmarks/generate.py [--repo FOLDER] [--model FILE.onnx] [--new 64] [--json OUT]
       python benchmarks/generate.py --beams 4 [--new 32] [--json OUT]

For batch 1 and 8 (prompts of 32 random tokens, no eos): decode tokens/s (aggregate over rows),
time to first token cold (compile included) and warm, compiled step shapes, and the ratio to
onnxruntime. The onnxruntime loop feeds the whole prompt, then one token a step, each step's
present cache becoming the next past (its usual Python loop).

With --beams K: beam search on the default model (SmolLM2-135M-Instruct, its genai fp32 and
optimum exports) against transformers' own beam search (PyTorch, the same weights, run in the
preparation environment), for 1 and 2 prompts of 32 tokens, exactly --new tokens each
(min_new_tokens = max_new_tokens on both sides). Tokens/s counts the new tokens of the returned
sequences over the whole call (prompt included); the tokens are compared too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort

import transmuter_jax as tj
from transmuter_jax import default, generation

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


def _beams(beams: int, new: int) -> dict:
    """Beam search tokens/s: transmuter_jax on two exports vs transformers, same prompts."""
    rng = np.random.default_rng(0)
    prompts = {str(b): rng.integers(20, 40000, (b, 32)).tolist() for b in (1, 2)}
    script = os.path.join(HERE, "beam_transformers.py")
    hf = default.path("hf")
    command = [default.tools_python(), script, hf, json.dumps(prompts), str(beams), str(new)]
    torch_out = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
    print(f"beam search, num_beams {beams}, {new} new tokens, prompts of 32 tokens")
    print(f"{'export':>11} {'batch':>5} {'jax tok/s':>10} {'torch tok/s':>12} {'jax/torch':>10} "
          f"{'same tokens':>12}")  # fmt: skip
    rows = []
    for export in ("genai-fp32", "optimum"):
        folder = default.path(export)
        model = tj.load(os.path.join(folder, "model.onnx"))
        for batch, batch_prompts in prompts.items():
            options = dict(num_beams=beams, max_new_tokens=new, min_new_tokens=new)
            ctx = generation.compile(generation.context(folder, model, **options), int(batch))
            seeds = list(range(int(batch)))
            generation.generate(ctx, batch_prompts, seeds)  # compiles
            start = time.perf_counter()
            tokens = generation.generate(ctx, batch_prompts, seeds)
            seconds = time.perf_counter() - start
            theirs = torch_out[batch]
            jax_rate = int(batch) * new / seconds
            torch_rate = int(batch) * new / theirs["seconds"]
            same = tokens == theirs["tokens"]
            rows.append({"export": export, "batch": int(batch), "jax_tokens_per_s": jax_rate,
                         "torch_tokens_per_s": torch_rate, "ratio": jax_rate / torch_rate,
                         "same_tokens": same})  # fmt: skip
            print(f"{export:>11} {batch:>5} {jax_rate:>10.1f} {torch_rate:>12.1f} "
                  f"{jax_rate / torch_rate:>10.2f} {str(same):>12}")  # fmt: skip
    return {"num_beams": beams, "new": new, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=DEFAULT, help="folder with config.json")
    parser.add_argument("--model", default="model.onnx", help="decoder file in the folder")
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--beams", type=int, help="beam search on the default model instead")
    args = parser.parse_args(argv)
    if args.beams:
        figures = _beams(args.beams, args.new)
        if args.json:
            with open(args.json, "w") as file:
                json.dump(figures, file, indent=2)
        return 0
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
