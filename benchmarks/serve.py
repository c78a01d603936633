"""A load generator for `transmuter-jax serve`, in the style of `vllm bench serve`.

In one run, it starts the server on 127.0.0.1 (a free port) with the slots
(--max-batch-size 8: continuous batching) and with one slot (--max-batch-size 1: one request
at a time), sends streamed chat requests with the `openai` async client at fixed concurrencies
1, 4 and 8 and at Poisson arrival rates, and reports request and output-token throughput and
the mean, p50 and p99 of the time to the first token (TTFT), time per output token (TPOT),
inter-token latency (ITL) and end-to-end latency. Then a multi-turn chat workload (a shared
system prompt, several conversations of several turns) against the server with its prefix
cache and with --prefix-cache-bytes 0 gives the TTFT of the later turns with and without it.
With --genai-path, onnxruntime-genai 0.18's `Engine` runs the same schedule on the default
model's genai export (benchmarks/genai_engine.py, no HTTP in between); on a CPU only its static
batching runs (its continuous batching needs PagedAttention, which its builder writes for CUDA
and WebGPU only), and the run records why. Every run is bounded (--requests per workload); the
servers stop at the end. Writes a JSON and
a plot (with matplotlib, the 'bench' extra) to benchmarks/results/.

    python benchmarks/serve.py                                  # the default model
    python benchmarks/serve.py --model tests/fixtures/llama-optimum \\
        --chat-template '{% for m in messages %}{{ m.content }}{% endfor %}' --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = [
    "What is the capital of France?",
    "Tell me a short joke about computers.",
    "Explain why the sky is blue in two sentences.",
    "Name three fruits that are red.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
    "What does a compiler do?",
]
SYSTEM = (
    "You are a helpful travel assistant for a small company that organises walking holidays in "
    "the mountains and along the coast. Answer in plain words, in at most three sentences, and "
    "always suggest one practical tip: what to pack, when to start, or how to stay safe. If a "
    "question is not about travel, say so politely and offer to help with a trip instead. The "
    "company's trips last from three to ten days; groups have at most twelve walkers and one "
    "guide; luggage is carried between hotels by van."
)
TURNS = [
    "I want to walk for a week in May. Where should I go?",
    "What should I pack for that?",
    "How fit do I need to be?",
    "Can I bring my dog?",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args: argparse.Namespace, batch: int, *extra: str):
    port = _port()
    cmd = [
        sys.executable,
        "-m",
        "transmuter_jax",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-batch-size",
        str(batch),
        "--max-queue",
        "1024",
    ]
    if args.model:
        cmd.insert(4, args.model)
    if args.chat_template:
        cmd += ["--chat-template", args.chat_template]
    cmd += ["--max-model-len", str(args.max_model_len), *extra]
    if args.decode_steps:
        cmd += ["--decode-steps", str(args.decode_steps)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not start")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _one(client, prompt: str | list, max_tokens: int) -> dict:
    start = time.perf_counter()
    times, text = [], []
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    stream = await client.chat.completions.create(
        model="bench",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    ttft = (times[0] - start) if times else end - start
    itl = list(np.diff(times)) if len(times) > 1 else []
    tpot = (end - times[0]) / (tokens - 1) if tokens > 1 and times else 0.0
    return {
        "ttft": ttft,
        "itl": itl,
        "tpot": tpot,
        "latency": end - start,
        "tokens": tokens,
        "text": "".join(text),
    }


async def _workload(url: str, requests: int, max_tokens: int, concurrency=None, rate=None):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    gate = asyncio.Semaphore(concurrency or requests)
    rng = random.Random(0)

    async def send(i):
        async with gate:
            return await _one(client, PROMPTS[i % len(PROMPTS)], max_tokens)

    start = time.perf_counter()
    tasks = []
    for i in range(requests):
        tasks.append(asyncio.ensure_future(send(i)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    out = await asyncio.gather(*tasks)
    took = time.perf_counter() - start
    await client.close()
    return _summary(out, took)


def genai_engine(args: argparse.Namespace, kind: str, value: float, mode: str = "static") -> dict:
    """onnxruntime-genai's Engine (benchmarks/genai_engine.py, in its own process) on the
    default model's genai export, the same schedule: the summary, or {"error": why}."""
    from transmuter_jax import default

    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "genai_engine.py"),
        str(default.path("genai-fp32", auto_prepare=False)), "--genai-path", args.genai_path,
        "--load", f"{kind}:{value}", "--requests", str(args.requests),
        "--max-tokens", str(args.max_tokens), "--batch", "8", "--mode", mode,
        "--max-length", str(args.max_model_len), "--prompts", json.dumps(PROMPTS),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as error:
        return {"error": f"the harness gave no result ({type(error).__name__})"}
    if "error" in out:
        return out
    runs = []
    for r in out["records"]:
        times = r["times"]
        tokens = len(times)
        runs.append({
            "ttft": (times[0] if times else r["end"]) - r["arrival"],
            "itl": list(np.diff(times)),
            "tpot": (r["end"] - times[0]) / (tokens - 1) if tokens > 1 else 0.0,
            "latency": r["end"] - r["arrival"],
            "tokens": tokens,
        })  # fmt: skip
    summary = _summary(runs, out["seconds"])
    summary.update(genai_version=out["version"], genai_mode=out["mode"],
                   genai_max_batch_size=out["max_batch_size"])  # fmt: skip
    return summary


def _stats(values) -> dict:
    if not len(values):
        return {"mean": None, "p50": None, "p99": None}
    v = np.asarray(values) * 1000
    return {
        "mean": float(v.mean()),
        "p50": float(np.percentile(v, 50)),
        "p99": float(np.percentile(v, 99)),
    }


def _summary(out: list[dict], took: float) -> dict:
    tokens = sum(o["tokens"] for o in out)
    return {
        "requests": len(out),
        "seconds": took,
        "request_throughput": len(out) / took,
        "output_throughput": tokens / took,
        "ttft_ms": _stats([o["ttft"] for o in out]),
        "tpot_ms": _stats([o["tpot"] for o in out if o["tpot"]]),
        "itl_ms": _stats([x for o in out for x in o["itl"]]),
        "latency_ms": _stats([o["latency"] for o in out]),
    }


async def _chats(url: str, conversations: int, max_tokens: int, system: str = SYSTEM) -> dict:
    """``conversations`` chats at once, each of len(TURNS) turns after the shared system prompt;
    the TTFT of the first turns and of the later ones (whose prompts start with the last)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def chat(c: int) -> list[dict]:
        history = [{"role": "system", "content": system}]
        out = []
        for t, turn in enumerate(TURNS):
            history.append({"role": "user", "content": f"{turn} (trip {c})"})
            one = await _one(client, list(history), max_tokens)
            one["turn"] = t
            history.append({"role": "assistant", "content": one["text"]})
            out.append(one)
        return out

    start = time.perf_counter()
    results = [o for chat_ in await asyncio.gather(*(chat(c) for c in range(conversations)))
               for o in chat_]  # fmt: skip
    took = time.perf_counter() - start
    await client.close()
    summary = _summary(results, took)
    summary["ttft_first_turn_ms"] = _stats([o["ttft"] for o in results if o["turn"] == 0])
    summary["ttft_later_turns_ms"] = _stats([o["ttft"] for o in results if o["turn"] > 0])
    return summary


def _metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("transmuter_jax_prefix_cache_"):
            name, value = line.split()
            out[name.removeprefix("transmuter_jax_prefix_cache_")] = float(value)
    return out


def _print(label: str, summary: dict) -> None:
    print(
        f"{label}: {summary['output_throughput']:.1f} tok/s, "
        f"{summary['request_throughput']:.2f} req/s, "
        f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms p99 {summary['ttft_ms']['p99']:.0f} ms, "
        f"TPOT p50 {summary['tpot_ms']['p50'] or 0:.1f} ms, "
        f"ITL p50 {summary['itl_ms']['p50'] or 0:.1f} ms",
        flush=True,
    )


def _warm(url: str, batch: int, max_tokens: int, system: str) -> None:
    """Compiles what the measured runs need (prompt blocks, decode chunks, chat turns)."""
    asyncio.run(_workload(url, batch, max_tokens, concurrency=batch))
    asyncio.run(_chats(url, 1, 4, "A warm-up. " + system))


def plot(results: dict, path: pathlib.Path) -> None:
    """Output throughput and TTFT p50/p99 of each load, slots against one at a time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if ("concurrency" in r or "rate" in r) and "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    series = (
        ("slots (8)", "tab:blue", lambda r: r.get("max_batch_size") == 8),
        ("one at a time", "tab:gray", lambda r: r.get("max_batch_size") == 1),
        ("genai Engine (static, 8)", "tab:orange", lambda r: bool(r.get("engine"))),
    )
    for k, (name, color, chosen) in enumerate(series):
        mine = [r for r in runs if chosen(r)]
        if not mine:
            continue
        labels = [f"c{r['concurrency']}" if "concurrency" in r else f"{r['rate']}/s" for r in mine]
        x = np.arange(len(mine)) + 0.27 * (k - 1)
        a.bar(x, [r["output_throughput"] for r in mine], 0.27, color=color, label=name)
        b.bar(x, [r["ttft_ms"]["p50"] for r in mine], 0.27, color=color, label=f"{name} p50")
        b.scatter(x, [r["ttft_ms"]["p99"] for r in mine], color="k", marker="_", s=120)
        a.set_xticks(np.arange(len(mine)), labels)
        b.set_xticks(np.arange(len(mine)), labels)
    a.set_ylabel("output tokens/s")
    b.set_ylabel("TTFT ms (bar p50, dash p99)")
    b.set_yscale("log")
    a.legend()
    a.set_title(f"transmuter-jax serve, {results['model']} ({results['load']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="MODEL for serve (default: the default model)")
    parser.add_argument("--chat-template", help="passed to serve")
    parser.add_argument("--requests", type=int, default=24, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024, help="passed to serve")
    parser.add_argument("--decode-steps", type=int, help="passed to serve")
    parser.add_argument("--batch-sizes", default="8,1", help="--max-batch-size of each server")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--rates", default="1,4", help="Poisson request rates (requests/s)")
    parser.add_argument(
        "--conversations",
        type=int,
        default=4,
        help="multi-turn chats at once (0: no multi-turn workload)",
    )
    parser.add_argument("--system", default=SYSTEM, help="the multi-turn chats' system prompt")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument(
        "--genai-path",
        help="a folder holding onnxruntime_genai 0.18 (pip install --target): its Engine runs "
        "the same schedule on the default model's genai export (benchmarks/genai_engine.py)",
    )
    args = parser.parse_args()
    results = {
        "model": args.model or "default",
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "cpu": _cpu(),
        "load": f"load average {os.getloadavg()[0]:.1f} at the start",
        "runs": [],
    }
    loads = [("concurrency", int(c)) for c in args.concurrency.split(",")]
    loads += [("rate", float(r)) for r in args.rates.split(",") if r]
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        with server(args, batch) as url:
            _warm(url, batch, args.max_tokens, args.system)
            for kind, value in loads:
                kw = {"concurrency": value} if kind == "concurrency" else {"rate": value}
                summary = asyncio.run(_workload(url, args.requests, args.max_tokens, **kw))
                summary.update(max_batch_size=batch, load=os.getloadavg()[0], **{kind: value})
                results["runs"].append(summary)
                _print(f"batch {batch} {kind} {value}", summary)
    if args.genai_path and not args.model:
        tried = genai_engine(args, "concurrency", 8, "dynamic")
        results["genai_dynamic_batching"] = tried.get("error", "ran")
        print(f"onnxruntime-genai Engine, dynamic batching: {results['genai_dynamic_batching']}")
        for kind, value in loads:
            summary = genai_engine(args, kind, value)
            summary.update(engine="onnxruntime-genai", load=os.getloadavg()[0], **{kind: value})
            results["runs"].append(summary)
            if "error" in summary:
                print(f"onnxruntime-genai Engine {kind} {value}: {summary['error']}", flush=True)
            else:
                _print(f"genai Engine (static, 8) {kind} {value}", summary)
    else:
        results["genai"] = "not run: give --genai-path (a folder holding onnxruntime_genai 0.18)"
    chats = (("prefix cache", ()), ("no prefix cache", ("--prefix-cache-bytes", "0")))
    for label, extra in chats if args.conversations else ():
        with server(args, 8, *extra) as url:
            _warm(url, 8, args.max_tokens, args.system)
            before = _metrics(url)
            summary = asyncio.run(_chats(url, args.conversations, args.max_tokens, args.system))
            after = _metrics(url)
            summary.update(multi_turn=label, load=os.getloadavg()[0])
            if after:
                hits = after["hits"] - before.get("hits", 0)
                queries = after["queries"] - before.get("queries", 0)
                summary["prefix_hit_rate"] = hits / max(queries, 1)
            results["runs"].append(summary)
            _print(f"multi-turn, {label}", summary)
            print(
                f"  TTFT first turns p50 {summary['ttft_first_turn_ms']['p50']:.0f} ms, "
                f"later turns p50 {summary['ttft_later_turns_ms']['p50']:.0f} ms "
                f"p99 {summary['ttft_later_turns_ms']['p99']:.0f} ms, "
                f"hit rate {summary.get('prefix_hit_rate', 0):.2f}",
                flush=True,
            )
    _ratios(results)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"serve-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(results, indent=1))
    png = out / "serve.png"
    try:
        plot(results, png)
    except ImportError as error:
        png = f"not written ({error}: pip install -e '.[bench]')"
    print(f"wrote {path}\nplot {png}")
    return 0


def _ratios(results: dict) -> None:
    """The goal's figures: output throughput at concurrency 8 against one at a time (the
    one-slot server at concurrency 1), and p99 / p50 TTFT at concurrency 8."""
    runs = results["runs"]
    pick = lambda b, c: next(  # noqa: E731
        (r for r in runs if r.get("max_batch_size") == b and r.get("concurrency") == c), None
    )
    slots, alone = pick(8, 8), pick(1, 1)
    if slots and alone:
        ratio = slots["output_throughput"] / alone["output_throughput"]
        spread = slots["ttft_ms"]["p99"] / slots["ttft_ms"]["p50"]
        results["goal"] = {"throughput_ratio_c8": ratio, "ttft_p99_over_p50_c8": spread}
        print(
            f"concurrency 8: {ratio:.2f}x the output throughput of one at a time (goal 2.5x); "
            f"TTFT p99/p50 {spread:.2f} (goal < 2)"
        )
    genai = next((r for r in runs if r.get("engine") and r.get("concurrency") == 8), None)
    if slots and genai and "error" not in genai:
        ratio = slots["output_throughput"] / genai["output_throughput"]
        results["goal"]["throughput_vs_genai_engine_c8"] = ratio
        print(f"concurrency 8: {ratio:.2f}x the output throughput of onnxruntime-genai's Engine")
    chats = {r["multi_turn"]: r for r in runs if "multi_turn" in r}
    if len(chats) == 2:
        on, off = chats["prefix cache"], chats["no prefix cache"]
        ratio = on["ttft_later_turns_ms"]["p50"] / off["ttft_later_turns_ms"]["p50"]
        results["prefix_cache_ttft_ratio"] = ratio
        print(f"multi-turn later turns: TTFT p50 with the cache / without = {ratio:.2f}")


def _cpu() -> str:
    try:
        text_ = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in text_.splitlines()
                 if ln.startswith("model name")), "unknown")  # fmt: skip
    flags = next((ln for ln in text_.splitlines() if ln.startswith("flags")), "")
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name}, {isa}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
