"""The study of compiled-shape caching: measurements, workload simulations, plots and REPORT.md.

    .venv/bin/python compiled_shapes/study.py             # simulate and report (stored numbers)
    .venv/bin/python compiled_shapes/study.py --measure   # measure again first (~35 minutes)
    .venv/bin/python compiled_shapes/study.py --measure steps,memory   # some parts only
    .venv/bin/python compiled_shapes/study.py --full-whisper   # + a 444-token exact-length run

Measurements go to results/measurements.json, plots to plots/, the report to REPORT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ["TRANSMUTER_JAX_COMPILE_CACHE"] = "off"  # a compile must not be a disk read
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

RESULTS = HERE / "results" / "measurements.json"
PLOTS = HERE / "plots"
REPORT = HERE / "REPORT.md"
DEFAULT_MODEL = pathlib.Path.home() / ".cache/transmuter_jax/models/SmolLM2-135M-Instruct"
WHISPER_TINY = pathlib.Path.home() / ".cache/transmuter_jax/study/whisper-tiny-random"

FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_FILES = {
    "llama-optimum": "model.onnx",
    "llama-genai-fp32": "model.onnx",
    "whisper-optimum": "decoder_model_merged.onnx",
    "marian-optimum": "decoder_model_merged.onnx",
    "gemma3-optimum": "model.onnx",
}
FIXTURE_RUNS = [  # (fixture, case, pad the grow cache)
    ("llama-optimum", "batch", True),
    ("llama-genai-fp32", "batch", True),
    ("whisper-optimum", "greedy", False),
    ("whisper-optimum", "greedy", True),
    ("whisper-optimum", "batch", False),
    ("whisper-optimum", "batch", True),
    ("marian-optimum", "batch", False),
    ("marian-optimum", "batch", True),
    ("gemma3-optimum", "batch", False),
    ("gemma3-optimum", "batch", True),
]


def log(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


PARTS = ("fixtures", "steps", "transcriptions", "memory", "full")


def measure(parts: set[str], repeats: int, data: dict[str, Any]) -> dict[str, Any]:
    """Runs the measurements ``parts`` into ``data`` (the others keep their stored values); the
    machine may be shared, so each is repeated (medians)."""
    import jax  # noqa: PLC0415

    from compiled_shapes import measure as m  # noqa: PLC0415 - imports JAX and the package

    data["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "note": "shared with other engineers' jobs at times",
    }
    data["repeats"] = repeats
    data["graphs"] = graphs()
    whisper = (WHISPER_TINY / "decoder_model_merged.onnx").exists()
    if "fixtures" in parts:
        data["fixture_runs"] = []
        with tempfile.TemporaryDirectory() as work:
            for r in range(repeats):
                for name, case, padded in FIXTURE_RUNS:
                    run = m.fixture_run(name, case, padded, pathlib.Path(work))
                    log("fixture", r, dataclasses.asdict(run) | {"step_s": None})
                    data["fixture_runs"].append(dataclasses.asdict(run))
    if "steps" in parts:
        data["steps"] = []
        for r in range(repeats):
            for variant in ("genai-fp32", "optimum"):
                folder = DEFAULT_MODEL / variant
                if not (folder / "model.onnx").exists():
                    log("skipping", folder)
                    continue
                label = f"SmolLM2-135M {variant}"
                prompts, capacities = (8, 64, 256), (64, 256, 1024, 2048)
                for step in m.default_model_steps(folder, label, prompts, capacities):
                    log("step", r, dataclasses.asdict(step))
                    data["steps"].append(dataclasses.asdict(step))
            if whisper:
                for step in m.whisper_steps(WHISPER_TINY, (4, 64, 256, 447), (64, 128, 256, 448)):
                    log("step", r, dataclasses.asdict(step))
                    data["steps"].append(dataclasses.asdict(step))
    if "transcriptions" in parts and whisper:
        data["transcriptions"] = []
        for tokens, grow_cache in ((444, "padded"), (444, "buckets"), (64, "exact")):
            run = m.whisper_transcription(WHISPER_TINY, tokens, grow_cache)
            log("transcription", dataclasses.asdict(run) | {"step_s": None})
            data["transcriptions"].append(dataclasses.asdict(run))
    if "memory" in parts and whisper:
        data["memory"] = {
            "exact": memory_run(60, "exact")["samples"],
            "padded": memory_run(444, "padded")["samples"],
        }
        log("memory", data["memory"]["exact"][-1], data["memory"]["padded"][-1])
    if "full" in parts and whisper:
        data["full_exact"] = memory_run(444, "exact")
        log("full exact run", {k: v for k, v in data["full_exact"].items() if k != "samples"})
    return data


def memory_run(tokens: int, grow_cache: str) -> dict[str, Any]:
    """A whisper-tiny transcription of ``tokens`` tokens in a process of its own (which may not
    survive it): its memory samples, how it ended, and the errors it wrote to stderr."""
    command = [sys.executable, "-m", "compiled_shapes.measure", "memory", str(tokens), grow_cache]
    command.append(str(WHISPER_TINY))
    start = time.perf_counter()
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    samples = [
        json.loads(line.split(" ", 1)[1])
        for line in process.stdout.splitlines()
        if line.startswith("memory ")
    ]
    errors = [line for line in process.stderr.splitlines() if "rror" in line]
    return {
        "returncode": process.returncode,
        "seconds": time.perf_counter() - start,
        "samples": samples,
        "errors": sorted(set(errors))[-3:],
        "error_lines": len(errors),
    }


def graphs() -> dict[str, dict[str, int]]:
    """Decoder layers and graph nodes of a decode step of each measured model."""
    from compiled_shapes import measure as m  # noqa: PLC0415

    files = {name: FIXTURES / name / file for name, file in FIXTURE_FILES.items()}
    files["SmolLM2-135M genai-fp32"] = DEFAULT_MODEL / "genai-fp32" / "model.onnx"
    files["SmolLM2-135M optimum"] = DEFAULT_MODEL / "optimum" / "model.onnx"
    files["whisper-tiny (random)"] = WHISPER_TINY / "decoder_model_merged.onnx"
    out = {}
    for name, path in files.items():
        if path.exists():
            config = json.loads((path.parent / "config.json").read_text())
            layers = config.get("decoder_layers") or config.get("num_hidden_layers", 0)
            out[name] = {"nodes": m.node_count(path), "layers": int(layers)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--measure",
        nargs="?",
        const="fixtures,steps,transcriptions,memory",
        help=f"measure again (slow): comma-separated parts of {PARTS}",
    )
    parser.add_argument("--full-whisper", action="store_true", help="also a 444-token exact run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    parts = set(args.measure.split(",")) if args.measure else set()
    parts |= {"full"} if args.full_whisper else set()
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; known: {PARTS}")
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if parts or not data:
        data = measure(parts or set(PARTS) - {"full"}, args.repeats, data)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(data, indent=1))
    from compiled_shapes import report  # noqa: PLC0415

    report.write(data, REPORT, PLOTS)
    log("wrote", REPORT)


if __name__ == "__main__":
    main()
