"""Decode performance on the default model: transmuter_jax against onnxruntime, onnxruntime-genai
and PyTorch, with the memory-bandwidth limit measured in the same run.

Usage: python benchmarks/perf.py [--exports genai-fp32,optimum,genai-int4]
           [--peers jax,ort,genai,torch] [--batches 1,8] [--new 64] [--repeats 2] [--no-cold]
           [--decode-steps N] [--sweep 1,4,8,16,32,64] [--profile] [--out benchmarks/results]
           [--genai-path DIR]

The prompt is the first chat prompt of the default model's reference.json, the same for every
row; each peer generates exactly --new greedy tokens (eos suppressed until then) in its own
process (perf_workers.py), on its own best settings:

- jax: transmuter_jax ``generation.generate``, compiled for the batch;
- ort: onnxruntime ``InferenceSession`` on the same ONNX file, a Python step loop (IOBinding:
  presents fed back as pasts without a copy), intra_op_num_threads = cores;
- genai: onnxruntime-genai's ``Generator`` (genai exports only), intra_op_num_threads = cores;
  the preparation environment's (0.15.2), or with --genai-path DIR the one installed there
  (``pip install --target DIR onnxruntime-genai==0.18.0``), run by this interpreter;
- torch: transformers' ``generate`` on the PyTorch weights (the ``hf`` folder), fp32.

Figures: decode tokens/s after the first token (all rows), the best of --repeats warm calls, and
the whole call's tokens/s (prompt included: new tokens over the time to the last one);
time to first token warm and cold (the first call of a fresh process, from the process start);
compiled shapes; peak resident memory while generating against the weights plus the KV cache;
the read bandwidth of a 1 GiB array (at the start and the end, the best counts) and the decode
limit it gives (bandwidth / weight bytes per token). transmuter_jax's cold start also runs
twice in fresh processes on an empty temporary persistent compilation cache per export
(TRANSMUTER_JAX_COMPILE_CACHE): cache cold, then cache warm; the export's jax workers share it.
Each jax row first runs once in a priming process of its own, which compiles the row's programs
into that cache; the row's own process then reads them back, as every run after a user's first
does (the targets also give the priming process's memory: compiling in the process leaves heap
behind).
With --profile, profile_decode.py breaks down the decode steps of jax and ort. With --sweep,
transmuter_jax at batch 1 also runs with each decode_steps value (new tokens per dispatch).

Writes <out>/perf-<date>.json and <out>/perf.png, prints the tables and each target's status.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import cores, kv_layout, make_job, report, weight_bytes  # noqa: E402

WORKER = os.path.join(HERE, "perf_workers.py")
RESULTS = os.path.join(HERE, "results")
EXPORTS = ("genai-fp32", "optimum", "genai-int4")
PEERS = ("jax", "ort", "genai", "torch")
TOOLS_PEERS = ("genai", "torch")  # run with the preparation environment's interpreter
TIMEOUT_S = 900


def bandwidth(threads: int, size: int = 1 << 30, repeats: int = 5) -> dict:
    """Read bandwidth (GB/s) of a ``size``-byte float32 array, best of ``repeats`` per method."""
    data = np.ones(size // 4, np.float32)
    parts = np.array_split(data, threads)
    matrix, vector = data.reshape(-1, 4096), np.ones(4096, np.float32)
    figures = {}
    with ThreadPoolExecutor(threads) as pool:
        methods = {
            "sum_1_thread": lambda: data.sum(),
            f"sum_{threads}_threads": lambda: list(pool.map(np.sum, parts)),
            f"max_{threads}_threads": lambda: list(pool.map(np.max, parts)),
            "matvec_blas": lambda: matrix @ vector,
        }
        for name, method in methods.items():
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                method()
                best = min(best, time.perf_counter() - start)
            figures[name] = data.nbytes / best / 1e9
    return {"gb_per_s": max(figures.values()), "methods": figures}


def run_worker(python: str, job: dict, env: dict | None = None) -> tuple[dict | None, str]:
    """Runs one perf_workers.py job in a fresh process: (its figures, '') or (None, why not)."""
    command = [python, WORKER, json.dumps(dict(job, launch=time.time()))]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT_S} s"
    except OSError as error:
        return None, str(error)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT ")), ""
    return None, f"exit {done.returncode}: {_error_line(done.stderr or done.stdout)}"


def _error_line(text: str) -> str:
    """The exception line of a traceback (the last ``Name: message`` line), else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)]
    return (errors or lines or ["no output"])[-1][:300]


def bare_import_s(repeats: int = 3) -> float:
    """Median seconds of ``python -c "import jax; jax.numpy.zeros(1)"``: the floor of a fresh
    process (issue 26's fresh-process target is this plus 1.0 s)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        command = [sys.executable, "-c", "import jax; jax.numpy.zeros(1)"]
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cold_start(folders: dict, prompt: list[int], new: int, envs: dict) -> list[dict]:
    """transmuter_jax to the first token at batch 1 in fresh processes: cache cold, then warm
    (each row with the bare ``import jax`` time measured just before)."""
    rows = []
    for export, folder in folders.items():
        cache = envs[export]["TRANSMUTER_JAX_COMPILE_CACHE"]
        for state in ("cold", "warm"):
            entries = sum(len(files) for _, _, files in os.walk(cache))
            job = make_job("jax", folder, prompt, 1, new, repeats=0, first_only=True)
            result, why = run_worker(sys.executable, job, envs[export])
            if result is None:
                print(f"  jax {export:<10} compile cache {state}: skipped: {why}")
                continue
            honoured = state == "cold" or entries > 0
            row = {"export": export, "cache": state, "cache_honoured": honoured, **result}
            rows.append({**row, "bare_import_s": round(bare_import_s(), 3)})
            note = "" if honoured else "  [TRANSMUTER_JAX_COMPILE_CACHE not honoured: no entries]"
            print(
                f"  jax {export:<10} compile cache {state}: {result['cold_ttft_s']:.2f} s from "
                f"process start ({result['cold_in_process_s']:.2f} s in process){note}"
            )
    return rows


def _prime(job: dict, python: str, env: dict | None) -> dict | None:
    """Runs a jax row's job once in a process of its own first: it compiles the row's programs
    into the export's compile cache, so that the measured process reads them back, as a user's
    every run after the first does. Returns that process's own figures (its peak while
    generating counts what compiling in the process leaves on the heap), or None."""
    result, why = run_worker(python, dict(job, repeats=1), env)
    if result is None:
        print(f"(priming failed: {why}) ", end="", flush=True)
        return None
    return {
        "tokens_per_s": result["tokens_per_s"],
        "peak_generating_mib": result["peak_generating_mib"],
        "imports_mib": result.get("rss_mib", {}).get("imports"),
        "programs_held_mib": result.get("programs_held_mib"),
    }


def peer_jobs(args, folders: dict, hf: str) -> list[tuple[str, str, str]]:
    """(peer, export, folder) of each selected peer on the exports (prepared) it runs."""
    jobs = []
    for export in folders:
        for peer in args.peers:
            if peer == "jax" or peer == "ort" or (peer == "genai" and export.startswith("genai")):
                jobs.append((peer, export, folders[export]))
    if "torch" in args.peers:
        jobs.append(("torch", "hf", hf))
    return jobs


def _own_genai(args, peer: str) -> bool:
    """Whether ``peer`` is the Generator installed in --genai-path (run by this interpreter)."""
    return peer == "genai" and bool(args.genai_path)


def _interpreter(args, peer: str, tools: str | None, jax_env: dict | None):
    """(python, environment) of one peer's worker."""
    if _own_genai(args, peer):
        path = os.pathsep.join(p for p in (args.genai_path, os.environ.get("PYTHONPATH")) if p)
        return sys.executable, dict(os.environ, PYTHONPATH=path)
    if peer in TOOLS_PEERS:
        return tools, None
    return sys.executable, jax_env if peer == "jax" else None


def measure(args) -> dict:
    """Runs every selected peer, export and batch; returns the figures."""
    from transmuter_jax import default

    started, load_start = datetime.datetime.now(), os.getloadavg()
    try:
        with open(os.path.join(default.path("hf"), "reference.json")) as file:
            prompt = json.load(file)["cases"][0]["prompt_ids"]
    except Exception as error:  # noqa: BLE001 - nothing can run without the prompt
        raise SystemExit(f"the default model's hf/reference.json is unavailable: {error}") from None
    print(
        f"prompt of {len(prompt)} tokens, {args.new} new tokens, {cores()} cores, load average "
        f"{load_start[0]:.2f}\nread bandwidth (1 GiB, best of 5 per method) ..."
    )
    bw_start = bandwidth(cores())
    tools, tools_why = None, ""
    if any(p in TOOLS_PEERS and not _own_genai(args, p) for p in args.peers):
        try:
            tools = default.tools_python()
        except Exception as error:  # noqa: BLE001 - any failure skips these peers only
            tools_why = f"no preparation environment ({error})"
    skipped, rows, cold, folders = [], [], [], {}
    for export in args.exports:
        try:
            folders[export] = default.path(export)
        except Exception as error:  # noqa: BLE001 - a missing export skips its rows only
            print(f"  {export}: skipped: cannot prepare it ({error})")
            skipped.append({"peer": "all", "export": export, "batch": 0, "why": str(error)})
    cache = tempfile.mkdtemp(prefix="perf-jax-cache-")  # one empty cache folder per export
    envs = {
        e: dict(os.environ, TRANSMUTER_JAX_COMPILE_CACHE=os.path.join(cache, e)) for e in folders
    }
    try:
        if "jax" in args.peers and args.cold:
            print("transmuter_jax cold start (fresh processes, an empty compile cache each):")
            cold = cold_start(folders, prompt, args.new, envs)
        print("decode (a fresh process each):")
        for peer, export, folder in peer_jobs(args, folders, default.path("hf")):
            for batch in args.batches:
                print(f"  {peer:<5} {export:<10} batch {batch} ...", end=" ", flush=True)
                if peer in TOOLS_PEERS and tools is None and not _own_genai(args, peer):
                    result, why = None, tools_why
                else:
                    job = make_job(peer, folder, prompt, batch, args.new, repeats=args.repeats,
                                   warmup=args.warmup or args.new)  # fmt: skip
                    job["spinning"] = args.ort_spinning == "on"
                    job["decode_steps"] = args.decode_steps
                    python, env = _interpreter(args, peer, tools, envs.get(export))
                    primed = _prime(job, python, env) if peer == "jax" else None
                    result, why = run_worker(python, job, env)
                    if result is not None and primed is not None:
                        result["compiled_here"] = primed
                if result is None:
                    print(f"skipped: {why}")
                    skipped.append({"peer": peer, "export": export, "batch": batch, "why": why})
                    continue
                print(f"{result['tokens_per_s']:.1f} tok/s")
                kv = batch * (len(prompt) + args.new) * kv_layout(folder)["bytes_per_token"]
                weights = weight_bytes(folder, export)
                row = dict(peer=peer, export=export, batch=batch, weight_bytes=weights, kv_bytes=kv)
                rows.append({**row, **result})
        sweep = _sweep(args, folders, prompt, envs) if args.sweep else []
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print("read bandwidth again ...")
    bw_end = bandwidth(cores())
    gbps = max(bw_start["gb_per_s"], bw_end["gb_per_s"])
    for row in rows:
        row["limit_tokens_per_s"] = gbps * 1e9 / row["weight_bytes"]  # at batch 1
        row["of_limit"] = row["tokens_per_s"] / row["batch"] / row["limit_tokens_per_s"]
        peak = row.get("peak_generating_mib")
        total = row["weight_bytes"] + row["kv_bytes"]
        row["memory_ratio"] = peak * 2**20 / total if peak else None
        base = row.get("rss_mib", {}).get("imports")  # the runtime before the model
        row["net_memory_ratio"] = (peak - base) * 2**20 / total if peak and base else None
        here = row.get("compiled_here")
        if here and here.get("peak_generating_mib") and here.get("imports_mib"):
            net = here["peak_generating_mib"] - here["imports_mib"]
            here["net_memory_ratio"] = net * 2**20 / total
    _agreement(rows)
    return {
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "cores": cores(),
            "platform": platform.platform(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "prompt_tokens": len(prompt),
        "new": args.new,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "ort_spinning": args.ort_spinning,
        "exports": args.exports,
        "bandwidth": {"gb_per_s": gbps, "start": bw_start, "end": bw_end},
        "rows": rows,
        "sweep": sweep,
        "cold_start": cold,
        "skipped": skipped,
    }


def _sweep(args, folders: dict, prompt: list[int], envs: dict) -> list[dict]:
    """transmuter_jax at batch 1 with each decode_steps value of --sweep (a fresh process each)."""
    print("decode_steps sweep (jax, batch 1):")
    rows = []
    for export, folder in folders.items():
        for steps in args.sweep:
            job = make_job("jax", folder, prompt, 1, args.new, repeats=args.repeats,
                           warmup=args.warmup or args.new)  # fmt: skip
            job["decode_steps"] = steps
            result, why = run_worker(sys.executable, job, envs[export])
            if result is None:
                print(f"  {export:<10} decode_steps {steps}: skipped: {why}")
                continue
            decode, call = result["tokens_per_s"], result["call_tokens_per_s"]
            print(
                f"  {export:<10} decode_steps {steps:>2}: {decode:.1f} tok/s decode, "
                f"{call:.1f} whole call, ttft {result['ttft_s'] * 1e3:.0f} ms"
            )
            rows.append({"export": export, "decode_steps": steps, **result})
    return rows


def _agreement(rows: list[dict]) -> None:
    """Sets "agree": the leading tokens of row 0 equal to PyTorch's (fp32) or the Generator's
    (int4) at the same batch."""
    reference = {}
    for row in rows:
        if row["peer"] == "torch" or (row["peer"] == "genai" and "int4" in row["export"]):
            reference[("int4" in row["export"], row["batch"])] = row["tokens"]
    for row in rows:
        theirs = reference.get(("int4" in row["export"], row["batch"]))
        if theirs is None:
            row["agree"] = None
            continue
        same = [a == b for a, b in zip(row["tokens"], theirs, strict=False)] + [False]
        row["agree"] = same.index(False)


def _find(rows: list[dict], peer: str, export: str, batch: int) -> dict | None:
    return next(
        (r for r in rows if (r["peer"], r["export"], r["batch"]) == (peer, export, batch)), None
    )


def targets(figures: dict) -> list[dict]:
    """Each target of the performance issue: its value, goal, whether met, and the numbers."""
    rows, out = figures["rows"], []

    def add(name: str, value: float, goal: float, detail: str, at_most: bool = False) -> None:
        met = value <= goal if at_most else value >= goal
        out.append({"target": name, "value": value, "goal": goal, "met": met, "detail": detail})

    for export, goal in (("genai-fp32", 1.1), ("optimum", 1.0)):
        jax = _find(rows, "jax", export, 1)
        peers = [r for p in ("ort", "genai") if (r := _find(rows, p, export, 1))]
        for figure, label in (("tokens_per_s", "decode"), ("call_tokens_per_s", "whole call")):
            if jax and peers and all(r.get(figure) for r in peers + [jax]):
                best = max(peers, key=lambda r: r[figure])
                add(
                    f"fp32 b1 {label} >= {goal}x the fastest onnxruntime path ({export})",
                    jax[figure] / best[figure],
                    goal,
                    f"{jax[figure]:.1f} vs {best['peer']} {best[figure]:.1f} tok/s",
                )
        if jax and peers:
            fastest = min(peers, key=lambda r: r["ttft_s"])
            add(
                f"warm time to first token <= onnxruntime's ({export})",
                jax["ttft_s"] / fastest["ttft_s"],
                1.0,
                f"{jax['ttft_s'] * 1e3:.0f} ms vs {fastest['peer']} "
                f"{fastest['ttft_s'] * 1e3:.0f} ms",
                at_most=True,
            )
        if jax:
            add(
                f"fp32 b1 within 15% of the bandwidth limit ({export})",
                jax["of_limit"],
                0.85,
                f"{jax['tokens_per_s']:.1f} of {jax['limit_tokens_per_s']:.1f} tok/s",
            )
    jax, generator = _find(rows, "jax", "genai-int4", 1), _find(rows, "genai", "genai-int4", 1)
    if jax and generator:
        for figure, label in (("tokens_per_s", "decode"), ("call_tokens_per_s", "whole call")):
            if jax.get(figure) and generator.get(figure):
                add(
                    f"int4 b1 {label} >= 1.0x onnxruntime-genai's Generator",
                    jax[figure] / generator[figure],
                    1.0,
                    f"{jax[figure]:.1f} vs {generator[figure]:.1f} tok/s",
                )
    for export in figures["exports"]:
        one, eight = _find(rows, "jax", export, 1), _find(rows, "jax", export, 8)
        if one and eight:
            add(
                f"b8 aggregate >= 4x b1 ({export})",
                eight["tokens_per_s"] / one["tokens_per_s"],
                4.0,
                f"{eight['tokens_per_s']:.1f} vs {one['tokens_per_s']:.1f} tok/s",
            )
    for row in rows:
        if row["peer"] == "jax" and row["net_memory_ratio"] is not None:
            add(
                f"peak RSS net of the runtime <= 1.3x weights + KV cache ({row['export']} "
                f"b{row['batch']})",
                row["net_memory_ratio"],
                1.3,
                f"{row['peak_generating_mib']:.0f} MiB less the "
                f"{row['rss_mib']['imports']:.0f} MiB after the imports vs "
                f"{(row['weight_bytes'] + row['kv_bytes']) / 2**20:.0f} MiB; gross "
                f"{row['memory_ratio']:.2f}x" + _compiled_here(row),
                at_most=True,
            )
    for row in figures["cold_start"]:
        if row["cache"] == "warm":
            add(
                f"cold start to the first token <= 2 s, cache warm ({row['export']})",
                row["cold_ttft_s"],
                2.0,
                f"{row['cold_ttft_s']:.2f} s from the process start, "
                f"{row['cold_in_process_s']:.2f} s in process",
                at_most=True,
            )
            if row.get("bare_import_s"):
                add(
                    f"fresh process to the first token <= import jax + 1.0 s ({row['export']})",
                    row["cold_ttft_s"] - row["bare_import_s"],
                    1.0,
                    f"{row['cold_ttft_s']:.2f} s against {row['bare_import_s']:.2f} s",
                    at_most=True,
                )
    return out


def _compiled_here(row: dict) -> str:
    """The priming process's net memory ratio (programs compiled in that process), if measured."""
    here = row.get("compiled_here") or {}
    if here.get("net_memory_ratio") is None:
        return ""
    return f" (compiled in the process: {here['net_memory_ratio']:.2f}x net)"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(figures: dict) -> None:
    """Prints the decode table, the cold starts, the profiles, the skipped and the targets."""
    bw = figures["bandwidth"]
    methods = ", ".join(f"{k} {v:.1f}" for k, v in bw["start"]["methods"].items())
    print(f"\nread bandwidth {bw['gb_per_s']:.1f} GB/s (at the start: {methods})")
    header = (
        f"{'peer':<6} {'export':<11} {'batch':>5} {'tok/s':>7} {'limit':>6} {'x lim':>5} "
        f"{'ttft ms':>8} {'cold s':>6} {'shapes':>6} {'peak MiB':>8} {'base':>5} "
        f"{'W+KV MiB':>8} {'x W+KV':>6} {'net x':>5} {'progs':>5} {'agree':>6}"
    )
    print(header + "\n" + "-" * len(header))
    for r in figures["rows"]:
        one = r["batch"] == 1
        if r["peer"] == "genai" and r.get("versions"):
            print(f"(genai: onnxruntime-genai {r['versions'].get('onnxruntime_genai')})")
        print(
            f"{r['peer']:<6} {r['export']:<11} {r['batch']:>5} {r['tokens_per_s']:>7.1f} "
            f"{_fmt(r['limit_tokens_per_s'] if one else None, '.1f'):>6} "
            f"{_fmt(r['of_limit'] if one else None, '.2f'):>5} {r['ttft_s'] * 1e3:>8.1f} "
            f"{r['cold_ttft_s']:>6.2f} {_fmt(r.get('compiled_shapes'), 'd'):>6} "
            f"{_fmt(r['peak_generating_mib'], '.0f'):>8} "
            f"{_fmt(r.get('rss_mib', {}).get('imports'), '.0f'):>5} "
            f"{(r['weight_bytes'] + r['kv_bytes']) / 2**20:>8.0f} "
            f"{_fmt(r['memory_ratio'], '.2f'):>6} {_fmt(r['net_memory_ratio'], '.2f'):>5} "
            f"{_fmt(r.get('programs_held_mib'), '.0f'):>5} {_fmt(r['agree'], 'd'):>3}/{r['new']}"
        )
    print(
        "tok/s: decode after the first token, all rows; limit: bandwidth / weight bytes (one pass"
        " over the weights a token);\nttft: warm; cold: to the first token of a fresh process"
        " (jax: compile cache warm: a priming process compiled the row's programs);\npeak:"
        " resident memory while generating (the targets also give the priming process's net x);"
        " base: resident after the imports; W+KV: weight files + float32 KV cache of"
        " prompt and new tokens; net x: (peak - base) / W+KV;\nprogs: resident memory given back"
        " when the context and jax's compiled programs are dropped (what they hold);\nagree:"
        " leading tokens of row 0 equal to PyTorch's (fp32) or the Generator's (int4)"
    )
    if figures["cold_start"]:
        print("\ntransmuter_jax to the first token in a fresh process, batch 1 (seconds)")
        print(
            f"{'export':<11} {'cache':<5} {'total':>6} {'in process':>10} {'import':>6} "
            f"{'load':>5} {'context':>7} {'first call':>10} {'trace':>6} {'lower':>6} "
            f"{'compile':>7} {'cache read':>10}"
        )
        for r in figures["cold_start"]:
            events = r.get("jax_events", {})
            print(
                f"{r['export']:<11} {r['cache']:<5} {r['cold_ttft_s']:>6.2f} "
                f"{r['cold_in_process_s']:>10.2f} {r['import_s']:>6.2f} {r['load_s']:>5.2f} "
                f"{r['context_s']:>7.2f} {r['cold_first_call_ttft_s']:>10.2f} "
                f"{events.get('jaxpr_trace_duration', 0):>6.2f} "
                f"{events.get('jaxpr_to_mlir_module_duration', 0):>6.2f} "
                f"{events.get('backend_compile_duration', 0):>7.2f} "
                f"{events.get('cache_retrieval_time_sec', 0):>10.2f}"
                + ("" if r["cache_honoured"] else "  (compile cache not honoured)")
            )
    if figures.get("sweep"):
        print("\ntransmuter_jax at batch 1 against decode_steps (new tokens per dispatch)")
        print(f"{'export':<11} {'steps':>5} {'decode tok/s':>12} {'whole call':>10} {'ttft ms':>8}")
        for r in figures["sweep"]:
            print(
                f"{r['export']:<11} {r['decode_steps']:>5} {r['tokens_per_s']:>12.1f} "
                f"{r['call_tokens_per_s']:>10.1f} {r['ttft_s'] * 1e3:>8.0f}"
            )
    for profile in figures.get("profiles", []):
        print("\n" + report(profile))
    for s in figures["skipped"]:
        print(f"skipped: {s['peer']} {s['export']} batch {s['batch']}: {s['why']}")
    if figures["targets"]:
        print("\ntargets")
        for t in figures["targets"]:
            status = "met " if t["met"] else "MISS"
            print(f"  {status} {t['target']}: {t['value']:.2f} (goal {t['goal']}); {t['detail']}")


def markdown(figures: dict) -> str:
    """The decode table, the cold starts and the targets as Markdown (for the README)."""
    out = [
        "| peer | export | batch | tok/s | limit | × limit | TTFT ms | cold s | shapes "
        "| peak MiB | base MiB | W+KV MiB | × W+KV | net × | programs MiB | agree |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in figures["rows"]:
        one = r["batch"] == 1
        cells = [
            r["peer"],
            r["export"],
            str(r["batch"]),
            f"{r['tokens_per_s']:.1f}",
            _fmt(r["limit_tokens_per_s"] if one else None, ".1f"),
            _fmt(r["of_limit"] if one else None, ".2f"),
            f"{r['ttft_s'] * 1e3:.0f}",
            f"{r['cold_ttft_s']:.2f}",
            _fmt(r.get("compiled_shapes"), "d"),
            _fmt(r["peak_generating_mib"], ".0f"),
            _fmt(r.get("rss_mib", {}).get("imports"), ".0f"),
            f"{(r['weight_bytes'] + r['kv_bytes']) / 2**20:.0f}",
            _fmt(r["memory_ratio"], ".2f"),
            _fmt(r["net_memory_ratio"], ".2f"),
            _fmt(r.get("programs_held_mib"), ".0f"),
            f"{_fmt(r['agree'], 'd')}/{r['new']}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    if figures["cold_start"]:
        out += [
            "",
            "| export | compile cache | total s | in process | import | load | context "
            "| first call | trace | lower | compile + cache read | cache read |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in figures["cold_start"]:
            events = r.get("jax_events", {})
            cells = [r["export"], r["cache"]] + [
                f"{value:.2f}"
                for value in (
                    r["cold_ttft_s"],
                    r["cold_in_process_s"],
                    r["import_s"],
                    r["load_s"],
                    r["context_s"],
                    r["cold_first_call_ttft_s"],
                    events.get("jaxpr_trace_duration", 0),
                    events.get("jaxpr_to_mlir_module_duration", 0),
                    events.get("backend_compile_duration", 0),
                    events.get("cache_retrieval_time_sec", 0),
                )
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "| target | goal | value | status | figures |", "|---|---:|---:|---|---|"]
    for t in figures["targets"]:
        status = "met" if t["met"] else "**missed**"
        out.append(f"| {t['target']} | {t['goal']} | {t['value']:.2f} | {status} | {t['detail']} |")
    return "\n".join(out)


def profiles(args) -> list[dict]:
    """profile_decode.py on each export and batch, each in a fresh process."""
    out = []
    for export in args.exports:
        for batch in args.batches:
            print(f"  profile {export} batch {batch} ...", flush=True)
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "profile.json")
                command = [sys.executable, os.path.join(HERE, "profile_decode.py")]
                command += ["--export", export, "--batch", str(batch), "--json", path]
                command += ["--new", str(min(args.new, 32))]
                try:
                    done = subprocess.run(
                        command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
                    )
                except subprocess.TimeoutExpired:
                    print(f"  profile {export} batch {batch} skipped: timed out")
                    continue
                if done.returncode != 0:
                    print(f"  profile {export} batch {batch} skipped: {_error_line(done.stderr)}")
                    continue
                with open(path) as file:
                    out.append(json.load(file))
    return out


def plot(figures: dict, path: str) -> None:
    """Tokens/s per export and peer, a panel per batch, log scale, with the limit at batch 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = figures["rows"]
    batches = sorted({r["batch"] for r in rows})
    exports = [e for e in (*EXPORTS, "hf") if any(r["export"] == e for r in rows)]
    colors = {"jax": "tab:blue", "ort": "tab:orange", "genai": "tab:green", "torch": "tab:red"}
    width = 0.8 / len(PEERS)
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for x, export in enumerate(exports):
            for p, peer in enumerate(PEERS):
                row = _find(rows, peer, export, batch)
                if row is not None:
                    offset = (p - (len(PEERS) - 1) / 2) * width
                    value = row["tokens_per_s"]
                    bar = ax.bar(x + offset, value, width, color=colors[peer], label=peer)
                    ax.bar_label(bar, fmt="%.0f", fontsize=7)
            same = [r for r in rows if r["export"] == export]
            if batch == 1 and same:
                limit = same[0]["limit_tokens_per_s"]
                ax.hlines(limit, x - 0.45, x + 0.45, "k", "--", label="bandwidth limit")
                ax.text(x, limit, f"{limit:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        values = [r["tokens_per_s"] for r in rows if r["batch"] == batch]
        limits = [r["limit_tokens_per_s"] for r in rows] if batch == 1 else []
        ax.set_ylim(min(values + [10]) / 2, max(values + limits) * 1.6)
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(range(len(exports)), exports)
        ax.set_ylabel("decode tokens/s (all rows)")
        ax.set_title(f"batch {batch}")
    unique = {}
    for ax in axes[0]:
        handles, labels = ax.get_legend_handles_labels()
        unique.update(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncols=len(unique), fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M-Instruct, {figures['new']} greedy tokens, {figures['machine']['cores']} "
        f"cores, read bandwidth {figures['bandwidth']['gb_per_s']:.1f} GB/s ({figures['date']})",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _names(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return values

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=_names(EXPORTS), default=list(EXPORTS))
    parser.add_argument("--peers", type=_names(PEERS), default=list(PEERS))
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=2, help="warm calls timed, the best counts")
    parser.add_argument(
        "--warmup", type=int, default=None,
        help="tokens of the first (cold) call (default: all --new); the warm calls' peak memory "
        "counts the loads of programs it did not reach (the slots' wider windows)",
    )  # fmt: skip
    parser.add_argument(
        "--no-cold", dest="cold", action="store_false", help="skip the jax cold-start runs"
    )
    parser.add_argument(
        "--ort-spinning",
        choices=("on", "off"),
        default="on",
        help="whether onnxruntime's idle threads spin (on: its default; off: better when other "
        "processes compete for the cores)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="jax: new tokens per dispatch (default: the library's)",
    )
    parser.add_argument(
        "--sweep",
        default="",
        help="jax batch 1 also with each of these decode_steps, e.g. 1,4,8,16,32,64",
    )
    parser.add_argument(
        "--genai-path",
        metavar="DIR",
        default=None,
        help="a folder holding onnxruntime_genai (pip install --target DIR "
        "onnxruntime-genai==0.18.0): the genai peer runs it with this interpreter",
    )
    parser.add_argument("--profile", action="store_true", help="run profile_decode.py too")
    parser.add_argument("--out", default=RESULTS, help="folder of the JSON and the plot")
    parser.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    parser.add_argument("--report", metavar="JSON", help="print the tables of a run; no runs")
    args = parser.parse_args(argv)
    if args.genai_path and not os.path.isdir(os.path.join(args.genai_path, "onnxruntime_genai")):
        parser.error(f"--genai-path {args.genai_path!r} holds no onnxruntime_genai package")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sweep = [int(n) for n in args.sweep.split(",") if n.strip()]
    if args.new < 2 or args.repeats < 1 or min(args.batches) < 1:
        parser.error("--new must be at least 2, --repeats and the batches at least 1")
    if args.report:
        with open(args.report) as file:
            figures = json.load(file)
        print_tables(figures)
        if args.markdown:
            print("\n" + markdown(figures))
        return 0
    figures = measure(args)
    figures["targets"] = targets(figures)
    figures["profiles"] = profiles(args) if args.profile else []
    print_tables(figures)
    if args.markdown:
        print("\n" + markdown(figures))
    if not figures["rows"]:
        print("nothing was measured")
        return 1
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"perf-{datetime.date.today().isoformat()}.json")
    with open(path, "w") as file:
        json.dump(figures, file, indent=1)
    png = os.path.join(args.out, "perf.png")
    try:
        plot(figures, png)
    except ImportError as error:
        png = f"not written ({error}: pip install -e '.[bench]')"
    print(f"\nwrote {path}\nplot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
