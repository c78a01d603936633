"""A harness for onnxruntime-genai's `Engine` (0.18): the request schedule of
`benchmarks/serve.py` on a genai export, with no HTTP in between.

Run by serve.py in a process of its own (`--genai-path` first on sys.path):

    python benchmarks/genai_engine.py MODEL_FOLDER --genai-path /tmp/genai18 \\
        --load concurrency:8 --requests 24 --max-tokens 32 --batch 8

It prints one JSON object: per request, when it arrived, its tokens and its end (seconds from
the start); or {"error": ...} saying why the Engine did not run.
The Engine is driven from one thread (its owner): requests are created when the schedule says
(a fixed concurrency, or Poisson arrivals drawn as serve.py draws them), and `Engine.run`
is called while any is pending.

Its continuous-batching mode (`engine.dynamic_batching`) needs PagedAttention in the graph,
which onnxruntime-genai 0.18's builder writes only for CUDA (fp16/bf16) and WebGPU (fp16):
`--mode dynamic` tries it and reports the Engine's refusal; `--mode static` (the default)
runs `engine.static_batching` with `--batch` rows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

PROMPTS_FROM = "serve.py"  # the prompts are serve.py's PROMPTS, passed as JSON


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--genai-path", required=True)
    parser.add_argument("--load", required=True, help="concurrency:N or rate:R")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mode", choices=("static", "dynamic"), default="static")
    parser.add_argument("--max-length", type=int, default=1024, help="search.max_length")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime's intra-op threads")
    parser.add_argument("--prompts", required=True, help="a JSON list of user messages")
    args = parser.parse_args()
    sys.path.insert(0, args.genai_path)
    try:
        out = run(args)
    except Exception as error:  # noqa: BLE001 - reported as the result
        out = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(out), flush=True)
    return 0


def run(args: argparse.Namespace) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(args.model)
    options = {"intra_op_num_threads": args.threads}
    # the context of the server it is compared with (--max-model-len): the static cache's rows
    config.overlay(json.dumps({"search": {"max_length": args.max_length}}))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    if args.mode == "static":
        config.overlay(json.dumps({"engine": {"static_batching": {"max_batch_size": args.batch}}}))
    else:
        config.overlay(json.dumps({"engine": {"dynamic_batching": {"max_batch_size": args.batch}}}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    engine = og.Engine(model)
    prompts = []
    for text in json.loads(args.prompts):
        messages = json.dumps([{"role": "user", "content": text}])
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        prompts.append(np.asarray(ids, np.int32))
    kind, value = args.load.split(":")
    concurrency = int(value) if kind == "concurrency" else None
    arrivals, t, rng = [], 0.0, random.Random(0)  # serve.py's schedule
    for _ in range(args.requests):
        arrivals.append(t)
        if kind == "rate":
            t += rng.expovariate(float(value))
    buffer = engine.create_event_buffer(256)
    token_flag = og.EngineEventFlags.TOKEN.value
    done_flag = og.EngineEventFlags.TURN_FINISHED.value

    def submit(i: int, now: float) -> None:
        request = engine.create_request()
        turn = og.TurnOptions(request)
        turn.set_temperature(0.0)
        turn.set_max_generated_tokens(args.max_tokens)
        request.begin_turn(prompts[i % len(prompts)], turn)
        live[id(request)] = (i, request)
        records[i] = {"arrival": now, "first": None, "end": None, "tokens": 0, "times": []}

    def warm() -> None:  # the first runs allocate and plan: not measured
        for i in range(min(args.batch, len(prompts))):
            submit(i, 0.0)
        while engine.has_pending_requests():
            engine.run(buffer)
        for _, request in live.values():
            request.close()
        live.clear()
        records.clear()

    live: dict[int, tuple[int, object]] = {}
    records: dict[int, dict] = {}
    warm()
    start, sent, failed = time.perf_counter(), 0, []
    while len([r for r in records.values() if r["end"] is not None]) < args.requests:
        now = time.perf_counter() - start
        while sent < args.requests and (
            (concurrency is not None and len(live) < concurrency)
            or (concurrency is None and arrivals[sent] <= now)
        ):
            submit(sent, now if concurrency is not None else arrivals[sent])
            sent += 1
        if not engine.has_pending_requests():
            if sent < args.requests and concurrency is None:
                time.sleep(max(arrivals[sent] - (time.perf_counter() - start), 0))
            continue
        for event in engine.run(buffer):
            i, request = live.get(id(event.request), (None, None))
            if i is None:
                continue
            at = time.perf_counter() - start
            record = records[i]
            if event.flags.value & token_flag:
                record["first"] = record["first"] if record["first"] is not None else at
                record["tokens"] += 1
                record["times"].append(at)
            if event.flags.value & done_flag:
                record["end"] = at
                if str(event.finish_reason).endswith("FAILED"):
                    failed.append(f"{event.error_code}")
                request.close()
                del live[id(event.request)]
        if failed:
            return {"error": f"the Engine failed a request: {failed[0]}"}
    took = time.perf_counter() - start
    caps = engine.get_capabilities()
    return {
        "seconds": took,
        "records": [records[i] for i in sorted(records)],
        "mode": args.mode,
        "max_batch_size": caps.configured_max_batch_size,
        "version": og.__version__,
    }


if __name__ == "__main__":
    sys.exit(main())
