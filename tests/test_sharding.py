"""Generation over a mesh of 8 forced host devices gives the single-device tokens, with the
weights and cache split as the exporters' node names say they should be.

JAX reads XLA_FLAGS at import, so the cases run in one subprocess (tests/sharding_child.py).
The expected specs here come from the node names (q_proj, down_proj, ...), which the rules in
transmuter_jax/generation/sharding.py never read: they find the same roles from the graph.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import onnx
import pytest
from generation_cases import FIXTURES, context, embed, reference
from jax.sharding import AbstractMesh, PartitionSpec

import transmuter_jax as tj
from transmuter_jax import generation, kernels
from transmuter_jax.generation import GenerationError
from transmuter_jax.onnx import qkv
from transmuter_jax.parallel import sharding

ROOT = pathlib.Path(__file__).parent.parent
MESHES = [[8, 1], [2, 4], [1, 8]]  # [model, data]
# q, k and v in one product: split into one product each (their nodes' names end in .colsN);
# one that stays fused (its weight a constant of the program) keeps its attention replicated
FUSED = ("qkv_proj", "attn/c_attn")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", *FUSED, "attn/c_proj")
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "mlp/c_fc", *FUSED)
ROW = ("o_proj", "out_proj", "down_proj", "fc2", "mlp/c_proj", "attn/c_proj")


def _run(cases: list) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRANSMUTER_JAX_KERNELS"] = "0"  # the CPU kernels' custom calls are not partitioned
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sharding_child.py"), json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _norm(spec: list) -> list:
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _heads(config: dict) -> tuple[int, int]:
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads") or text.get("decoder_attention_heads")
    heads = heads or text.get("n_head")
    return heads, text.get("num_key_value_heads") or heads


def _expected(name: str, weight: dict, n: int, config: dict, fused: bool, blocks: bool) -> list:
    """The spec of a weight from the name and op of the node that reads it (``fused``: the
    model's attention still projects q, k and v in one product, so it is replicated;
    ``blocks``: the axis divides the int4 row-parallel products' blocks of K, else their groups
    are replicated)."""
    (op, node), shape = weight["readers"][0], weight["shape"]
    if n == 1:
        return []
    if op == "Gather":
        return ["model"] if shape[0] % n == 0 else []
    if op not in ("MatMul", "Gemm", "MatMulNBits") or (len(shape) < 2 and op != "Gemm"):
        return []  # norms, biases after an Add, rotary caches
    head = "lm_head" in node or "/proj_out/" in node  # Whisper's LM head is proj_out
    if head:
        column, row = True, False
    else:
        column, row = any(c in node for c in COLUMN), any(r in node for r in ROW)
    assert column or row, f"no role for {name} read by {node}"
    if any(a in node for a in ATTENTION):
        if fused:
            return []
        heads, kv = _heads(config)
        if heads % n or kv % n:
            return []
    elif op == "MatMulNBits" and not blocks and not head:
        return []  # whole blocks of K
    if op == "MatMulNBits":
        return ["model"] if column else [None, "model"]
    if column:
        return [None, "model"] if len(shape) == 2 else ["model"]  # a Gemm's bias: its columns
    return ["model"] if len(shape) == 2 else []


def _check(result: dict) -> None:
    for case in result["cases"]:
        where = f"{case['fixture']} ({case['mode']}) on model x data {case['mesh']}"
        n, data = case["mesh"]
        assert case["tokens"] == case["single"], where
        assert case["logprob_gap"] <= 1e-5, where  # only the order of some sums differs
        assert case["logits_gap"] is None or case["logits_gap"] <= 1e-5, where
        assert case["on_device"] == (case["beams"] == 1), where  # beams run on the host
        readers = [r[1] for w in case["weights"].values() for r in w["readers"]]
        fused = any(f in node and ".cols" not in node for node in readers for f in FUSED)
        blocks = all(
            w["shape"][1] % n == 0
            for w in case["weights"].values()
            if len(w["shape"]) == 2
            and w["readers"][0][0] == "MatMulNBits"
            and any(r in w["readers"][0][1] for r in ROW)
        )
        # A graph without node paths (torch.onnx.export's dynamo names nodes "node_linear_3")
        # does not say each product's role by name: then only that the rules split some.
        named = any("/" in node for node in readers)
        for name, weight in case["weights"].items():
            if named:
                want = _expected(name, weight, n, case["config"], fused, blocks)
                assert _norm(weight["spec"]) == want, f"{where}: {name} {weight}"
            assert weight["devices"] == 8
        if not named and n > 1:
            assert any(_norm(w["spec"]) for w in case["weights"].values()), where
        for name, (heads, spec) in case["cache"].items():
            want = ["data" if data > 1 else None, "model" if n > 1 and heads % n == 0 else None]
            assert _norm(spec) == _norm(want), f"{where}: {name}"
        assert not [w for w in case["warnings"] if "donat" in w], where
        replicated = [w for w in case["warnings"] if w.startswith("replicated on 'model'")]
        assert len(replicated) <= 1 and all("\n" not in w for w in replicated), where
        left = [k for k, w in case["weights"].items() if _norm(w["spec"]) == [] and n > 1]
        for name in left:  # every replicated linear weight is named in the warning
            if case["weights"][name]["readers"][0][0] in ("MatMul", "Gemm") and (
                len(case["weights"][name]["shape"]) == 2
            ):
                assert replicated and name in replicated[0], f"{where}: {name}"
        loaded = case["loaded"]
        if loaded is not None:  # load(mesh=): no whole copy of a weight on one device
            assert len(loaded["arrays"]) == loaded["params"], where
            assert all(devices == 8 for _, devices in loaded["arrays"]), where
            assert loaded["reused"], where  # compile(mesh=) kept the load's placement
        sharded = [w for w in case["weights"].values() if _norm(w["spec"])]
        if sharded:  # each device holds less than all the weights
            total = sum(w["bytes"] for w in case["weights"].values())
            assert max(case["memory"].values()) < total, where
            held = sum(w["bytes"] / math.prod(n if a == "model" else 1 for a in w["spec"])
                       for w in case["weights"].values())  # fmt: skip
            assert max(case["memory"].values()) == held, where


def test_meshes_give_single_device_tokens():
    """append (llama-optimum, placed at load) on every mesh, the encoder-decoder (marian, grow,
    placed at compile), gpt2's and the genai builder's fused q/k/v on model 2 x data 4, a graph
    whose MatMul the rules do not recognise, the text generation and text-to-text pipelines over
    a mesh, and the CPU kernels off over a mesh."""
    result = _run(
        [
            {"fixture": "llama-optimum", "meshes": MESHES, "load": True},
            {"fixture": "marian-optimum", "meshes": [[2, 4]]},
            {"fixture": "gpt2-optimum", "meshes": [[2, 4]]},
            {"fixture": "llama-genai-fp32", "meshes": [[2, 4]]},
            "unrecognised",
            "pipelines",
            "kernels_on",
        ]
    )
    assert len(result["cases"]) == 6
    _check(result)
    for case in result["cases"][4:]:  # the fused q/k/v products, split by heads
        parts = {k: w for k, w in case["weights"].items() if ".cols" in k}
        assert len(parts) >= 3, case["fixture"]
        for k, w in parts.items():  # columns of the weights, and of the biases
            assert _norm(w["spec"]) == ([None, "model"] if len(w["shape"]) == 2 else ["model"]), k
    for kind, run in result["pipelines"].items():  # text generation and an encoder-decoder
        assert run["together"] == run["alone"], kind
        assert run["split"] > 0 and run["devices"] == [8 if kind == "generation" else 2], kind
    on = result["kernels_on"]
    if on["enabled"]:  # the library built here: a mesh traces no kernel, and says so once
        assert on["alone_calls"] and not on["mesh_calls"] and on["tokens"]
        assert on["traced"] == [False, True]  # programs over a mesh trace without the kernels
        assert on["gap"] <= 1e-4  # the kernel's sums against XLA's
        assert len(on["warnings"]) == 1 and "packed" in on["warnings"][0]
    odd = result["unrecognised"]
    assert odd["close"] <= 1e-5
    assert odd["specs"] == {"w_in": [], "scale": [], "w_head": [None, "model"]}
    assert len(odd["warnings"]) == 1 and "w_in" in odd["warnings"][0]
    assert "w_head" not in odd["warnings"][0] and "\n" not in odd["warnings"][0]


@pytest.mark.slow
def test_every_mode_and_mesh():
    """in_place (genai fp32 and int4), gpt2, the encoder-decoder on every mesh; sampling and
    beam search."""
    result = _run(
        [
            {"fixture": "llama-genai-fp32", "meshes": MESHES},
            {"fixture": "llama-genai-int4", "meshes": MESHES},
            {"fixture": "gpt2-optimum", "meshes": MESHES},
            {"fixture": "marian-optimum", "meshes": [[8, 1], [1, 8]]},
            {
                "fixture": "llama-optimum",
                "meshes": [[2, 4]],
                "options": {"do_sample": True, "top_k": 20, "temperature": 0.9},
            },
            {"fixture": "llama-genai-fp32", "meshes": [[2, 4]], "options": {"num_beams": 2}},
        ]
    )
    _check(result)


def _stored(name: str, tmp: pathlib.Path):
    """The fixture's context with its weights as stored, as ``load(mesh=...)`` keeps them (the
    rules read plain products; a model loaded for one CPU holds its weights packed)."""
    with kernels.off():
        model = tj.load(FIXTURES / name / reference(name)[0]["files"]["decoder"])
    return generation.context(FIXTURES / name, model, embed=embed(name, tmp))


@pytest.mark.parametrize("name", ["gpt2-optimum", "llama-genai-fp32"])
def test_fused_qkv_products_split_by_heads(name, tmp_path):
    """GPT-2's c_attn (a product cut by a Split) and the genai builder's packed QKV (into
    GroupQueryAttention) become one product each: the same logits, and on "model" 2 the
    rules split q, k and v by heads with the output projection."""
    model = _stored(name, tmp_path).model
    split = qkv.split_qkv(model)
    assert split is not model and qkv.split_qkv(split) is split  # nothing fused is left
    parts = [k for k in split.params if ".cols" in k]
    assert parts and not set(parts) & set(model.params)
    rules = sharding.find_rules(split, AbstractMesh((2,), ("model",)), head_size=16, small=0)
    assert not rules.replicated
    for k in parts:  # the weights' columns, and the biases
        want = PartitionSpec(None, "model") if split.params[k].ndim == 2 else PartitionSpec("model")
        assert rules.specs[k] == want, k
    attention = [g for g in rules.groups if g[2] == "attention"]
    assert attention and all(any(".cols" in c for c in g[0]) for g in attention)
    feeds = {"input_ids": np.array([[5, 9, 2]], np.int64)}
    for info in model.inputs:
        if info.name == "attention_mask":
            feeds[info.name] = np.ones((1, 3), np.int64)
        elif info.name == "position_ids":
            feeds[info.name] = np.arange(3, dtype=np.int64)[None]
        elif info.name.startswith("past_key_values."):
            feeds[info.name] = np.zeros((1, info.shape[1], 0, 16), np.float32)
    want = np.asarray(model(feeds)["logits"])
    np.testing.assert_allclose(np.asarray(split(feeds)["logits"]), want, atol=1e-6)


def test_batch_is_padded_up_to_the_data_axis():
    mesh = AbstractMesh((4, 2), ("data", "model"))
    assert [sharding.padded_batch(mesh, b) for b in (1, 4, 6, 8, 9)] == [4, 4, 8, 8, 12]
    assert sharding.padded_batch(AbstractMesh((2,), ("model",)), 3) == 3


def test_model_axes_and_data_axes_larger_than_the_batch():
    """GPT-2's fused q/k/v on a 4-way model axis; batches of 4 and 6 on data axes of 8 and 4
    (padding rows up to a multiple): the single-device tokens."""
    result = _run(
        [
            {"fixture": "gpt2-optimum", "meshes": [[4, 2]], "batch": 6},
            {"fixture": "llama-genai-fp32", "meshes": [[1, 8]], "batch": 4},
        ]
    )
    _check(result)
    assert [c["batch"] for c in result["cases"]] == [6, 8]


def _fused_gemm(path, bias_from_node: bool):
    """x [1, 3, 8] -> Gemm (GPT-2's c_attn: a bias of 3 x 8 features) -> Split in q, k, v; the
    bias read directly, or through a node (which the cut cannot slice)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    bias = "bb" if bias_from_node else "b"
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("Identity", ["b"], ["bb"]),
        helper.make_node("Gemm", ["x2", "W", bias], ["g"], name="c_attn"),
        helper.make_node("Reshape", ["g", "back"], ["g3"]),
        helper.make_node("Split", ["g3", "sizes"], ["q", "k", "v"], axis=2),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 24)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(24).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([-1, 8], np.int64), "flat"),
        numpy_helper.from_array(np.array([1, 3, 24], np.int64), "back"),
        numpy_helper.from_array(np.array([8, 8, 8], np.int64), "sizes"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "qkv"]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    with kernels.off():  # its weights as stored, as load(mesh=...) keeps them
        return tj.load(path)


@pytest.mark.parametrize("bias_from_node", [False, True])
def test_fused_bias_the_cut_cannot_slice_stays_fused(tmp_path, bias_from_node):
    """A fused product whose bias the cut cannot slice (computed by a node) stays one product
    (its columns meet a whole bias otherwise); one whose bias it slices is cut with it."""
    model = _fused_gemm(str(tmp_path / "m.onnx"), bias_from_node)
    split = qkv.split_qkv(model)
    assert (split is model) == bias_from_node
    if not bias_from_node:
        assert {"b.cols0", "b.cols8", "b.cols16"} <= set(split.params)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 8)).astype(np.float32)}
    want, got = model(feeds), split(feeds)
    for name in "qkv":
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), atol=1e-6)


def test_mesh_axes_are_named(tmp_path):
    ctx = context("llama-optimum", tmp_path)
    with pytest.raises(GenerationError, match=r"mesh axes \['x'\]"):
        generation.compile(ctx, 2, mesh=AbstractMesh((1,), ("x",)))
    with pytest.raises(GenerationError, match="needs 6 devices, got 1"):
        sharding.make_mesh(model=3, data=2)


def test_two_processes_give_single_device_tokens():
    """jax.distributed on localhost: 2 processes of 4 CPU devices (gloo), one mesh of model 2 x
    data 4 whose rows span both; each process gets the tokens of its first device alone."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRANSMUTER_JAX_KERNELS"] = "0"
    script = str(ROOT / "tests" / "distributed_child.py")
    runs = [
        subprocess.Popen(
            [sys.executable, script, str(i), str(port), "llama-optimum", "2", "4"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=1800)
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert run.returncode == 0 and lines, err[-4000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    assert results[0]["alone"] == results[1]["alone"]
    for result in results:
        assert result["together"] == result["alone"]


def test_slots_on_a_mesh_give_single_device_tokens():
    """Requests joining the slots at other steps get their single-device tokens and
    log-probabilities on meshes of model and data axes (a text decoder, and Marian's requests
    with their own encoder outputs in a padded grow cache); the slots' cache stays split."""
    meshes = [[2, 4], [8, 1]]
    cases = [{"fixture": f, "meshes": meshes, "slots": True}
             for f in ("llama-optimum", "marian-optimum")]  # fmt: skip
    results = _run(cases)["slots"]
    assert len(results) == 4
    for r in results:
        assert r["tokens"] == r["single"], (r["fixture"], r["mesh"])
        assert r["logprob_gap"] < 1e-4, (r["fixture"], r["mesh"], r["logprob_gap"])
        # the self-attention cache as generate() places it (split on "model" where the heads
        # divide it, on "data" by rows)
        own = {k: v for k, v in r["cache"].items() if "encoder" not in k}
        assert {k: _norm(v) for k, v in own.items()} == {k: _norm(r["placement"][k]) for k in own}
    assert any("model" in v for r in results for v in r["placement"].values())


def test_a_mesh_of_several_processes_refuses_slots_saying_why(tmp_path):
    """The host reads every slot's tokens: slots run on a mesh of one process."""
    import dataclasses
    from types import SimpleNamespace

    devices = np.array([SimpleNamespace(process_index=i) for i in (0, 1)])
    mesh = SimpleNamespace(devices=devices)
    placement = sharding.Placement(mesh, None, {})  # a mesh whose devices span 2 processes
    assert placement.processes == 2
    engine = generation.compile(context("llama-optimum", tmp_path), 2)
    spanning = dataclasses.replace(engine, placement=placement)
    with pytest.raises(ValueError, match="a mesh of one process"):
        spanning.init_state()


def test_overrides_win_over_the_rules(tmp_path):
    """An override replaces the rules' spec (or replication); a wrong one names itself."""
    ctx = _stored("llama-optimum", tmp_path)
    mesh = AbstractMesh((2,), ("model",))
    rules = sharding.find_rules(ctx.model, mesh, head_size=16, small=0)
    sharded = next(k for k, v in rules.specs.items() if v == PartitionSpec(None, "model"))
    row = next(k for k, v in rules.specs.items() if v == PartitionSpec("model", None))
    changed = sharding.find_rules(
        ctx.model, mesh, head_size=16, small=0, overrides={sharded: None, row: (None, "model")}
    )
    assert changed.specs[sharded] == PartitionSpec()
    assert changed.specs[row] == PartitionSpec(None, "model")
    assert {k: v for k, v in changed.specs.items() if k not in (sharded, row)} == {
        k: v for k, v in rules.specs.items() if k not in (sharded, row)
    }
    with pytest.raises(GenerationError, match="'nothing': the model has no such weight"):
        sharding.find_rules(ctx.model, mesh, overrides={"nothing": None})
    with pytest.raises(GenerationError, match="the mesh has no axis 'data'"):
        sharding.find_rules(ctx.model, mesh, overrides={row: ("data",)})
    odd = AbstractMesh((3,), ("model",))
    with pytest.raises(GenerationError, match=f"{row!r}: dimension \\d+ .* axis 'model' of 3"):
        sharding.find_rules(ctx.model, odd, overrides={row: ("model",)})


FAMILIES = [
    "llama-optimum",
    "llama-genai-fp32",
    "llama-genai-int4",
    "gpt2-optimum",
    "qwen2-optimum",
    "qwen2-genai-int4",
    "gemma3-genai-fp32",
    "marian-optimum",
    "whisper-optimum",
    "smolvlm-torch",
    "qwen25vl-genai-fp32",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_mesh_sweep(name):
    """Model axes 2, 4 and 8 and a data axis of 8 for a batch of 4 (padding rows), on every
    fixture family: the single-device tokens."""
    result = _run([{"fixture": name, "meshes": [[2, 4], [4, 2], [8, 1], [1, 8]], "batch": 4}])
    _check(result)
    assert [c["batch"] for c in result["cases"]] == [4, 4, 4, 8]


@pytest.mark.slow
def test_every_family():
    """The other fixture families on model 2 x data 4, with logits processors: Qwen2, Gemma 3 of
    the genai builder (its q/k norms of each head are SimplifiedLayerNormalization nodes, which
    the rules pass), Whisper, the embedding-fed SmolVLM decoder, Qwen2.5-VL's M-RoPE decoder."""
    processors = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}
    names = [
        "qwen2-optimum",
        "qwen2-genai-int4",
        "gemma3-genai-fp32",
        "whisper-optimum",
        "smolvlm-torch",
        "qwen25vl-genai-fp32",
    ]
    result = _run([{"fixture": n, "meshes": [[2, 4]], "options": processors} for n in names])
    assert sorted({c["fixture"] for c in result["cases"]}) == sorted(names)
    _check(result)
