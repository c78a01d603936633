"""What perf.py and profile_decode.py share: the jobs of perf_workers.py and the profile report.

Only the standard library: both scripts import it, and neither imports the other.
"""

from __future__ import annotations

import json
import os


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def weight_bytes(folder: str, export: str) -> int:
    """Weight bytes read per token: the model files' sizes (the graph is a few hundred kB)."""
    if export == "hf":
        names = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    else:
        names = [n for n in os.listdir(folder) if n.startswith("model.onnx")]
    return sum(os.path.getsize(os.path.join(folder, n)) for n in names)


def kv_layout(folder: str) -> dict:
    """KV heads and head size from config.json, and the float32 KV-cache bytes per token."""
    with open(os.path.join(folder, "config.json")) as file:
        config = json.load(file)
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * heads * size * 4
    return {"kv_heads": heads, "head_size": size, "bytes_per_token": per_token}


def eos_ids(folder: str) -> list[int]:
    """The eos ids of generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as file:
                eos = json.load(file).get("eos_token_id")
            if eos is not None:
                return eos if isinstance(eos, list) else [eos]
    return []


def make_job(peer: str, folder: str, prompt: list[int], batch: int, new: int, **extra) -> dict:
    """A perf_workers.py job."""
    layout = kv_layout(folder)
    job = dict(peer=peer, folder=folder, file="model.onnx", prompt=prompt, batch=batch, new=new)
    job.update(eos=eos_ids(folder), kv_heads=layout["kv_heads"], head_size=layout["head_size"])
    job.update(threads=cores(), repeats=1, first_only=False)
    job.update(extra)
    return job


def report(figures: dict, top: int = 8) -> str:
    """The breakdowns as text, the ``top`` largest op kinds of each."""
    lines = [f"profile of decode steps: {figures['export']}, batch {figures['batch']}"]
    j, o = figures.get("jax"), figures.get("ort")
    if j:
        rate = j["params_bytes"] / j["xla_busy_ms"] / 1e6
        lines.append(
            f"  jax: {j['step_ms']:.2f} ms a step = XLA ops {j['xla_busy_ms']:.2f} ms + other "
            f"(host loop, dispatch, idle) {j['other_ms']:.2f} ms; weights "
            f"{j['params_bytes'] / 1e6:.0f} MB: {rate:.1f} GB/s of op time"
        )
        if "gaps_within_ms" in j:
            lines.append(
                f"    of other: gaps between a step's ops {j['gaps_within_ms']:.2f} ms, the host's "
                f"between chunks and before the first {j['gaps_between_ms']:.2f} ms"
            )
        lines += [f"    {op:<40} {ms:>8.2f} ms" for op, ms in list(j["ops_ms"].items())[:top]]
    if o:
        rate = figures["weight_bytes"] / o["session_run_ms"] / 1e6
        lines.append(
            f"  ort: {o['step_ms']:.2f} ms a step, session run {o['session_run_ms']:.2f} ms; "
            f"weights {figures['weight_bytes'] / 1e6:.0f} MB: {rate:.1f} GB/s of run time"
        )
        lines += [f"    {op:<40} {ms:>8.2f} ms" for op, ms in list(o["ops_ms"].items())[:top]]
    return "\n".join(lines)
