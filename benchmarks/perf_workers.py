"""One peer of benchmarks/perf.py, timed in its own process: greedy generation of one prompt.

Usage: PYTHON benchmarks/perf_workers.py JOB_JSON

JOB_JSON keys: peer ("jax", "ort", "genai" or "torch"), folder, file (the ONNX file in the
folder), prompt (token ids), batch, new (tokens per row), eos (ids suppressed until then),
kv_heads and head_size (from config.json), repeats, threads, launch (time.time() when the parent
started this process), first_only (stop at the first token of the first call: the cold start),
warmup (optional: tokens of the first call otherwise, 8), decode_steps (optional, jax: new
tokens per dispatch; the library's default otherwise),
ort_profile (optional: onnxruntime's profiler writes a file with this prefix), spinning
(optional, ort: whether its idle threads spin, onnxruntime's default true).

Prints one line, ``RESULT {json}``: the first call's time to first token counted from ``launch``
(the cold start) and in this process, the import and load times, then for the best of
``repeats`` warm calls the time to first token and the decode tokens/s after it (all rows), the
first row's tokens, the peak resident memory (VmHWM) while the warm calls ran and over the whole
process, the resident memory after the imports, the load and the first call, and the peer's own
details (jax: compiled shapes, JAX's compile events). Only the standard library is imported at
the top: the parent runs the onnxruntime-genai and PyTorch peers with the preparation
environment's interpreter, the others with its own.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time

_START = time.perf_counter()  # this module's start: the in-process part of the cold start
_OFFSET = time.time() - _START  # perf_counter to wall clock


class _Stop(Exception):
    """Raised from a token callback to end a call early (the cold start, the warm-up)."""


def _status_kib(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmHWM: peak resident set), or None."""
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Resets VmHWM to the current resident set (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def _peak_mib() -> float:
    """Peak resident memory so far in MiB: VmHWM (ru_maxrss would count the parent's at fork)."""
    peak = _status_kib("VmHWM")
    return (peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def _imported(timings: dict, start: float, **versions: str) -> None:
    """Records the import time, the versions and the resident memory after the imports."""
    timings["import_s"] = time.perf_counter() - start
    timings["versions"] = versions
    timings["rss_mib"] = {"imports": _status_kib("VmRSS") / 1024}


def _trimmed_rss_mib() -> float | None:
    """Resident memory after glibc's malloc_trim (freed heap given back to the system), or None."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _status_kib("VmRSS") / 1024


class _Clock:
    """Times one call: its start, the time of each new token, the first row's tokens."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[float] = []
        self.tokens: list[int] = []

    def token(self, first_row: int) -> None:
        self.marks.append(time.perf_counter())
        self.tokens.append(int(first_row))

    def result(self, batch: int) -> dict:
        decode = self.marks[-1] - self.marks[0] if len(self.marks) > 1 else float("nan")
        return {
            "ttft_s": self.marks[0] - self.start,
            "first_token_wall": self.marks[0] + _OFFSET,
            "decode_s": decode,
            "new": len(self.marks),
            "tokens_per_s": batch * (len(self.marks) - 1) / decode if decode > 0 else None,
            # the whole call, prompt included: all new tokens over the time to the last one
            "call_tokens_per_s": batch * len(self.marks) / (self.marks[-1] - self.start),
            "tokens": self.tokens,
        }


def _jax(job: dict, timings: dict):
    """transmuter_jax: generation.generate on a context compiled for the batch."""
    start = time.perf_counter()
    import jax
    import jax.monitoring

    import transmuter_jax as tj
    from transmuter_jax import generation

    _imported(timings, start, transmuter_jax=tj.__version__, jax=jax.__version__)
    events = timings["jax_events"] = {}  # compile phases (seconds) and cache hits (counts)

    def add(name, value=1, **_):
        events[name.rsplit("/", 1)[-1]] = events.get(name.rsplit("/", 1)[-1], 0) + value

    jax.monitoring.register_event_duration_secs_listener(add)
    jax.monitoring.register_event_listener(add)
    start = time.perf_counter()
    model = tj.load(os.path.join(job["folder"], job["file"]))
    timings["load_s"] = time.perf_counter() - start
    timings["rss_mib"]["load"] = _status_kib("VmRSS") / 1024
    start = time.perf_counter()
    options = dict(max_new_tokens=job["new"], min_new_tokens=job["new"], do_sample=False)
    if job.get("decode_steps"):
        options["decode_steps"] = job["decode_steps"]
    ctx = generation.context(job["folder"], model, **options)
    ctx = generation.compile(ctx, job["batch"])
    timings["context_s"] = time.perf_counter() - start
    cache = getattr(tj, "compile_cache", None)
    timings["compile_cache"] = cache.directory() if cache is not None else "not implemented"
    prompts = [job["prompt"]] * job["batch"]
    seeds = list(range(job["batch"]))

    def run(stop: int) -> dict:
        clock = _Clock()

        def on_token(event):
            if event["token"][0] < 0:  # a step of the prompt
                return
            clock.token(event["token"][0])
            if len(clock.marks) == stop:
                raise _Stop

        try:
            generation.generate(ctx, prompts, seeds, on_token=on_token)
        except _Stop:
            pass
        return clock.result(job["batch"])

    def details() -> dict:
        nonlocal ctx
        params = sum(a.nbytes for a in jax.tree_util.tree_leaves(model.params))
        live = sum(a.nbytes for a in jax.live_arrays())
        figures = {
            "compiled_shapes": ctx.compiled.shapes,
            "decode_steps": ctx.options.decode_steps if generation.on_device(ctx) else 1,
            "params_mib": params / 2**20,
            "live_arrays_mib": live / 2**20,
        }
        # What the loaded programs hold: the resident memory that dropping the context and
        # jax's compiled programs gives back (the weights stay, held by ``model``).
        before = _trimmed_rss_mib()
        ctx = None
        gc.collect()
        jax.clear_caches()
        gc.collect()
        after = _trimmed_rss_mib()
        figures["programs_held_mib"] = before - after if before and after else None
        return figures

    return run, details


def _ort(job: dict, timings: dict):
    """onnxruntime: InferenceSession on the same file, a Python loop feeding presents back.

    Outputs stay in onnxruntime's memory (IOBinding): each step's presents are bound as the
    next step's pasts without a copy, and only the logits are copied out.
    """
    start = time.perf_counter()
    import numpy as np
    import onnxruntime as ort

    _imported(timings, start, onnxruntime=ort.__version__)
    start = time.perf_counter()
    options = ort.SessionOptions()
    options.intra_op_num_threads = job["threads"]
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    spin = "1" if job.get("spinning", True) else "0"  # off helps when other processes compete
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    if job.get("ort_profile"):  # onnxruntime's profiler: a file with this prefix
        options.enable_profiling = True
        options.profile_file_prefix = job["ort_profile"]
    path = os.path.join(job["folder"], job["file"])
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    timings["load_s"] = time.perf_counter() - start
    timings["rss_mib"]["load"] = _status_kib("VmRSS") / 1024
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    pasts = {}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values"):
            _, heads, _, size = value.shape  # symbolic in the genai exports: from config.json
            heads = heads if isinstance(heads, int) else job["kv_heads"]
            size = size if isinstance(size, int) else job["head_size"]
            output = value.name.replace("past_key_values", "present")
            pasts[value.name] = (output, heads, size, types[value.type])
    names = {value.name for value in session.get_inputs()}
    eos = np.asarray(job["eos"], np.int64)
    batch = job["batch"]

    def run(stop: int) -> dict:
        clock = _Clock()
        binding = session.io_binding()
        ids = np.array([job["prompt"]] * batch, np.int64)
        empty = {n: np.zeros((batch, h, 0, s), t) for n, (_, h, s, t) in pasts.items()}
        for name, value in empty.items():  # bound arrays are not copied: keep them alive
            binding.bind_cpu_input(name, value)
        total = 0
        for _ in range(job["new"]):
            step = ids.shape[1]
            feeds = {"input_ids": ids, "attention_mask": np.ones((batch, total + step), np.int64)}
            if "position_ids" in names:
                positions = np.arange(total, total + step, dtype=np.int64)
                feeds["position_ids"] = np.ascontiguousarray(np.broadcast_to(positions, ids.shape))
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            binding.bind_output("logits")
            for output, *_ in pasts.values():
                binding.bind_output(output)
            session.run_with_iobinding(binding)
            outputs = dict(zip(session.get_outputs(), binding.get_outputs(), strict=True))
            outputs = {value.name: result for value, result in outputs.items()}
            logits = outputs["logits"].numpy()[:, -1]
            logits[:, eos] = -np.inf  # min_new_tokens: no eos before the last token
            ids = logits.argmax(-1)[:, None].astype(np.int64)
            binding = session.io_binding()
            for name, (output, *_) in pasts.items():
                binding.bind_ortvalue_input(name, outputs[output])
            total += step
            clock.token(ids[0, 0])
            if len(clock.marks) == stop:
                break
        return clock.result(batch)

    def details() -> dict:
        return {"profile_file": session.end_profiling()} if job.get("ort_profile") else {}

    return run, details


def _genai(job: dict, timings: dict):
    """onnxruntime-genai: its own Generator, intra_op_num_threads set to the cores."""
    start = time.perf_counter()
    import numpy as np
    import onnxruntime_genai as og

    _imported(timings, start, onnxruntime_genai=og.__version__)
    start = time.perf_counter()
    config = og.Config(job["folder"])
    threads = {"intra_op_num_threads": job["threads"]}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
    model = og.Model(config)
    timings["load_s"] = time.perf_counter() - start
    timings["rss_mib"]["load"] = _status_kib("VmRSS") / 1024
    batch, prompt = job["batch"], job["prompt"]
    length = len(prompt) + job["new"]

    def run(stop: int) -> dict:
        clock = _Clock()
        params = og.GeneratorParams(model)
        params.set_search_options(
            max_length=length, min_length=length, do_sample=False, batch_size=batch
        )
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt] * batch, np.int32))
        while not generator.is_done():
            generator.generate_next_token()
            clock.token(generator.get_next_tokens()[0])
            if len(clock.marks) == stop:
                break
        return clock.result(batch)

    return run, dict


def _torch(job: dict, timings: dict):
    """transformers: the PyTorch model's generate (sdpa attention, dynamic cache)."""
    start = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    _imported(timings, start, torch=torch.__version__, transformers=transformers.__version__)
    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.float32).eval()
    timings["load_s"] = time.perf_counter() - start
    timings["rss_mib"]["load"] = _status_kib("VmRSS") / 1024
    batch, new = job["batch"], job["new"]
    ids = torch.tensor([job["prompt"]] * batch)

    class Streamer(BaseStreamer):
        def __init__(self, clock: _Clock, stop: int):
            self.clock, self.stop, self.prompt_seen = clock, stop, False

        def put(self, value):
            if not self.prompt_seen:  # generate's first put is the prompt
                self.prompt_seen = True
                return
            self.clock.token(value.reshape(-1)[0])
            if len(self.clock.marks) == self.stop:
                raise _Stop

        def end(self):
            pass

    def run(stop: int) -> dict:
        clock = _Clock()
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        with torch.inference_mode():
            try:
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    streamer=Streamer(clock, stop),
                    **options,
                )
            except _Stop:
                pass
        return clock.result(batch)

    return run, dict


PEERS = {"jax": _jax, "ort": _ort, "genai": _genai, "torch": _torch}


def main(job: dict) -> dict:
    """Runs the job: the cold first call, then the warm calls; returns the figures."""
    timings: dict = {}
    run, details = PEERS[job["peer"]](job, timings)
    first = run(1 if job["first_only"] else min(job.get("warmup", 8), job["new"]))
    timings["rss_mib"]["first_call"] = _status_kib("VmRSS") / 1024
    timings["peak_before_mib"] = _peak_mib()  # loading, compiling and the first call
    result = {
        "cold_ttft_s": first["first_token_wall"] - job["launch"],
        "cold_in_process_s": first["first_token_wall"] - _OFFSET - _START,
        "cold_first_call_ttft_s": first["ttft_s"],
        **json.loads(json.dumps(timings)),  # a copy: the warm calls add events
    }
    if job["first_only"]:
        return result
    reset = _reset_peak()
    runs = [run(0) for _ in range(job["repeats"])]
    best = max(runs, key=lambda r: r["tokens_per_s"] or 0)
    result.update(
        tokens_per_s=best["tokens_per_s"],
        call_tokens_per_s=max(r["call_tokens_per_s"] for r in runs),
        ttft_s=min(r["ttft_s"] for r in runs),
        runs_tokens_per_s=[r["tokens_per_s"] for r in runs],
        new=best["new"],
        tokens=best["tokens"],
        peak_generating_mib=_status_kib("VmHWM") / 1024 if reset else None,
        peak_process_mib=max(_peak_mib(), timings["peak_before_mib"]),
        rss_after_trim_mib=_trimmed_rss_mib(),  # after the peaks: a diagnostic only
        threads=job["threads"],
        **details(),
    )
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
