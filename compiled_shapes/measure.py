"""Real compile and run times of generation steps, on the fixtures and on larger models.

Compile times come from JAX's monitoring events of the step program (trace, lowering to MLIR
and XLA's backend compile of ``step``); run times are medians of repeated calls of compiled
steps. The persistent compilation cache must be off (``TRANSMUTER_JAX_COMPILE_CACHE=off``, which
:mod:`compiled_shapes.study` sets), or a compile may be a disk read.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

import transmuter_jax as tj
from transmuter_jax import generation
from transmuter_jax.generation import cache as cache_modes

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
STEP_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "step",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "jit(step)",
    "/jax/core/compile/backend_compile_duration": "jit(step)",
}


class Compiles:
    """Collects the compile durations of the step program (trace + lowering + XLA compile)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
        if STEP_EVENTS.get(event) == kwargs.get("fun_name"):
            self.events.append((event, duration))

    def take(self) -> tuple[int, float]:
        """(programs compiled, seconds) since the last call."""
        count = sum(1 for e, _ in self.events if e.endswith("backend_compile_duration"))
        seconds = sum(d for _, d in self.events)
        self.events.clear()
        return count, seconds


COMPILES: Compiles | None = None


def compiles() -> Compiles:
    """The process's collector (JAX listeners cannot be removed, so there is one)."""
    global COMPILES
    if COMPILES is None:
        COMPILES = Compiles()
    return COMPILES


def node_count(path: pathlib.Path) -> int:
    """Nodes of the graph a decode step runs: the branch that reads the cache of a merged
    decoder (an If on use_cache_branch), else the whole graph."""
    import onnx  # noqa: PLC0415

    graph = onnx.load(str(path), load_external_data=False).graph
    if len(graph.node) == 1 and graph.node[0].op_type == "If":
        return len(next(a.g for a in graph.node[0].attribute if a.name == "then_branch").node)
    return len(graph.node)


def _tests_path() -> None:
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))


@dataclasses.dataclass
class Run:
    """One call of generate on a fresh context."""

    model: str
    case: str
    mode: str
    padded: bool
    shapes: int
    compile_s: float
    wall_s: float
    tokens_ok: bool | None
    step_s: list[float] = dataclasses.field(default_factory=list)  # each step, compile included


def fixture_run(name: str, case_name: str, padded: bool, workdir: pathlib.Path) -> Run:
    """The fixture case's prompts in one batch (as tests/test_generation.py), on a new context."""
    _tests_path()
    from generation_cases import case, context, encoder_inputs  # noqa: PLC0415

    the_case = case(name, case_name)
    prompts = the_case["prompts"]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts))))
    max_new = the_case["options"]["max_new_tokens"]
    ctx = context(name, workdir, given=given, max_new_tokens=max_new)
    ctx = generation.compile(ctx, len(prompts), grow_cache="padded" if padded else "exact")
    compiles().take()
    start = time.perf_counter()
    out = generation.generate(ctx, prompts, list(range(len(prompts))), inputs)
    wall = time.perf_counter() - start
    _, seconds = compiles().take()
    return Run(
        name,
        case_name,
        ctx.mode,
        ctx.compiled.padded,
        ctx.compiled.shapes,
        seconds,
        wall,
        out == the_case["tokens"],
    )


@dataclasses.dataclass
class StepTime:
    """A decode step of one shape: its compile time and median run time."""

    model: str
    mode: str
    tokens: int  # step tokens
    rows: int  # cache rows the step reads
    valid: int  # valid cached tokens
    padded: bool
    compile_s: float
    run_s: float


def step_time(
    ctx: generation.Context,
    label: str,
    tokens: int,
    rows: int,
    valid: int,
    *,
    padded: bool = False,
    given: dict[str, Any] | None = None,
    repeats: int = 7,
) -> StepTime:
    """Compiles and times one step of ``tokens`` tokens on a cache of ``rows`` rows holding
    ``valid`` tokens (in grow without padding, rows == valid).

    The cache holds zeros: run times do not depend on the values.
    """
    batch = ctx.batch_size
    encoder = 0
    if given and "encoder_hidden_states" in given:
        encoder = int(given["encoder_hidden_states"].shape[1])
    state = cache_modes.State(ctx.compiled.cache, ctx.cache, batch, rows, encoder)
    state.lengths = np.full(batch, valid, np.int32)
    state.rows = rows
    state.arrays = ctx.cache.empty(batch, rows, encoder)
    feed: dict[str, Any] = {"tokens": jnp.ones((batch, tokens), jnp.int32)}
    names = {i.name for i in ctx.model.inputs}
    if "attention_mask" in names:
        feed["attention_mask"] = jnp.asarray(state.mask(tokens))
    if "position_ids" in names:
        feed["position_ids"] = jnp.asarray(valid + np.arange(tokens)[None].repeat(batch, 0))
    feed |= {k: jnp.asarray(v) for k, v in (given or {}).items()}
    lengths = jnp.full((batch,), valid, jnp.int32)
    last = jnp.full((batch,), tokens - 1, jnp.int32)
    arrays = state.arrays

    def once() -> float:
        nonlocal arrays
        copy = {k: v.copy() for k, v in arrays.items()}  # the step donates its cache
        start = time.perf_counter()
        logits, new = ctx.compiled.steps(copy, feed, lengths, last, rows if padded else None)
        jax.block_until_ready((logits, new))
        return time.perf_counter() - start

    compiles().take()
    once()
    _, compile_s = compiles().take()
    runs = [once() for _ in range(repeats)]
    return StepTime(
        label, ctx.mode, tokens, rows, valid, padded, compile_s, statistics.median(runs)
    )


def default_model_steps(
    folder: pathlib.Path, label: str, prompts: Sequence[int], capacities: Sequence[int]
) -> list[StepTime]:
    """Compile and run times of prefill steps (``prompts`` tokens) and decode steps (on caches
    of ``capacities`` rows) of a decoder in ``folder`` (in_place or append)."""
    model = tj.load(folder / "model.onnx", outputs=generation.outputs(_output_names(folder)))
    out = []
    for tokens in prompts:
        ctx = generation.compile(generation.context(folder, model, max_new_tokens=4), 1)
        rows = ctx.compiled.cache.capacity(tokens + 4, tokens)
        out.append(step_time(ctx, label, tokens, rows, 0))
    for rows in capacities:
        ctx = generation.compile(generation.context(folder, model, max_new_tokens=4), 1)
        out.append(step_time(ctx, label, 1, rows, min(rows - 1, 16)))
    return out


def _output_names(folder: pathlib.Path) -> list[str]:
    import onnx  # noqa: PLC0415

    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return [o.name for o in proto.graph.output]


def whisper_steps(
    folder: pathlib.Path, valid: Sequence[int], capacities: Sequence[int], batch: int = 1
) -> list[StepTime]:
    """Decode steps of a Whisper decoder: exact lengths ``valid`` (each its own program) and
    padded caches of ``capacities`` rows (holding 16 tokens), 1500 encoder rows."""
    model = tj.load(folder / "decoder_model_merged.onnx")
    states = np.zeros((batch, 1500, _hidden(model)), np.float32)
    given = {"encoder_hidden_states": states}
    out = []
    for padded, sizes in ((False, valid), (True, capacities)):
        ctx = generation.context(folder, model, given=("encoder_hidden_states",))
        ctx = generation.compile(ctx, batch, grow_cache="padded" if padded else "exact")
        if padded and not ctx.compiled.padded:
            raise RuntimeError(f"the decoder was not padded: {ctx.compiled.unpadded}")
        cross = _cross_cache(ctx, given)
        for size in sizes:
            out.append(_grow_step(ctx, size, padded, given, cross))
    return out


def _hidden(model: tj.Model) -> int:
    info = next(i for i in model.inputs if i.name == "encoder_hidden_states")
    return int(info.shape[2])


def _cross_cache(ctx: generation.Context, given: dict[str, Any]) -> dict[str, jax.Array]:
    """The cross-attention cache the first step computes from the encoder outputs."""
    feed = {"tokens": jnp.ones((ctx.batch_size, 1), jnp.int32)}
    feed |= {k: jnp.asarray(v) for k, v in given.items()}
    empty = ctx.cache.empty(ctx.batch_size, 0, 0)
    zeros = jnp.zeros((ctx.batch_size,), jnp.int32)
    rows = ctx.compiled.cache.capacity(64, 1) if ctx.compiled.padded else None
    _, new = ctx.compiled.steps(empty, feed, zeros, zeros, rows)
    ctx.compiled.steps.shapes.clear()
    compiles().take()
    return {e.input: new[e.input] for e in ctx.cache.entries if e.cross}


def _grow_step(ctx, size: int, padded: bool, given, cross) -> StepTime:
    batch = ctx.batch_size
    valid = 16 if padded else size
    arrays = {
        e.input: (cross[e.input] if e.cross else jnp.zeros((batch, e.heads, size, e.head_size)))
        for e in ctx.cache.entries
    }
    feed = {"tokens": jnp.ones((batch, 1), jnp.int32)}
    feed |= {k: jnp.asarray(v) for k, v in given.items()}
    lengths = jnp.full((batch,), valid, jnp.int32)
    last = jnp.zeros((batch,), jnp.int32)

    def once() -> float:
        copy = {k: v.copy() for k, v in arrays.items()}
        start = time.perf_counter()
        result = ctx.compiled.steps(copy, feed, lengths, last, size if padded else None)
        jax.block_until_ready(result)
        return time.perf_counter() - start

    compiles().take()
    once()
    _, compile_s = compiles().take()
    runs = [once() for _ in range(7)]
    label = "whisper-tiny (random)"
    return StepTime(label, "grow", 1, size, valid, padded, compile_s, statistics.median(runs))


def _whisper(folder: pathlib.Path, new_tokens: int, grow_cache: str):
    """A compiled context for one Whisper transcription of ``new_tokens`` tokens (no eos), and
    zero encoder states."""
    model = tj.load(folder / "decoder_model_merged.onnx")
    states = np.zeros((1, 1500, _hidden(model)), np.float32)
    ctx = generation.context(
        folder,
        model,
        given=("encoder_hidden_states",),
        max_new_tokens=new_tokens,
        eos_token_id=[],
    )
    ctx = generation.compile(ctx, 1, grow_cache=grow_cache)
    return ctx, states


def whisper_transcription(folder: pathlib.Path, new_tokens: int, grow_cache: str) -> Run:
    """One transcription of ``new_tokens`` tokens (no eos) after Whisper's 4 prompt tokens, with
    the grow cache ``grow_cache`` ("padded", "buckets" or "exact")."""
    ctx, states = _whisper(folder, new_tokens, grow_cache)
    steps: list[float] = []
    mark = [0.0]

    def on_step(_: dict) -> None:
        now = time.perf_counter()
        steps.append(now - mark[0])
        mark[0] = now

    compiles().take()
    start = mark[0] = time.perf_counter()
    prompt = [[50258, 50259, 50359, 50363]]  # start of transcript, language, task, no timestamps
    generation.generate(ctx, prompt, [0], {"encoder_hidden_states": states}, on_step)
    wall = time.perf_counter() - start
    _, seconds = compiles().take()
    label = f"{new_tokens} tokens" + (", buckets" if grow_cache == "buckets" else "")
    run = Run(
        "whisper-tiny (random)",
        label,
        "grow",
        ctx.compiled.padded,
        ctx.compiled.shapes,
        seconds,
        wall,
        None,
        steps,
    )
    return run


def _process_memory() -> tuple[int, int]:
    """(memory mappings, resident kB) of this process (Linux)."""
    with open("/proc/self/maps") as file:
        maps = sum(1 for _ in file)
    with open("/proc/self/status") as file:
        rss = next(int(line.split()[1]) for line in file if line.startswith("VmRSS"))
    return maps, rss


def whisper_memory(
    folder: pathlib.Path, new_tokens: int, grow_cache: str, every: int = 10, echo: bool = False
) -> list[dict[str, float]]:
    """Memory mappings and resident memory of the process every ``every`` tokens of one
    transcription (no eos). Each compiled XLA CPU program keeps its own mappings; Linux allows
    vm.max_map_count (65530 by default) per process. ``echo`` prints each sample as it comes
    (the full exact run may end the process)."""
    ctx, states = _whisper(folder, new_tokens, grow_cache)
    maps, rss = _process_memory()
    start = time.perf_counter()
    samples = [{"tokens": 0, "maps": maps, "rss_mb": rss / 1024, "seconds": 0.0, "shapes": 0}]
    if echo:
        print("memory", json.dumps(samples[0]), flush=True)
    tokens = [0]

    def on_step(_: dict) -> None:
        tokens[0] += 1
        if tokens[0] % every:
            return
        maps, rss = _process_memory()
        sample = {
            "tokens": tokens[0],
            "maps": maps,
            "rss_mb": rss / 1024,
            "seconds": time.perf_counter() - start,
            "shapes": ctx.compiled.shapes,
        }
        samples.append(sample)
        if echo:
            print("memory", json.dumps(sample), flush=True)

    prompt = [[50258, 50259, 50359, 50363]]
    generation.generate(ctx, prompt, [0], {"encoder_hidden_states": states}, on_step)
    return samples


def main() -> None:
    """``python -m compiled_shapes.measure memory TOKENS GROW_CACHE FOLDER``: one transcription
    that prints its memory samples (a process of its own, which the full exact run may end)."""
    _, kind, tokens, grow_cache, folder = sys.argv
    if kind != "memory":
        raise SystemExit(f"unknown measurement {kind!r}")
    whisper_memory(pathlib.Path(folder), int(tokens), grow_cache, echo=True)


if __name__ == "__main__":
    main()
