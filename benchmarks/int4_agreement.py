"""Greedy-token agreement of transmuter_jax with onnxruntime-genai's Generator on the default
model's int4 export (MatMulNBits accuracy_level 4), with peak memory and decode speed.

Usage: python benchmarks/int4_agreement.py [--new 64] [--batch 1] [--prompts 3] [--exact]
           [--source /path/to/repo] [--no-genai]

Each prompt (the chat prompts of the default model's hf/reference.json) runs in fresh processes
(benchmarks/perf_workers.py, the same jobs as benchmarks/perf.py: eos suppressed until --new
tokens): the Generator, and transmuter_jax with int8 activations (the default). ``--exact`` also
runs transmuter_jax with TRANSMUTER_JAX_NBITS_INT8=0 (exact dequantisation). ``--source`` runs
transmuter_jax from another checkout (for before/after figures). Prints, per prompt and peer, how
many leading tokens of row 0 equal the Generator's and how many of the --new positions do, then
decode tokens/s and the peak resident memory while generating (the warm call) and over the whole
process (loading, compiling and the first call included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from perf import make_job, run_worker  # noqa: E402


def agreement(ours: list[int], theirs: list[int]) -> tuple[int, int]:
    """(leading tokens equal, positions equal) of two token lists."""
    same = [a == b for a, b in zip(ours, theirs, strict=False)]
    return (same + [False]).index(False), sum(same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--exact", action="store_true", help="also TRANSMUTER_JAX_NBITS_INT8=0")
    parser.add_argument("--source", default=os.path.dirname(HERE), help="transmuter_jax checkout")
    parser.add_argument("--no-genai", action="store_true", help="transmuter_jax only")
    args = parser.parse_args(argv)

    from transmuter_jax import default

    folder = default.path("genai-int4")
    with open(os.path.join(default.path("hf"), "reference.json")) as file:
        cases = json.load(file)["cases"][: args.prompts]
    base = dict(os.environ, PYTHONPATH=os.path.abspath(args.source))
    peers = [("jax int8", dict(base, TRANSMUTER_JAX_NBITS_INT8="1"))]
    if args.exact:
        peers.append(("jax exact", dict(base, TRANSMUTER_JAX_NBITS_INT8="0")))
    tools = None if args.no_genai else default.tools_python()
    totals: dict[str, list[int]] = {}
    print(f"{args.new} greedy tokens, batch {args.batch}, row 0; source {args.source}")
    print(
        f"{'prompt':<48} {'peer':<10} {'lead':>5} {'same':>5} {'tok/s':>7} "
        f"{'peak MiB':>9} {'process':>8}"
    )
    for case in cases:
        runs = {}
        if tools is not None:
            job = make_job("genai", folder, case["prompt_ids"], args.batch, args.new, repeats=1)
            runs["genai"], why = run_worker(tools, job)
            if runs["genai"] is None:
                print(f"  genai skipped: {why}")
        for name, env in peers:
            job = make_job("jax", folder, case["prompt_ids"], args.batch, args.new, repeats=1)
            runs[name], why = run_worker(sys.executable, job, env)
            if runs[name] is None:
                print(f"  {name} skipped: {why}")
        reference = runs.get("genai")
        for name, result in runs.items():
            if result is None:
                continue
            lead, same = agreement(result["tokens"], reference["tokens"]) if reference else (0, 0)
            if name != "genai" and reference:
                total = totals.setdefault(name, [0, 0, 0])
                total[0] += lead
                total[1] += same
                total[2] += len(reference["tokens"])
            print(
                f"{case['prompt'][:48]:<48} {name:<10} {lead:>5} {same:>5} "
                f"{result['tokens_per_s'] or 0:>7.1f} {result['peak_generating_mib'] or 0:>9.0f} "
                f"{result['peak_process_mib']:>8.0f}"
            )
    for name, (lead, same, count) in totals.items():
        print(f"{name}: {same} of {count} tokens equal to the Generator's ({lead} leading)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
