"""Runs sharded generation cases in one process of 8 forced host devices; prints one JSON line.

Run by tests/test_sharding.py with XLA_FLAGS=--xla_force_host_platform_device_count=8 (JAX
reads it at import). Arguments: a JSON list of cases, each {"fixture", "meshes": [[model,
data], ...], "options": {...}, "load": bool}. For each case it runs the fixture on one
device, then on each mesh (with "load", on the decoder loaded with ``mesh=``), and reports the
tokens, every weight's spec with the nodes that read it, the cache
specs and the warnings.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from generation_cases import (  # noqa: E402
    FIXTURES,
    case,
    context,
    embed,
    encoder_inputs,
    reference,
)
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import transmuter_jax as tj  # noqa: E402
from transmuter_jax import generation, kernels, text  # noqa: E402
from transmuter_jax.onnx.dtypes import to_device_dtype  # noqa: E402
from transmuter_jax.onnx.trace import subgraphs  # noqa: E402
from transmuter_jax.parallel import sharding  # noqa: E402
from transmuter_jax.runtime import switch  # noqa: E402
from transmuter_jax.runtime.stored import StoredJit  # noqa: E402

BATCH = 8
TEXTS = (["The quiet river", "A small cat sat"],)  # 2 rows: the data axis of 4 rounds them up


def _readers(graph, found):
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append([node.op_type, node.name])
        for sub in subgraphs(node):
            _readers(sub, found)
    return found


def _spec(spec) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in spec]


def run_case(spec: dict, tmp: pathlib.Path) -> list[dict]:
    name = spec["fixture"]
    the_case = case(name, "batch")
    base_prompts = the_case["prompts"]
    # Two lengths that one prompt step of 4 feeds: one prefill shape per compile.
    prompts = [base_prompts[i % len(base_prompts)][: 4 - i % 2] for i in range(4)]
    rows = [i % len(base_prompts) for i in range(4)]
    given, inputs = encoder_inputs(name, the_case, rows)
    options = {"max_new_tokens": 6, "decode_steps": 3, "token_logprobs": True}
    options |= spec.get("options", {})
    ctx = context(name, tmp, given=given, **options)
    seeds = list(range(len(prompts)))
    single, single_lp = _pairs(
        generation.generate(generation.compile(ctx, BATCH), prompts, seeds, inputs)
    )
    results = []
    for at, (model, data) in enumerate(spec["meshes"]):
        mesh = sharding.make_mesh(model=model, data=data)
        loaded, on = None, ctx
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if spec.get("load"):  # placed at load, from the file straight to the shards
                loaded, on = _load(name, mesh, tmp, given, options)
            batch = spec.get("batch", BATCH)  # padded up to the data axis
            sharded = generation.compile(on, batch, mesh=mesh, shard_small=0)
            tokens, logprobs = _pairs(generation.generate(sharded, prompts, seeds, inputs))
            gap = None if at else _logits_gap(ctx, sharded, prompts[0], inputs)
        params = sharded.model.params
        readers = _readers(sharded.model.graph.proto, {})  # fused q/k/v split: new weights
        if loaded is not None:
            loaded["reused"] = all(params[k] is v for k, v in on.model.params.items())
        results.append(
            {
                "loaded": loaded,
                "fixture": name,
                "mode": ctx.mode,
                "mesh": [model, data],
                "batch": sharded.batch_size,
                "single": single,
                "tokens": tokens,
                "logprob_gap": _gap(single_lp, logprobs),
                "logits_gap": gap,
                "config": ctx.config,
                "weights": {
                    k: {
                        "spec": _spec(v.sharding.spec),
                        "shape": list(v.shape),
                        "readers": readers.get(k, []),
                        "devices": len(v.sharding.device_set),
                        "bytes": int(v.nbytes),
                    }
                    for k, v in params.items()
                },
                "cache": {
                    e.input: [e.heads, _spec(sharded.placement.cache[e.input])]
                    for e in ctx.cache.entries
                },
                "on_device": generation.on_device(sharded),
                "beams": int(ctx.options.num_beams),
                "warnings": [str(w.message) for w in caught],
                "memory": sharding.memory(params),
            }
        )
    return results


def slots_case(spec: dict, tmp: pathlib.Path) -> list[dict]:
    """The slots on one device and on each mesh: three requests (greedy, seeded sampling, a
    penalty; an encoder-decoder's each with its own encoder outputs) joining at other steps.
    Reports each request's tokens and log-probabilities and the slots' cache specs."""
    name = spec["fixture"]
    the_case = case(name, "batch")
    prompts = the_case["prompts"]
    given = encoder_inputs(name, the_case, [0])[0]
    own = [encoder_inputs(name, the_case, [i])[1] or None for i in range(3)]
    ctx = context(name, tmp, given=given, max_new_tokens=6)
    options = [dict(logprobs=True), dict(do_sample=True, seed=5, logprobs=True),
               dict(repetition_penalty=1.3, logprobs=True)]  # fmt: skip

    def run(engine):
        state, got, firsts = engine.init_state(), {}, []
        for i, extra in enumerate(options):
            prefix = engine.prefill(generation.Request(prompts[i], inputs=own[i], **extra))
            firsts.append(prefix.first)
            state = engine.insert(prefix, state, 2 * i)
            state, tokens = engine.generate(state, 2)
            for t in tokens:
                got.setdefault(t.slot, []).append(t)
        while state.live_slots:
            state, tokens = engine.generate(state, 3)
            for t in tokens:
                got.setdefault(t.slot, []).append(t)
        rows = [[firsts[i], *got.get(2 * i, [])] for i in range(3)]
        cache = {k: _spec(getattr(v.sharding, "spec", ())) for k, v in state.rows.cache.items()}
        return [[t.token for t in r] for r in rows], [[t.logprob for t in r] for r in rows], cache

    single, single_lp, _ = run(generation.compile(ctx, BATCH, capacity=128))
    results = []
    for model, data in spec["meshes"]:
        mesh = sharding.make_mesh(model=model, data=data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = generation.compile(ctx, BATCH, capacity=128, mesh=mesh, shard_small=0)
        tokens, logprobs, cache = run(engine)
        placed = {k: _spec(v) for k, v in engine.placement.cache.items()}
        results.append({"fixture": name, "mesh": [model, data], "single": single,
                        "tokens": tokens, "logprob_gap": _gap(single_lp, logprobs),
                        "cache": cache, "placement": placed})  # fmt: skip
    return results


def _gap(a: list, b: list) -> float:
    """The largest difference of two runs' log-probabilities (their tokens are equal)."""
    return max((abs(x - y) for r, q in zip(a, b, strict=True) for x, y in zip(r, q, strict=True)),
               default=0.0)  # fmt: skip


def _pairs(out: list) -> tuple[list, list]:
    """The tokens and the log-probabilities of generate's (token, log-probability) pairs."""
    return [[t for t, _ in row] for row in out], [[lp for _, lp in row] for row in out]


def _logits_gap(ctx, sharded, prompt: list[int], inputs: dict) -> float:
    """The largest difference between the logits of the first step of ``prompt`` (an empty
    cache) on one device and over the mesh, by a direct call of each context's decoder."""
    entries = {e.input: e for e in ctx.cache.entries}
    feeds = {}
    for info in ctx.model.inputs:
        name = info.name
        if name == "input_ids":
            feeds[name] = np.array([prompt], np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, len(prompt)), np.int64)
        elif name == "position_ids":  # [1, s], or the 3 axes of M-RoPE [3, 1, s]
            rows = np.arange(len(prompt), dtype=np.int64)
            mrope = len(info.shape or ()) == 3
            feeds[name] = np.broadcast_to(rows, (3, 1, len(prompt))) if mrope else rows[None]
        elif name == "inputs_embeds":  # the prompt's embeddings, from the embedding model
            ids = np.array([prompt], np.int64)
            feeds[name] = np.asarray(next(iter(ctx.embed({"input_ids": ids}).values())))
        elif name in entries:
            e = entries[name]
            feeds[name] = np.zeros((1, e.heads, 0, e.head_size), np.dtype(info.dtype))
        elif name == "use_cache_branch":
            feeds[name] = np.array([False])
        else:
            feeds[name] = np.asarray(inputs[name])[:1]
    alone = np.asarray(ctx.model(feeds)["logits"])
    together = np.asarray(sharded.model(feeds)["logits"])
    return float(np.abs(alone - together).max())


def _load(name: str, mesh, tmp: pathlib.Path, given, options) -> tuple[dict, object]:
    """Loads the decoder with ``mesh=``; reports the arrays that appeared meanwhile (each
    with its shape and the devices it spans) and the context of the placed model."""
    before = {id(a) for a in jax.live_arrays()}
    file = FIXTURES / name / reference(name)[0]["files"]["decoder"]
    placed = tj.load(file, mesh=mesh, shard_small=0)
    made = [a for a in jax.live_arrays() if id(a) not in before]
    arrays = [[list(a.shape), len(a.sharding.device_set)] for a in made]
    ctx = generation.context(
        FIXTURES / name, placed, given=given, embed=embed(name, tmp), **options
    )
    return {"arrays": arrays, "params": len(placed.params)}, ctx


def unrecognised(tmp: pathlib.Path) -> dict:
    """x @ w_in -> LayerNormalization -> @ w_head: w_in feeds no recognised pattern."""
    rng = np.random.default_rng(0)
    w_in = rng.standard_normal((16, 64)).astype(np.float32)
    w_head = rng.standard_normal((64, 32)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["h"]),
        helper.make_node("LayerNormalization", ["h", "scale"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w_head"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])],
        [
            numpy_helper.from_array(w_in, "w_in"),
            numpy_helper.from_array(np.linspace(0.5, 1.5, 64, dtype=np.float32), "scale"),
            numpy_helper.from_array(w_head, "w_head"),
        ],
    )
    path = tmp / "unrecognised.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
                     .SerializeToString())  # fmt: skip
    model = tj.load(path)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    mesh = sharding.make_mesh(model=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = sharding.find_rules(model, mesh, small=0)
        sharding.warn_replicated(rules, model.path)
    placed = model.with_params(sharding.Placement(mesh, rules, {}).place_params(model.params))
    return {
        "same": bool(
            np.array_equal(np.asarray(model({"x": x})["y"]), np.asarray(placed({"x": x})["y"]))
        ),  # fmt: skip
        "close": float(
            np.abs(np.asarray(model({"x": x})["y"]) - np.asarray(placed({"x": x})["y"])).max()
        ),  # fmt: skip
        "specs": {k: _spec(v.sharding.spec) for k, v in placed.params.items()},
        "warnings": [str(w.message) for w in caught],
    }


def pipelines() -> dict:
    """text.generation over mesh= (model 2 x data 4: one prompt's batch rounds up to 4 rows)
    and text.text_to_text over devices= (model 2), against the same pipelines on one device."""
    out = {}
    runs = [
        (
            "generation",
            text.generation,
            "llama-optimum",
            {"mesh": sharding.make_mesh(model=2, data=4)},
        ),
        ("text_to_text", text.text_to_text, "marian-optimum", {"devices": jax.devices()[:2]}),
    ]
    for kind, make, folder, where in runs:
        alone = make(FIXTURES / folder, max_new_tokens=6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the replicated weights, checked elsewhere
            together = make(FIXTURES / folder, max_new_tokens=6, **where)
        params = together.decoder.params
        out[kind] = {
            "alone": [[r.token_ids for r in alone.generate(t, seed=0)] for t in TEXTS],
            "together": [[r.token_ids for r in together.generate(t, seed=0)] for t in TEXTS],
            "split": sum(1 for v in params.values() if any(a is not None for a in v.sharding.spec)),
            "devices": sorted({len(v.sharding.device_set) for v in params.values()}),
        }
    return out


def _program(model, feeds: dict) -> str:
    """The compiled program text of ``model`` for ``feeds`` (which it has run)."""
    dynamic = {k: to_device_dtype(np.asarray(v)) for k, v in feeds.items()}
    return model.compiled(dynamic, {}).as_text()


def kernels_on() -> dict:
    """With the CPU kernels on: a model loaded packed for them, run over a mesh, traces no
    kernel call (and warns once); the same model on one device does."""
    os.environ.pop("TRANSMUTER_JAX_KERNELS", None)
    try:
        if not kernels.enabled():
            return {"enabled": False}
        file = FIXTURES / "llama-optimum" / "model.onnx"
        packed = tj.load(file)
        prompt = case("llama-optimum", "batch")["prompts"][0][:4]
        feeds = {
            "input_ids": np.array([prompt], np.int64),
            "attention_mask": np.ones((1, 4), np.int64),
            "position_ids": np.arange(4, dtype=np.int64)[None],
        }
        for info in packed.inputs:
            if info.name.startswith("past_key_values."):
                feeds[info.name] = np.zeros((1, info.shape[1], 0, info.shape[3]), np.float32)
        alone = np.asarray(packed(feeds)["logits"])
        ctx = generation.context(FIXTURES / "llama-optimum", packed, max_new_tokens=4)
        mesh = sharding.make_mesh(model=2, data=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded = generation.compile(ctx, BATCH, mesh=mesh)
            together = np.asarray(sharded.model(feeds)["logits"])
            # the whole decode loop (its greedy choice traced without the argmax kernel)
            prompts, seeds = [prompt, prompt[:3]], [0, 1]
            mesh_tokens = generation.generate(sharded, prompts, seeds)
        one = generation.compile(ctx, BATCH)
        seen = []  # whether the kernels were on while each program was traced

        def probe(x):
            seen.append(switch.enabled())
            return x + 1

        spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        StoredJit(probe, None)("mesh", jax.device_put(np.zeros(8, np.float32), spread))
        StoredJit(probe, None)("one", np.zeros(8, np.float32))
        return {
            "traced": seen,
            "tokens": mesh_tokens == generation.generate(one, prompts, seeds),
            "enabled": True,
            "alone_calls": "tj_gemm_f32" in _program(packed, feeds),
            "mesh_calls": "tj_" in _program(sharded.model, feeds),
            "gap": float(np.abs(alone - together).max()),
            "warnings": [str(w.message) for w in caught if "kernels" in str(w.message)],
        }
    finally:
        os.environ["TRANSMUTER_JAX_KERNELS"] = "0"


def main() -> None:
    cases = json.loads(sys.argv[1])
    assert jax.device_count() == 8, jax.devices()
    out = {"cases": [], "unrecognised": None}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in cases:
            if spec == "unrecognised":
                out["unrecognised"] = unrecognised(pathlib.Path(tmp))
            elif spec in ("pipelines", "kernels_on"):
                out[spec] = globals()[spec]()
            elif spec.get("slots"):
                out.setdefault("slots", []).extend(slots_case(spec, pathlib.Path(tmp)))
            else:
                out["cases"].extend(run_case(spec, pathlib.Path(tmp)))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    assert FIXTURES.is_dir()
    main()
