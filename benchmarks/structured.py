"""Structured output: constrained vs unconstrained decode tokens/s, and constraint compile times.

``python benchmarks/structured.py [--new 48] [--repo default]`` runs the default model (greedy)
at batch 1 and 8 without a constraint and with JSON schemas, a regex and a choice (each on
the path it takes: the device table in the decode chunk, or llguidance's matcher on the host
called from the decode chunk); times the per-step work of a table (:func:`restrict` and
:func:`advance` on [batch, vocab] logits inside jit) and of host rows (the same, called back
to llguidance) against a plain argmax, and the compile time of each constraint (llguidance,
and the device table). It prints one JSON object; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
}  # other properties allowed (JSON Schema's default): not regular, llguidance's host rows
STRINGS = {**SCHEMA, "additionalProperties": False}  # the same, closed: a device table
CLOSED = {  # closed objects of booleans, enums and integers: a device table
    "type": "object",
    "properties": {
        "member": {"type": "boolean"},
        "kind": {"enum": ["person", "company", "other"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "age": {"type": "integer"},
    },
    "required": ["member", "kind", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": {"json_schema": SCHEMA},
    "json_schema_closed": {"json_schema": CLOSED},
    "json_schema_strings": {"json_schema": STRINGS},
    "regex": {"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3} (apples|pears)"},
    "choice": {"choice": ["positive", "negative", "neutral"]},
}
PROMPT = "Describe a person as JSON with a name, an age, tags and membership."


def _rate(pipe, batch: int, new: int, options: dict, warm: bool = False) -> dict:
    """Decode tokens/s: the new tokens after each row's first over the time from the first
    token's event to the last (the prompts' prefill left out); and batch steps/s (the same
    time over the steps, whatever rows still run: the per-step cost, apart from how many rows
    end early)."""
    prompts = [pipe.prompt_ids(f"{PROMPT} ({i})") for i in range(batch)]
    options = {"max_new_tokens": new, **options}
    runner = pipe._runner
    if warm:
        runner.run(pipe.tokenizer, prompts, options)  # compile and warm up
    times, counts = [], []

    def on_token(event) -> None:
        times.append(time.perf_counter())
        counts.append(int((event["token"] >= 0).sum()))

    runner.run(pipe.tokenizer, prompts, options, on_token=on_token)
    tokens = sum(counts[1:])  # the first event's tokens come with the prefill
    seconds = times[-1] - times[0]
    return {"tokens": tokens, "steps": len(times) - 1, "seconds": seconds}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _rates(pipe, batch: int, new: int, rounds: int) -> dict:
    """Each configuration's median tok/s and steps/s over ``rounds`` interleaved rounds, the
    median of each round's ratio to the free run of that round ("ratio", the issue's measure),
    and to a free run of as many new tokens ("ratio_same_length": a short answer pays a decode
    chunk's start over few tokens, constrained or not)."""
    configs = {"free": {}, **CONSTRAINTS}
    for name, options in CONSTRAINTS.items():
        _rate(pipe, batch, new, options, warm=True)
        steps = _rate(pipe, batch, new, options)["steps"]
        configs[f"free_{name}_length"] = {"max_new_tokens": steps + 1}
    for options in configs.values():
        _rate(pipe, batch, new, options, warm=True)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, options in configs.items():
            runs[name].append(_rate(pipe, batch, new, options))

    def ratio(got, base, unit="tokens"):
        pairs = zip(got, base, strict=True)
        return round(
            _median([(g[unit] / g["seconds"]) / (b[unit] / b["seconds"]) for g, b in pairs]), 2
        )

    out = {}
    for name, got in runs.items():
        out[name] = {
            "tokens": got[0]["tokens"],
            "steps": got[0]["steps"],
            "tok_s": round(_median([g["tokens"] / g["seconds"] for g in got]), 1),
            "steps_s": round(_median([g["steps"] / g["seconds"] for g in got]), 2),
        }
        if name in CONSTRAINTS:
            out[name]["ratio"] = ratio(got, runs["free"])
            out[name]["ratio_same_length"] = ratio(got, runs[f"free_{name}_length"])
    return out


def _device_step(vocab: int, batch: int, path: str, eos: tuple[int, ...]) -> dict:
    """Microseconds per step of the constraint's own work in a compiled loop of 64 steps over
    random [batch, vocab] logits (greedy): a regex's and the closed schemas' tables, the JSON
    schema's host rows (called back to llguidance), and a plain argmax."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from transmuter_jax.generation import constraints as cs

    def masked(table):
        @jax.jit
        def run(logits, state):
            def step(state, scores):
                token = jnp.argmax(cs.restrict(scores, table, state), -1).astype(jnp.int32)
                return cs.advance(table, state, token, jnp.ones_like(token, bool)), token

            return jax.lax.scan(step, state, logits)[1]

        return run

    @jax.jit
    def plain(logits, state):
        return jax.lax.scan(lambda s, x: (s, jnp.argmax(x, -1)), state, logits)[1]

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(64, batch, vocab)), jnp.float32)
    logits = logits.at[:, :, list(eos)].set(-1e9)  # host rows run all 64 steps
    out = {}
    regex = cs.Constraint("regex", CONSTRAINTS["regex"]["regex"])
    closed = cs.Constraint("json_schema", json.dumps(CLOSED))
    strings = cs.Constraint("json_schema", json.dumps(STRINGS))
    schema = cs.HostMask(cs.Constraint("json_schema", json.dumps(SCHEMA)), path, vocab, eos)
    zeros = jnp.zeros(batch, jnp.int32)
    cases = {
        "plain": (plain, lambda: zeros),
        "regex_table": (masked(cs.token_table(regex, path, vocab, eos)), lambda: zeros),
        "closed_table": (masked(cs.token_table(closed, path, vocab, eos)), lambda: zeros),
        "strings_table": (masked(cs.token_table(strings, path, vocab, eos)), lambda: zeros),
        "host_rows": (masked(schema.table), lambda: schema.start([([1], [])] * batch)),
    }
    for name, (fn, start_state) in cases.items():
        runs = []
        for _ in range(6):  # the first compiles
            state = start_state()
            start = time.perf_counter()
            fn(logits, jnp.asarray(state)).block_until_ready()
            runs.append(time.perf_counter() - start)
            schema.release(np.asarray(state))
        out[f"{name}_us_per_step"] = round(_median(runs[1:]) / 64 * 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--repo", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transmuter_jax import text
    from transmuter_jax.generation import constraints as cs
    from transmuter_jax.tasks import runner as runners

    # every configuration's compiled context kept: the rounds measure decode, not recompiles
    runners.KEEP_CONTEXTS = max(runners.KEEP_CONTEXTS, 2 * len(CONSTRAINTS) + 2)
    pipe = text.generation(args.repo)
    folder = pipe.files.folder
    path = os.path.join(folder, "tokenizer.json")
    ctx = pipe._runner.context(1, {})
    vocab, eos = ctx.vocab_size, ctx.eos
    report: dict = {"model": folder, "new_tokens": args.new, "vocab": vocab, "compile": {}}
    report["uptime_start"] = _uptime()
    start = time.perf_counter()
    cs.tokenizer(path, vocab, eos)
    report["compile"]["tokenizer_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    cs._texts(path, vocab, eos)  # the vocabulary's byte texts for outlines-core, once
    report["compile"]["table_vocabulary_s"] = round(time.perf_counter() - start, 3)
    for name, options in CONSTRAINTS.items():
        constraint = cs.from_options(ctx.options.replace(**options))
        start = time.perf_counter()
        cs.compile_matcher(constraint, path, vocab, eos)
        first = time.perf_counter() - start
        start = time.perf_counter()
        cs.compile_matcher(constraint, path, vocab, eos)
        cached = time.perf_counter() - start
        row = {"llguidance_s": round(first, 4), "cached_s": round(cached, 5)}
        start = time.perf_counter()  # the path and its table, as a call's context makes them
        mask = cs.processor(constraint, path, vocab, eos)
        row["path_s"] = round(time.perf_counter() - start, 3)
        row["path"] = "device" if isinstance(mask, cs.DeviceMask) else "host"
        if row["path"] == "device":
            row["states"] = mask.table.states
        report["compile"][name] = row
    report["rounds"] = args.rounds
    for batch in (1, 8):
        report[f"batch_{batch}"] = _rates(pipe, batch, args.new, args.rounds)
        report[f"device_step_batch_{batch}"] = _device_step(vocab, batch, path, eos)
        report[f"uptime_after_batch_{batch}"] = _uptime()
    print(json.dumps(report, indent=1))


def _uptime() -> str:
    """The load average now (the machine may be shared: ratios within one run only)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
