"""The engine on the default model (genai fp32 export): warm time to the first token of a ~40 and a
~300-token chat prompt with the bucket and the power-of-two prompt rules and onnxruntime-genai's
Generator; decode tokens/s of generate() and of the slots; and a Poisson stream of requests
through the slots against the same requests sent one at a time to generate().

Usage: python benchmarks/engine.py [--genai-path DIR] [--requests 32] [--new 64] [--rates 1,4]
           [--out benchmarks/results] [--ttft-only]

--genai-path: a folder holding onnxruntime_genai (``pip install --target DIR
onnxruntime-genai==0.18.0``), put first on the path of the genai worker. Figures are the best of
a few warm calls, in one run; the machine may be shared, so compare ratios of one run only
(``ttft_interleaved_s``: ours and the Generator taking turns, so that both see the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
LONG_TEXT = (
    "The history of the printing press begins with movable type in East Asia and continues "
    "with Gutenberg's press in Mainz around 1440, which spread across Europe within decades. "
)
LONG = [{"role": "user", "content": LONG_TEXT * 6 + "Summarize this in two sentences."}]


def _genai_worker(folder: str, prompts: list[list[int]], repeats: int) -> list[float]:
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.clear_providers()
    model = og.Model(config)
    best = []
    for prompt in prompts:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(prompt) + 1, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(np.array([prompt], np.int32))
            generator.generate_next_token()
            generator.get_next_tokens()
            times.append(time.perf_counter() - start)
        best.append(min(times[1:]))
    return best


def _genai_serve(folder: str, prompts: list[list[int]]) -> None:
    """Reads prompt indexes from stdin, one a line, and prints the time to the first token of
    each (warm: each prompt runs once first)."""
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.clear_providers()
    threads = {"intra_op_num_threads": os.cpu_count()}  # as many threads as ours (it runs one)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
    model = og.Model(config)

    def once(prompt):
        start = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt], np.int32))
        generator.generate_next_token()
        generator.get_next_tokens()
        return time.perf_counter() - start

    for prompt in prompts:
        once(prompt)
    print(json.dumps(["ready", og.__version__]), flush=True)
    for line in sys.stdin:
        print(json.dumps(once(prompts[int(line)])), flush=True)


# A pause before each timed call of the interleaved runs: onnxruntime's threads spin after a call
# and ours briefly too, so that neither side's spinning runs during the other's call.
PAUSE_S = 0.05


def interleaved_ttft(engine, prompts: dict, folder: str, path: str | None, repeats: int) -> dict:
    """Warm time to the first token of ours and of onnxruntime-genai's Generator (in its own
    process), the two taking turns, so that both see the same load: the best of ``repeats``."""
    from transmuter_jax import generation

    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    here = os.path.join(ROOT, "benchmarks")
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); from engine import _genai_serve; "
        "a = json.loads(sys.stdin.readline()); _genai_serve(a[0], a[1])"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    worker.stdin.write(json.dumps([folder, list(prompts.values())]) + "\n")
    worker.stdin.flush()
    ready = worker.stdout.readline()
    if not ready:
        return {"genai_skipped": "the onnxruntime-genai worker did not start"}
    version = json.loads(ready)[1]
    ours = {name: [] for name in prompts}
    theirs = {name: [] for name in prompts}
    for prompt in prompts.values():
        generation.generate(engine, [prompt], [0])  # warm
    for _ in range(repeats):
        for i, (name, prompt) in enumerate(prompts.items()):
            time.sleep(PAUSE_S)
            start = time.perf_counter()
            generation.generate(engine, [prompt], [0])
            ours[name].append(time.perf_counter() - start)
            time.sleep(PAUSE_S)
            worker.stdin.write(f"{i}\n")
            worker.stdin.flush()
            theirs[name].append(json.loads(worker.stdout.readline()))
    worker.stdin.close()
    worker.wait()
    out: dict = {"genai_version": version}
    for name in prompts:
        out[f"jax {name}"], out[f"genai {name}"] = min(ours[name]), min(theirs[name])
        out[f"ratio {name}"] = min(ours[name]) / min(theirs[name])
    return out


def genai_ttft(folder: str, prompts: list[list[int]], path: str | None, repeats: int):
    """onnxruntime-genai's warm time to the first token of each prompt, in its own process."""
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    here = os.path.join(ROOT, "benchmarks")
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); from engine import _genai_worker; "
        "import onnxruntime_genai as og; a = json.load(sys.stdin); "
        "print(json.dumps([og.__version__, _genai_worker(a[0], a[1], a[2])]))"
    )
    job = json.dumps([folder, prompts, repeats])
    done = subprocess.run(
        [sys.executable, "-c", code], input=job, capture_output=True, text=True, env=env
    )
    if done.returncode:
        return None, done.stderr.strip().splitlines()[-1:]
    version, times = json.loads(done.stdout.strip().splitlines()[-1])
    return version, times


def best_of(fn, repeats: int) -> float:
    fn()  # warm: compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--genai-path", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rates", default="1,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument(
        "--ttft-only", action="store_true", help="only the times to first token taking turns"
    )
    args = parser.parse_args(argv)

    from transmuter_jax import default, generation, hub, text
    from transmuter_jax.onnx.model import load

    folder = str(default.path("genai-fp32"))
    pipe = text.generation(folder)
    prompts = {"short": pipe.prompt_ids(SHORT), "long": pipe.prompt_ids(LONG)}
    model = load(hub.files(folder).decoder)
    figures: dict = {"prompts": {k: len(v) for k, v in prompts.items()}, "ttft_s": {}}

    # -- warm time to the first token ------------------------------------------------------------
    for rule in () if args.ttft_only else generation.PREFILLS:
        spec = generation.context(folder, model, max_new_tokens=1, prefill=rule)
        engine = generation.compile(spec, 1)
        for name, prompt in prompts.items():
            seconds = best_of(
                lambda e=engine, p=prompt: generation.generate(e, [p], [0]), args.repeats
            )
            figures["ttft_s"][f"jax {rule} {name}"] = seconds
        figures[f"shapes {rule}"] = engine.compiled.shapes
    version, times = (
        (None, "--ttft-only")
        if args.ttft_only
        else genai_ttft(folder, list(prompts.values()), args.genai_path, args.repeats)
    )
    if version is not None:
        figures["genai_version"] = version
        for name, seconds in zip(prompts, times, strict=True):
            figures["ttft_s"][f"genai {name}"] = seconds
    else:
        figures["genai_skipped"] = times

    # -- the same, taking turns with onnxruntime-genai ------------------------------------------
    spec = generation.context(folder, model, max_new_tokens=1)
    figures["ttft_interleaved_s"] = interleaved_ttft(
        generation.compile(spec, 1), prompts, folder, args.genai_path, 2 * args.repeats
    )
    if args.ttft_only:
        return _write(figures, args.out)

    # -- decode tokens/s, batch 1 ----------------------------------------------------------------
    spec = generation.context(folder, model, max_new_tokens=args.new, eos_token_id=[])
    single = generation.compile(spec, 1)
    prompt = prompts["short"]
    whole = best_of(lambda: generation.generate(single, [prompt], [0]), args.repeats)
    first = figures["ttft_s"]["jax buckets short"]
    figures["decode_tok_s generate b1"] = (args.new - 1) / max(whole - first, 1e-9)
    slots = generation.compile(spec, args.batch, capacity=512, top_logprobs=0)
    for batch, engine in ((1, generation.compile(spec, 1, capacity=512)), (args.batch, slots)):

        def slot_run(engine=engine):
            state = engine.init_state()
            request = generation.Request(prompt, eos_token_id=())
            state = engine.insert(engine.prefill(request), state, 0)
            while state.live_slots:
                state, _ = engine.generate(state, 16)

        whole = best_of(slot_run, args.repeats)
        figures[f"decode_tok_s slots of {batch}, one live"] = (args.new - 1) / max(
            whole - first, 1e-9
        )

    # -- a Poisson stream ----------------------------------------------------------------------
    if not args.rates:
        return _write(figures, args.out)
    rng = np.random.default_rng(0)
    figures["stream"] = []
    stream_prompts = [prompts["short"] if i % 3 else prompts["long"] for i in range(args.requests)]
    warm = np.zeros(2)  # compiles the stream's shapes first (both prompts, the batch's chunk)
    _stream_slots(slots, [prompts["short"], prompts["long"]], warm, 4)
    _stream_sequential(single, [prompts["short"], prompts["long"]], warm, 4)
    for rate in [float(r) for r in args.rates.split(",")]:
        arrivals = np.cumsum(rng.exponential(1 / rate, args.requests))
        for how in ("slots", "one at a time"):
            run = _stream_slots if how == "slots" else _stream_sequential
            engine = slots if how == "slots" else single
            stats = run(engine, stream_prompts, arrivals, args.new)
            figures["stream"].append({"rate": rate, "how": how, **stats})
            print(rate, how, stats, flush=True)
    return _write(figures, args.out)


def _write(figures: dict, out: str) -> int:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"engine-{time.strftime('%Y-%m-%d')}.json")
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)
    print(json.dumps(figures, indent=1))
    return 0


def _summary(start, arrivals, first, gaps, end) -> dict:
    """requests/s, and p50/p99 of the time to the first token and of each request's mean time
    between tokens (``gaps``: per request, (first token, last token, tokens)); tokens of a
    decode chunk arrive together, so the mean over a request is the figure that means something."""
    ttft = np.array(first) - arrivals
    gaps = np.array([(b - a) / max(n - 1, 1) for a, b, n in gaps])
    return {
        "requests_per_s": len(arrivals) / (end - start - arrivals[0]),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "itl_p50_s": float(np.percentile(gaps, 50)),
        "itl_p99_s": float(np.percentile(gaps, 99)),
    }


def _stream_slots(engine, prompts, arrivals, new) -> dict:
    from transmuter_jax import generation

    state = engine.init_state()
    start = time.perf_counter()
    waiting = list(range(len(prompts)))
    first = [0.0] * len(prompts)
    last: dict = {}
    count: dict = {}
    owner: dict = {}
    while waiting or state.live_slots:
        now = time.perf_counter() - start
        while waiting and arrivals[waiting[0]] <= now and state.free_slots:
            i = waiting.pop(0)
            request = generation.Request(prompts[i], max_new_tokens=new, eos_token_id=())
            slot = state.free_slots[0]
            state = engine.insert(engine.prefill(request), state, slot)
            owner[slot] = i
            first[i] = last[i] = time.perf_counter() - start
            count[i] = 1
        if not state.live_slots:
            time.sleep(max(0.0, arrivals[waiting[0]] - now))
            continue
        state, tokens = engine.generate(state, 4)
        t = time.perf_counter() - start
        for token in tokens:
            i = owner[token.slot]
            last[i], count[i] = t, count[i] + 1
    gaps = [(first[i], last[i], count[i]) for i in range(len(prompts))]
    return _summary(start, arrivals, first, gaps, time.perf_counter())


def _stream_sequential(engine, prompts, arrivals, new) -> dict:
    from transmuter_jax import generation

    start = time.perf_counter()
    first = [0.0] * len(prompts)
    gaps: list = []
    for i, prompt in enumerate(prompts):
        now = time.perf_counter() - start
        if arrivals[i] > now:
            time.sleep(arrivals[i] - now)
        seen = {"last": None, "n": 0}

        def on_token(event, i=i, seen=seen):
            t = time.perf_counter() - start
            if seen["last"] is None:
                first[i] = t
            seen["last"], seen["n"] = t, seen["n"] + 1

        generation.generate(engine, [prompt], [0], on_token=on_token)
        gaps.append((first[i], seen["last"], seen["n"]))
    del new
    return _summary(start, arrivals, first, gaps, time.perf_counter())


if __name__ == "__main__":
    sys.exit(main())
