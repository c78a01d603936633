"""Where a decode step's time goes: transmuter_jax (XLA ops) and onnxruntime (graph nodes).

Usage: python benchmarks/profile_decode.py [--export genai-fp32] [--batch 1] [--new 32]
           [--peers jax,ort] [--json OUT]

On the default model, the reference prompt, greedy with eos suppressed, after a warm-up call:

- jax: ``generation.generate`` traced with ``jax.profiler`` from the first new token to the last
  (decode steps only). Per step: the wall time, the time XLA ran ops (the union of the op
  intervals on all XLA threads; a loop's or a branch's own event, which spans its ops and the
  gaps between them, left out), the rest (the host loop, dispatch, transfers, idle; of it, the
  gaps between ops under 50 us, within a step, and the longer ones, the host's between chunks
  and before the first), and the op time by program and op kind (``dot``, ``fusion``,
  ``ffi_call``, ...; summed over threads).
- ort: ``InferenceSession`` with onnxruntime's profiler in the step loop of perf_workers.py;
  per decode step (the prefill's nodes left out): the session run time and the node time by op
  type (summed over threads).

Prints the breakdowns; with --json writes them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import perf_workers  # noqa: E402
from common import make_job, report, weight_bytes  # noqa: E402


def _kind(op: str) -> str:
    """The kind of an HLO op name: 'dot.12' -> 'dot', 'wrapped_reduce-window' -> 'reduce-window'."""
    return re.sub(r"(\.\d+)+$", "", op.removeprefix("wrapped_"))


# Ops that hold others (a loop's body, a branch): their events span their ops' and the gaps
# between them, so they count in the ops' time but not in the time that ops ran.
CONTAINERS = re.compile(r"(while|conditional|cond|call)(\.\d+)*(\.clone)?(\.\d+)*$")


def _union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# A gap between ops at least this long is the host's (a chunk's start: the tokens read, the next
# call dispatched, the slots made); shorter ones lie between the ops of a step.
HOST_GAP_NS = 50_000


def _gaps(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """The idle time between the union's intervals: (in gaps shorter than HOST_GAP_NS, in the
    others)."""
    short = long = 0.0
    end = None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            if a - end < HOST_GAP_NS:
                short += a - end
            else:
                long += a - end
        end = b if end is None else max(end, b)
    return short, long


def profile_jax(job: dict) -> dict:
    """transmuter_jax's decode steps under jax.profiler."""
    import jax

    import transmuter_jax as tj
    from transmuter_jax import generation

    model = tj.load(os.path.join(job["folder"], job["file"]))
    options = dict(max_new_tokens=job["new"], min_new_tokens=job["new"], do_sample=False)
    ctx = generation.compile(generation.context(job["folder"], model, **options), job["batch"])
    prompts, seeds = [job["prompt"]] * job["batch"], list(range(job["batch"]))
    generation.generate(ctx, prompts, seeds)  # compiles
    marks = []

    def on_token(event, folder):
        if event["token"][0] < 0:  # a step of the prompt
            return
        marks.append(time.perf_counter())
        if len(marks) == 1:
            jax.profiler.start_trace(folder)
        elif len(marks) == job["new"]:
            jax.profiler.stop_trace()

    ops, intervals = defaultdict(float), []
    with tempfile.TemporaryDirectory(prefix="profile-jax-") as folder:
        generation.generate(ctx, prompts, seeds, on_token=lambda e: on_token(e, folder))
        path = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)[-1]
        data = jax.profiler.ProfileData.from_file(path)
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats:
                    continue
                module = str(stats.get("hlo_module", "?")).removeprefix("jit_")
                kind = _kind(str(stats["hlo_op"]))
                ops[f"{module}: {kind}"] += event.duration_ns / 1e6
                if not CONTAINERS.match(kind):  # its ops are events of their own
                    intervals.append((event.start_ns, event.start_ns + event.duration_ns))
    steps = len(marks) - 1
    wall = (marks[-1] - marks[0]) * 1e3 / steps
    busy = _union(intervals) / 1e6 / steps
    within, between = (g / 1e6 / steps for g in _gaps(intervals))
    params = sum(a.nbytes for a in jax.tree_util.tree_leaves(model.params))
    return {
        "steps": steps,
        "step_ms": wall,
        "xla_busy_ms": busy,
        "other_ms": wall - busy,
        "gaps_within_ms": within,  # between a step's ops (each gap under HOST_GAP_NS)
        "gaps_between_ms": between,  # the host's: chunks' starts, the slots' setup
        "params_bytes": params,
        "ops_ms": {k: v / steps for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
    }


def profile_ort(job: dict) -> dict:
    """onnxruntime's decode steps under its profiler, in perf_workers.py's step loop."""
    with tempfile.TemporaryDirectory(prefix="profile-ort-") as folder:
        run, details = perf_workers._ort(dict(job, ort_profile=os.path.join(folder, "ort")), {})
        run(0)  # warm-up
        result = run(0)
        with open(details()["profile_file"]) as file:
            events = json.load(file)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    decode = runs[-(result["new"] - 1) :]  # the last call: its prefill, then these
    first, last = decode[0]["ts"], decode[-1]["ts"] + decode[-1]["dur"]
    ops = defaultdict(float)
    for event in events:
        op = event.get("args", {}).get("op_name")
        if event.get("cat") == "Node" and op and first <= event["ts"] <= last:
            ops[op] += event["dur"] / 1e3
    steps = len(decode)
    return {
        "steps": steps,
        "step_ms": result["decode_s"] * 1e3 / steps,
        "session_run_ms": sum(r["dur"] for r in decode) / 1e3 / steps,
        "ops_ms": {k: v / steps for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
    }


def job_for(export: str, batch: int, new: int) -> dict:
    """A perf_workers.py job on the default model's ``export`` with the reference prompt."""
    from transmuter_jax import default

    with open(os.path.join(default.path("hf"), "reference.json")) as file:
        prompt = json.load(file)["cases"][0]["prompt_ids"]
    return make_job("", default.path(export), prompt, batch, new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", default="genai-fp32", help="genai-fp32, optimum, genai-int4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=32, help="new tokens per row")
    parser.add_argument("--peers", default="jax,ort", help="jax, ort or both")
    parser.add_argument("--json", help="write the breakdowns to this file")
    args = parser.parse_args(argv)
    job = job_for(args.export, args.batch, args.new)
    figures = {"export": args.export, "batch": args.batch, "new": args.new}
    figures["weight_bytes"] = weight_bytes(job["folder"], args.export)
    peers = args.peers.split(",")
    if "ort" in peers:  # first: jax's threads stay alive in the process afterwards
        figures["ort"] = profile_ort(job)
    if "jax" in peers:
        figures["jax"] = profile_jax(job)
    print(report(figures))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
