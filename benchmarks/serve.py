"""A load generator for `transmuter-jax serve`, in the style of `vllm bench serve`.

Starts the server on 127.0.0.1 (a free port) for each --max-batch-size given, sends chat
requests with the `openai` async client at fixed concurrencies and at Poisson arrival rates, and
reports request and output-token throughput and the mean, p50 and p99 of the time to the first
token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency.
Every run is bounded (--requests per workload); the servers stop at the end. Writes a JSON to
benchmarks/results/.

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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args: argparse.Namespace, batch: int):
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


async def _one(client, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    times = []
    stream = await client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    ttft = (times[0] - start) if times else end - start
    itl = list(np.diff(times)) if len(times) > 1 else []
    tpot = (end - times[0]) / (tokens - 1) if tokens > 1 and times else 0.0
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "latency": end - start, "tokens": tokens}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="MODEL for serve (default: the default model)")
    parser.add_argument("--chat-template", help="passed to serve")
    parser.add_argument("--requests", type=int, default=32, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="8,1", help="--max-batch-size of each server")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--rates", default="2,8", help="Poisson request rates (requests/s)")
    args = parser.parse_args()
    results = {"model": args.model or "default", "max_tokens": args.max_tokens, "runs": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        with server(args, batch) as url:
            for warm in range(1, batch + 1):  # compile every batch shape before measuring
                asyncio.run(_workload(url, warm, args.max_tokens, concurrency=warm))
            loads = [("concurrency", int(c)) for c in args.concurrency.split(",")]
            loads += [("rate", float(r)) for r in args.rates.split(",") if r]
            for kind, value in loads:
                kw = {"concurrency": value} if kind == "concurrency" else {"rate": value}
                summary = asyncio.run(_workload(url, args.requests, args.max_tokens, **kw))
                summary.update(max_batch_size=batch, **{kind: value})
                results["runs"].append(summary)
                print(
                    f"batch {batch} {kind} {value}: {summary['output_throughput']:.1f} tok/s, "
                    f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms "
                    f"p99 {summary['ttft_ms']['p99']:.0f} ms, "
                    f"ITL p50 {summary['itl_ms']['p50'] or 0:.1f} ms",
                    flush=True,
                )
    out = ROOT / "benchmarks" / "results" / f"serve-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
