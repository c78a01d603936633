"""Writes REPORT.md and its plots from the measurements and the workload simulations."""

from __future__ import annotations

import collections
import pathlib
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from compiled_shapes import simulate as sim

WORKLOADS = (
    sim.Workload(
        "chat, in_place (SmolLM2 genai)",
        "in_place",
        (150, 0.9, 1, 1800),
        (120, 0.8, 1, 512),
        512,
        (1, 4, 8),
        400,
        "SmolLM2-135M genai-fp32",
    ),
    sim.Workload(
        "chat, append (SmolLM2 optimum)",
        "append",
        (150, 0.9, 1, 1800),
        (120, 0.8, 1, 512),
        512,
        (1, 4, 8),
        400,
        "SmolLM2-135M optimum",
    ),
    sim.Workload(
        "short completions, in_place",
        "in_place",
        (20, 0.6, 1, 128),
        (16, 0.6, 1, 64),
        64,
        (1, 8),
        400,
        "SmolLM2-135M genai-fp32",
    ),
    sim.Workload(
        "Whisper transcription, grow",
        "grow",
        (4, 0, 4, 4),
        (60, 0.7, 1, 444),
        444,
        (1, 4),
        200,
        "whisper-tiny (random)",
    ),
    sim.Workload(
        "Marian translation, grow",
        "grow",
        (1, 0, 1, 1),
        (30, 0.6, 2, 511),
        511,
        (1, 8),
        200,
        "whisper-tiny (random)",
    ),
)
SHARED_POLICIES = [
    sim.policy("buckets", "percall"),
    sim.policy("buckets", "windows"),
    sim.policy("buckets", "capacity64"),
    sim.policy("pow2", "capacity64"),
    sim.policy("exact", "capacity64"),
    sim.policy("multiple:16", "capacity64"),
    sim.policy("multiple:64", "capacity64"),
    sim.policy("pow2min:16", "capacity64"),
    sim.policy("nextpow2", "capacity64"),
    sim.policy("pow2", "capacity256"),
    sim.policy("pow2", "capacitygeo"),
    sim.policy("pow2", "capacitypow2"),
    sim.policy("exact", "capacitypow2"),
    sim.policy("multiple:64", "capacitypow2"),
    sim.policy("pow2", "growing:64"),
    sim.policy("pow2", "growing:256"),
    sim.policy("multiple:64", "growing:256"),
    sim.policy("pow2", "fixed:4096"),
]
GROW_POLICIES = [
    sim.policy("pow2", "exact"),
    sim.policy("exact", "exact"),
    sim.policy("buckets", "padded64"),
    sim.policy("pow2", "padded64"),
    sim.policy("exact", "padded64"),
    sim.policy("pow2", "paddedpow2"),
    sim.policy("buckets", "bucket64"),
    sim.policy("pow2", "bucket64"),
    sim.policy("pow2", "fixed:512"),
]
IMPLEMENTED = {
    "in_place": "buckets / percall",
    "append": "buckets / percall",
    "grow": "buckets / padded64",
}
BEFORE = "pow2 / exact"  # grow before this change


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def per_shape_times(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Median compile seconds of one step shape, per model: prefill (more than one token) and
    decode (one token)."""
    groups: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: {"prefill": [], "decode": []}
    )
    for step in data["steps"]:
        groups[step["model"]]["prefill" if step["tokens"] > 1 else "decode"].append(
            step["compile_s"]
        )
    out = {}
    for model, kinds in groups.items():
        decode = _median(kinds["decode"])
        prefill = _median(kinds["prefill"]) if kinds["prefill"] else decode
        out[model] = {"prefill": prefill, "decode": decode}
    for run in data["fixture_runs"]:
        kinds = out.setdefault(run["model"], {"values": []})  # type: ignore[dict-item]
        kinds.setdefault("values", []).append(run["compile_s"] / run["shapes"])
    for kinds in out.values():
        if "values" in kinds:
            value = _median(kinds.pop("values"))  # type: ignore[arg-type]
            kinds.setdefault("prefill", value)
            kinds.setdefault("decode", value)
    return out


def row_costs(data: dict[str, Any]) -> dict[str, float]:
    """Seconds per cache row a one-token step reads, per model: the least-squares slope of the
    measured decode step time (batch 1) against the rows."""
    points: dict[str, dict[int, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for step in data["steps"]:
        if step["tokens"] == 1 and (step["mode"] != "grow" or step["padded"]):
            points[step["model"]][step["rows"]].append(step["run_s"])
    out = {}
    for model, by_rows in points.items():
        xs = sorted(by_rows)
        ys = [_median(by_rows[x]) for x in xs]
        if len(xs) < 2:
            continue
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
        out[model] = max(slope / sum((x - mx) ** 2 for x in xs), 0.0)
    return out


def simulate_all(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every workload x batch size x policy: shapes, estimated compile time, work done."""
    times = per_shape_times(data)
    costs = row_costs(data)
    rows = []
    for workload in WORKLOADS:
        requests = sim.requests(workload)
        policies = GROW_POLICIES if workload.mode == "grow" else SHARED_POLICIES
        for batch in workload.batches:
            base = None
            for policy in policies:
                try:
                    trace = sim.run(workload.mode, policy, batch, requests)
                except ValueError:  # a fixed cache too small for the workload
                    continue
                if base is None:
                    base = trace
                rows.append(
                    {
                        "workload": workload.name,
                        "mode": workload.mode,
                        "batch": batch,
                        "policy": policy.name,
                        "shapes": len(trace.shapes),
                        "compile_s": sim.compile_seconds(trace.shapes, times[workload.model]),
                        "steps": trace.steps,
                        "tokens": trace.tokens / base.tokens,
                        "attention": trace.attended / max(trace.real_attended, 1),
                        "attention_s": trace.decode_rows * costs.get(workload.model, 0.0),
                        "copies": len(trace.copies),
                        "curve": sim.cumulative_shapes(workload.mode, policy, batch, requests),
                    }
                )
    return rows


def _table(header: Sequence[str], lines: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def _fixture_table(data: dict[str, Any]) -> tuple[str, dict]:
    groups = collections.defaultdict(list)
    for run in data["fixture_runs"]:
        groups[(run["model"], run["case"], run["mode"], run["padded"])].append(run)
    lines, summary = [], {}
    for (model, case, mode, padded), runs in groups.items():
        shapes = runs[0]["shapes"]
        compile_s = _median(r["compile_s"] for r in runs)
        wall = _median(r["wall_s"] for r in runs)
        ok = all(r["tokens_ok"] for r in runs)
        cache = ("padded" if padded else "exact") if mode == "grow" else "buffer"
        summary[(model, case, cache)] = {"shapes": shapes, "compile_s": compile_s, "wall_s": wall}
        lines.append(
            (
                model,
                case,
                mode,
                cache,
                shapes,
                f"{compile_s:.1f}",
                f"{compile_s / shapes:.2f}",
                f"{wall:.1f}",
                "yes" if ok else "**no**",
            )
        )
    header = (
        "fixture",
        "case",
        "mode",
        "cache",
        "shapes",
        "step compile s",
        "s / shape",
        "wall s",
        "tokens = transformers",
    )
    return _table(header, lines), summary


def _step_table(data: dict[str, Any]) -> tuple[str, dict]:
    groups = collections.defaultdict(list)
    for step in data["steps"]:
        key = (step["model"], step["mode"], step["tokens"], step["rows"], step["valid"])
        groups[key + (step["padded"],)].append(step)
    lines, summary = [], {}
    for (model, mode, tokens, rows, valid, padded), steps in groups.items():
        compile_s = _median(s["compile_s"] for s in steps)
        run_ms = 1000 * _median(s["run_s"] for s in steps)
        summary[(model, tokens, rows, valid, padded)] = (compile_s, run_ms)
        cache = ("padded" if padded else "exact") if mode == "grow" else "buffer"
        lines.append((model, mode, cache, tokens, rows, valid, f"{compile_s:.2f}", f"{run_ms:.1f}"))
    header = ("model", "mode", "cache", "step tokens", "cache rows", "valid", "compile s", "run ms")
    return _table(header, lines), summary


def _plots(data, rows, steps, plots: pathlib.Path) -> list[str]:
    import matplotlib  # noqa: PLC0415 - a report-only dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plots.mkdir(exist_ok=True)
    names = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(plots / name, dpi=80)
        plt.close(fig)
        names.append(name)

    # 1. Distinct shapes as requests arrive: chat, in_place, batch 4.
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for row in rows:
        if row["workload"].startswith("chat, in_place") and row["batch"] == 4:
            requests = [4 * (i + 1) for i in range(len(row["curve"]))]
            ax.plot(requests, row["curve"], label=row["policy"])
    ax.set_xlabel("requests served")
    ax.set_ylabel("distinct compiled step shapes")
    ax.set_title("chat on in_place (SmolLM2), batches of 4")
    ax.legend(fontsize=7, ncol=2)
    save(fig, "chat_shapes.png")

    # 2. Whisper: compile seconds spent as the transcription grows.
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for run in data["transcriptions"]:
        if not run["step_s"]:
            continue
        total, xs, ys = 0.0, [], []
        for i, seconds in enumerate(run["step_s"]):
            total += seconds
            xs.append(i + 1)
            ys.append(total)
        cache = "exact lengths"
        if run["padded"]:
            cache = "buckets of 64 rows" if "buckets" in run["case"] else "padded, 448 rows"
        ax.plot(xs, ys, label=f"{cache}: {run['shapes']} shapes")
    full = data.get("full_exact", {}).get("samples")
    if full:
        label = f"exact lengths, 444 asked: the process died at {full[-1]['tokens']}"
        ax.plot([x["tokens"] for x in full], [x["seconds"] for x in full], label=label)
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("seconds since the start")
    ax.set_title("whisper-tiny (random weights), batch 1, measured")
    ax.legend(fontsize=8)
    save(fig, "whisper_transcription.png")

    # 2b. Memory mappings of the process as the transcription grows.
    memory = dict(data.get("memory", {}))
    if data.get("full_exact", {}).get("samples"):
        memory["exact (full run)"] = data["full_exact"]["samples"]
    if memory:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for label, samples in sorted(memory.items(), key=lambda kv: -len(kv[1])):
            added = [x["maps"] - samples[0]["maps"] for x in samples]
            ax.plot([x["tokens"] for x in samples], added, label=label)
        start = memory.get("exact (full run)", [{"maps": 0}])[0]["maps"]
        ax.axhline(65530 - start, color="grey", linestyle="--", label="vm.max_map_count (65530)")
        ax.set_xlabel("tokens generated")
        ax.set_ylabel("memory mappings added")
        ax.set_title("whisper-tiny (random weights): every program keeps its mappings")
        ax.legend(fontsize=8)
        save(fig, "whisper_memory.png")

    # 3. Decode step time against the cache rows it reads.
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    series = collections.defaultdict(list)
    for (model, tokens, rows_, _, padded), (_, run_ms) in steps.items():
        if tokens == 1:
            label = model + (" padded" if padded else (" exact" if "whisper" in model else ""))
            series[label].append((rows_, run_ms))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache rows read by the step")
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title("the cost of reading padding rows, measured")
    ax.legend(fontsize=7)
    save(fig, "decode_rows.png")

    # 4. Distinct shapes per policy and workload (batch 1).
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.8))
    for ax, grow in zip(axes, (False, True), strict=True):
        chosen = [r for r in rows if r["batch"] == 1 and (r["mode"] == "grow") == grow]
        workloads = list(dict.fromkeys(r["workload"] for r in chosen))
        policies = list(dict.fromkeys(r["policy"] for r in chosen))
        width = 0.8 / len(workloads)
        for k, workload in enumerate(workloads):
            values = [
                next(
                    (r["shapes"] for r in chosen if r["workload"] == workload and r["policy"] == p),
                    0,
                )
                for p in policies
            ]
            ax.bar([i + k * width for i in range(len(policies))], values, width, label=workload)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(policies))])
        ax.set_xticklabels(policies, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("distinct shapes (batch 1)")
        ax.legend(fontsize=6)
    save(fig, "policies.png")
    return names


def _simulation_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        implemented = r["policy"] == IMPLEMENTED[r["mode"]]
        policy = f"**{r['policy']}**" if implemented else r["policy"]
        lines.append(
            (
                r["workload"],
                r["batch"],
                policy,
                r["shapes"] if not r["copies"] else f"{r['shapes']} + {r['copies']} copies",
                f"{r['compile_s']:.0f}",
                r["steps"],
                f"{r['tokens']:.2f}",
                f"{r['attention']:.2f}",
                f"{r['attention_s']:.0f}",
                f"{r['compile_s'] + r['attention_s']:.0f}",
            )
        )
    header = (
        "workload",
        "batch",
        "policy (prompt / cache)",
        "shapes",
        "est. compile s",
        "steps",
        "token work",
        "attention work",
        "est. decode attention s",
        "sum s",
    )
    return _table(header, lines)


def _find(rows, workload: str, batch: int, policy: str) -> dict[str, Any]:
    return next(
        r
        for r in rows
        if r["workload"].startswith(workload) and r["batch"] == batch and r["policy"] == policy
    )


def write(data: dict[str, Any], report: pathlib.Path, plots: pathlib.Path) -> None:
    """Writes ``report`` and the PNGs in ``plots`` from the measurements ``data``."""
    rows = simulate_all(data)
    fixture_table, fixtures = _fixture_table(data)
    step_table, steps = _step_table(data)
    _plots(data, rows, steps, plots)
    times = per_shape_times(data)
    numbers = _Numbers(_numbers(data, rows, fixtures, steps, times))
    numbers["fixture_table"] = fixture_table
    numbers["step_table"] = step_table
    numbers["simulation_table"] = _simulation_table(rows)
    numbers["graph_table"] = _table(
        ("model", "decoder layers", "graph nodes (decode step)", "compile s / decode shape"),
        [
            (name, g["layers"], g["nodes"], f"{times[name]['decode']:.2f}")
            for name, g in data.get("graphs", {}).items()
            if name in times
        ],
    )
    numbers["times_table"] = _table(
        ("model", "prefill s / shape", "decode s / shape"),
        [(m, f"{t['prefill']:.2f}", f"{t['decode']:.2f}") for m, t in sorted(times.items())],
    )
    text = TEMPLATE.format_map(numbers)
    report.write_text(text)


class _Numbers(dict):
    """The report's numbers; one that was not measured reads "?"."""

    def __missing__(self, key: str) -> str:
        return "?"


def _numbers(data, rows, fixtures, steps, times) -> dict[str, str]:
    """The numbers the report's sentences quote."""
    wt = "whisper-tiny (random)"
    n = {
        "machine": data["machine"]["note"],
        "cpus": str(data["machine"]["cpus"]),
        "jax": data["machine"]["jax"],
        "repeats": str(data["repeats"]),
    }
    per = times.get(wt, {}).get("decode", float("nan"))
    n["wt_per_shape"] = f"{per:.2f}"
    n["wt_448_est_min"] = f"{448 * per / 60:.0f}"
    for run in data.get("transcriptions", []):
        key = {"444 tokens": "pad", "444 tokens, buckets": "buck", "64 tokens": "ex64"}.get(
            run["case"]
        )
        if key is None:
            continue
        n[f"wt_{key}_shapes"] = str(run["shapes"])
        n[f"wt_{key}_compile"] = f"{run['compile_s']:.1f}"
        n[f"wt_{key}_wall"] = f"{run['wall_s']:.1f}"
        if len(run["step_s"]) > 4:
            n[f"wt_{key}_step_ms"] = f"{1000 * _median(run['step_s'][2:]):.1f}"
    for key, label in (("exact", False), ("padded", True)):
        for size in (4, 64, 128, 256, 447, 448):
            value = steps.get((wt, 1, size, 16 if label else size, label))
            if value:
                n[f"wt_{key}_{size}_ms"] = f"{value[1]:.1f}"
    fixture = times.get("whisper-optimum", {}).get("decode")
    if fixture and per == per:  # compile time against layers: 2 (fixture) and 4 (whisper-tiny)
        slope = (per - fixture) / 2
        for name, layers in (("base", 6), ("small", 12), ("large", 32)):
            estimate = fixture + (layers - 2) * slope
            n[f"whisper_{name}_s"] = f"{estimate:.1f}"
            n[f"whisper_{name}_min"] = f"{448 * estimate / 60:.0f}"
        n["whisper_fixture_s"] = f"{fixture:.2f}"
    _memory_numbers(data, n)
    costs = row_costs(data)
    for model, key in (("SmolLM2-135M genai-fp32", "smol"), (wt, "wt")):
        if model in costs:
            n[f"{key}_row_us"] = f"{1e6 * costs[model]:.1f}"
    smol = "SmolLM2-135M genai-fp32"
    for rows_ in (64, 256, 1024, 2048):
        value = steps.get((smol, 1, rows_, min(rows_ - 1, 16), False))
        if value:
            n[f"smol_{rows_}_ms"] = f"{value[1]:.1f}"
    for model, key in ((smol, "smol"), ("SmolLM2-135M optimum", "opt")):
        if model in times:
            n[f"{key}_prefill"] = f"{times[model]['prefill']:.2f}"
            n[f"{key}_decode"] = f"{times[model]['decode']:.2f}"
    for name in ("whisper-optimum", "marian-optimum", "gemma3-optimum"):
        exact = fixtures.get((name, "batch", "exact"))
        pad = fixtures.get((name, "batch", "padded"))
        short = name.split("-")[0]
        if exact and pad:
            n[f"{short}_exact_shapes"] = str(exact["shapes"])
            n[f"{short}_pad_shapes"] = str(pad["shapes"])
            n[f"{short}_exact_s"] = f"{exact['wall_s']:.1f}"
            n[f"{short}_pad_s"] = f"{pad['wall_s']:.1f}"
    policies = {
        "w": (
            "Whisper",
            {"before": BEFORE, "after": "buckets / padded64", "bucket": "buckets / bucket64"},
        ),
        "m": (
            "Marian",
            {"before": BEFORE, "after": "buckets / padded64", "bucket": "buckets / bucket64"},
        ),
        "c": (
            "chat, in_place",
            {
                "impl": "buckets / percall",
                "win": "buckets / windows",
                "cap": "buckets / capacity64",
                "pow2": "pow2 / capacity64",
                "exact": "exact / capacity64",
                "m16": "multiple:16 / capacity64",
                "m64": "multiple:64 / capacity64",
                "p16": "pow2min:16 / capacity64",
                "cpow2": "pow2 / capacitypow2",
                "fixed": "pow2 / fixed:4096",
                "geo": "pow2 / capacitygeo",
                "c256": "pow2 / capacity256",
                "g64": "pow2 / growing:64",
                "g256": "pow2 / growing:256",
                "m64g256": "multiple:64 / growing:256",
            },
        ),
        "s": (
            "short completions",
            {
                "impl": "buckets / percall",
                "win": "buckets / windows",
                "cap": "buckets / capacity64",
                "m64": "multiple:64 / capacity64",
                "g64": "pow2 / growing:64",
            },
        ),
    }
    for prefix, (workload, named) in policies.items():
        for batch in (1, 4, 8):
            for key, policy in named.items():
                try:
                    row = _find(rows, workload, batch, policy)
                except StopIteration:
                    continue
                at = f"{prefix}{batch}_{key}"
                n[at] = str(row["shapes"])
                n[f"{at}_copies"] = str(row["copies"])
                n[f"{at}_s"] = f"{row['compile_s']:.0f}"
                n[f"{at}_min"] = f"{row['compile_s'] / 60:.0f}"
                n[f"{at}_tok"] = f"{row['tokens']:.2f}"
                n[f"{at}_att"] = f"{row['attention']:.1f}"
                n[f"{at}_att_s"] = f"{row['attention_s']:.0f}"
                n[f"{at}_sum"] = f"{row['compile_s'] + row['attention_s']:.0f}"
    return n


def _memory_numbers(data: dict[str, Any], n: dict[str, str]) -> None:
    """Mappings and resident memory per compiled program, and how the full exact run ended."""
    exact = data.get("full_exact", {}).get("samples") or data.get("memory", {}).get("exact")
    if exact and len(exact) > 2:
        first, last = exact[1], exact[-1]
        programs = max(last["shapes"] - first["shapes"], 1)
        maps = (last["maps"] - first["maps"]) / programs
        n["maps_per_program"] = f"{maps:.0f}"
        n["rss_per_program"] = f"{(last['rss_mb'] - first['rss_mb']) / programs:.1f}"
        n["programs_to_limit"] = f"{first['shapes'] + (65530 - first['maps']) / maps:.0f}"
    padded = data.get("memory", {}).get("padded")
    if padded:
        n["padded_maps"] = str(padded[-1]["maps"])
        n["padded_rss"] = f"{padded[-1]['rss_mb']:.0f}"
    full = data.get("full_exact")
    if full:
        samples = full["samples"] or [{"tokens": 0, "maps": 0, "seconds": 0, "rss_mb": 0}]
        last = samples[-1]
        n["full_tokens"] = str(last["tokens"])
        n["full_maps"] = str(last["maps"])
        n["full_minutes"] = f"{full['seconds'] / 60:.0f}"
        n["full_rss"] = f"{last['rss_mb']:.0f}"
        n["full_end"] = (
            "finished"
            if full["returncode"] == 0 and last["tokens"] >= 440
            else f"died with exit status {full['returncode']} between {last['tokens']} and "
            f"{last['tokens'] + 10} tokens"
        )
        n["full_error"] = full["errors"][-1].split("]")[-1].strip() if full["errors"] else "none"


TEMPLATE = (pathlib.Path(__file__).parent / "report_template.md").read_text()
