"""Decode tokens/s of generate() in two source trees, taking turns in one run.

Usage: python benchmarks/decode_compare.py --before /tmp/pre-engine [--after .] [--new 64]
           [--batches 1,8] [--rounds 5] [--json OUT]

Each tree runs in a worker process of its own (its folder first on PYTHONPATH) on the default
model's genai fp32 export: greedy, no eos, prompts of 32 tokens. The workers take turns, one timed
call each per round, so that both see the same load; a figure is the best round of each. Decode
tokens/s counts the tokens of every row after the first token, over the time after it. Compare the
ratio of one run only: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER = r"""
import json, sys, time
import numpy as np
from transmuter_jax import default, generation, hub
from transmuter_jax.onnx.model import load

folder = str(default.path("genai-fp32"))
model = load(hub.files(folder).decoder)
new, batches = json.loads(sys.stdin.readline())
rng = np.random.default_rng(0)
engines = {}
for batch in batches:
    spec = generation.context(folder, model, max_new_tokens=new, eos_token_id=[])
    engine = generation.compile(spec, batch)
    prompts = rng.integers(100, 40000, (batch, 32)).tolist()
    generation.generate(engine, prompts, list(range(batch)))  # warm: compiles
    engines[batch] = (engine, prompts)
print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    engine, prompts = engines[int(line)]
    marks = []
    out = generation.generate(engine, prompts, list(range(len(prompts))),
                              on_token=lambda e: marks.append(time.perf_counter()))
    tokens = sum(len(o) for o in out) - len(out)
    print(json.dumps(tokens / (marks[-1] - marks[0])), flush=True)
"""


def _worker(tree: str, new: int, batches: list[int]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env, cwd=os.path.abspath(tree),
    )  # fmt: skip
    proc.stdin.write(json.dumps([new, batches]) + "\n")
    proc.stdin.flush()
    return proc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default=os.path.dirname(os.path.dirname(__file__)) or ".")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    workers = {"before": _worker(args.before, args.new, batches)}
    workers["after"] = _worker(args.after, args.new, batches)
    for name, proc in workers.items():
        if json.loads(proc.stdout.readline()) != "ready":
            raise SystemExit(f"the {name} worker did not start")
    times: dict = {(w, b): [] for w in workers for b in batches}
    for _ in range(args.rounds):
        for batch in batches:
            for name, proc in workers.items():
                proc.stdin.write(f"{batch}\n")
                proc.stdin.flush()
                times[(name, batch)].append(json.loads(proc.stdout.readline()))
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    figures: dict = {"new": args.new, "rounds": args.rounds, "load": os.getloadavg()}
    for batch in batches:
        before, after = max(times[("before", batch)]), max(times[("after", batch)])
        figures[f"batch {batch}"] = {
            "before_tok_s": before, "after_tok_s": after, "ratio": after / before,
            "all_before": times[("before", batch)], "all_after": times[("after", batch)],
        }  # fmt: skip
    figures["date"] = time.strftime("%Y-%m-%d %H:%M")
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
