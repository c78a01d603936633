"""grow mode on a padded cache: the rewritten decoder equals the original at exact lengths, the
grow fixtures keep transformers' tokens with a bounded number of compiled shapes, and graphs the
rewrite does not understand keep exact lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest
from generation_cases import FIXTURES, case, context, decoder, encoder_inputs
from onnx import TensorProto, helper, numpy_helper, save

import transmuter_jax as tj
from transmuter_jax import generation, hub
from transmuter_jax.generation import Request
from transmuter_jax.generation import cache as cache_modes
from transmuter_jax.generation.steps import pad_grow, probe_inputs
from transmuter_jax.onnx import rewrite
from transmuter_jax.testing import example_inputs

GROW = {"whisper-optimum": 2, "marian-optimum": 2, "gemma3-optimum": 6}  # decoder layers


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("grow")


def _padded(model: tj.Model, layout) -> rewrite.PaddedPast:
    past = [e.input for e in layout.entries if not e.cross]
    return rewrite.pad_past(model, lambda n: probe_inputs(model, layout, n), past)


def _compare(model, layout, padded, valid, rows, step, pad_value=None) -> dict[str, float]:
    """Max differences of the logits and the valid present rows: the original at ``valid`` past
    tokens (one count for both rows, or one per row: then each row runs alone), the rewritten on
    ``rows`` rows whose first ones are large random padding."""
    counts = [valid, valid] if isinstance(valid, int) else list(valid)
    alike = len(set(counts)) == 1
    runs = [
        example_inputs(
            model, batch=2 if alike else 1, length=step, past=n, encoder_length=6, vocab=8, seed=b
        )  # fmt: skip
        for b, n in enumerate(counts[:1] if alike else counts)
    ]
    wants = [model(inputs) for inputs in runs]
    rng = np.random.default_rng(1)
    feed = {}
    for name in runs[0]:
        parts = []
        for inputs, n in zip(runs, counts, strict=False):
            x = inputs[name]
            if any(e.input == name and not e.cross for e in layout.entries):
                junk = 5 * rng.standard_normal((*x.shape[:2], rows - n, x.shape[3]))
                x = np.concatenate([junk.astype(x.dtype), x], axis=2)
            elif name == "attention_mask":
                x = np.concatenate([np.zeros((x.shape[0], rows - n), x.dtype), x], axis=1)
            parts.append(x)
        apart = not alike and name not in model.static_inputs
        feed[name] = np.concatenate(parts) if apart else parts[0]
    pads = np.array([rows - n for n in counts], np.int64)
    if pad_value is not None:
        pads[:] = pad_value
    feed[padded.input] = pads if padded.per_row else pads[0]
    got = padded.model(feed)
    diff = {"logits": 0.0, "present": 0.0}
    for b, (want, n) in enumerate(zip(wants if not alike else wants * 2, counts, strict=True)):
        w = b if alike else 0  # the row of ``want``
        logits = np.asarray(got["logits"])[b] - want["logits"][w]
        diff["logits"] = max(diff["logits"], float(np.abs(logits).max()))
        for e in layout.entries:
            if not e.cross:
                present = np.asarray(got[e.output])[b, :, rows - n :] - want[e.output][w]
                diff["present"] = max(diff["present"], float(np.abs(present).max()))
    return diff


@pytest.mark.parametrize("name", sorted(GROW))
def test_the_rewrite_finds_positions_and_every_self_attention(name):
    model = decoder(name)
    layout = cache_modes.layout(model, hub.read_json(FIXTURES / name, "config.json"))
    padded = _padded(model, layout)
    assert padded.shifted  # the position embedding (whisper, marian) or rotary angles (gemma3)
    assert len(padded.masked) == GROW[name]
    assert padded.input in {i.name for i in padded.model.inputs}
    assert padded.input not in {i.name for i in model.inputs}  # the original is untouched


@pytest.mark.parametrize("name", sorted(GROW))
@pytest.mark.parametrize(
    ("valid", "rows", "step"),
    [(5, 12, 1), (1, 64, 1), (17, 64, 8), ((5, 9), 12, 1), ((40, 1), 64, 1), ((3, 17), 64, 8)],
)
def test_padded_graph_equals_the_graph_at_exact_length(name, valid, rows, step):
    """Both rows with one count of valid rows, or each its own (a padding per row)."""
    model = decoder(name)
    layout = cache_modes.layout(model, hub.read_json(FIXTURES / name, "config.json"))
    padded = _padded(model, layout)
    assert padded.per_row, padded.shared  # these graphs keep the batch first in their scores
    diff = _compare(model, layout, padded, valid, rows, step)
    assert diff["logits"] < 1e-4 and diff["present"] < 1e-4, diff
    wrong = _compare(model, layout, padded, valid, rows, step, pad_value=0)
    assert wrong["logits"] > 1e-2  # the padding input matters: the comparison can fail


@pytest.mark.parametrize("name", sorted(GROW))
@pytest.mark.parametrize(
    ("case_name", "rule", "shapes"),
    [("greedy", "buckets", 2), ("batch", "buckets", 2), ("batch", "pow2", 3)],
)
def test_grow_fixtures_keep_the_tokens_with_few_shapes(name, case_name, rule, shapes, workdir):
    """greedy: the prompt (8 tokens) in one step of 16, then one decode shape. batch (prompts of
    5, 1, 40 and 9 tokens, in one cache: each row's padding is its own): "buckets" runs them in
    one step of 48 on an empty cache; "pow2" in steps of 32 and 8 (the shorter rows take their
    first tokens in the second); then one decode shape. Exact lengths compile 8 to 43 shapes."""
    the_case = case(name, case_name)
    prompts = the_case["prompts"]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts))))
    options = the_case["options"]
    ctx = context(
        name, workdir, given=given, max_new_tokens=options["max_new_tokens"], prefill=rule
    )
    ctx = generation.compile(ctx, len(prompts))
    assert ctx.compiled.padded, ctx.compiled.unpadded
    out = generation.generate(ctx, prompts, list(range(len(prompts))), inputs)
    assert out == the_case["tokens"]
    assert len(ctx.compiled.steps.shapes) == shapes, sorted(ctx.compiled.steps.shapes)
    assert {key[3] for key in ctx.compiled.steps.shapes} == {64}  # one cache capacity


def test_exact_lengths_stay_available(workdir):
    the_case = case("whisper-optimum", "greedy")
    given, inputs = encoder_inputs("whisper-optimum", the_case, [0])
    ctx = context("whisper-optimum", workdir, given=given, max_new_tokens=6)
    ctx = generation.compile(ctx, 1, grow_cache="exact")
    assert not ctx.compiled.padded and ctx.compiled.grow_cache == "exact"
    out = generation.generate(ctx, the_case["prompts"], [0], inputs)
    assert out == [the_case["tokens"][0][:6]]
    assert len(ctx.compiled.steps.shapes) == 6  # the prompt, then one per cache length


def _toy(folder, variant: str) -> tj.Model:
    """A one-layer grow decoder (vocab 8, one head of 4): attention over past + new keys.

    variant: "plain"; "positions" adds a position embedding of Range(past, past + S);
    "length" adds the past length to the logits; "reduce" adds the sum of the past keys;
    "heads_first" attends with the heads before the batch (scores [H, B, S, keys]).
    """
    rng = np.random.default_rng(0)
    weights = {
        "emb": rng.standard_normal((8, 4)).astype(np.float32),
        "pe": rng.standard_normal((128, 4)).astype(np.float32),
        "out": rng.standard_normal((4, 8)).astype(np.float32),
    }
    const = {"one": np.array([1], np.int64), "two": np.array(2, np.int64)}
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x0"]),
        helper.make_node("Shape", ["past_key_values.0.key"], ["past_shape"]),
        helper.make_node("Gather", ["past_shape", "two"], ["past"]),
    ]
    x = "x0"
    if variant == "positions":
        const |= {"zero": np.array(0, np.int64), "step1": np.array(1, np.int64)}
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
            helper.make_node("Gather", ["ids_shape", "step1"], ["seq"]),
            helper.make_node("Add", ["past", "seq"], ["end"]),
            helper.make_node("Range", ["past", "end", "step1"], ["positions"]),
            helper.make_node("Gather", ["pe", "positions"], ["pos_emb"]),
            helper.make_node("Add", ["x0", "pos_emb"], ["x1"]),
        ]
        x = "x1"
    nodes += [
        helper.make_node("Unsqueeze", [x, "one"], ["k"]),
        helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "k"], ["present.0.value"], axis=2),
    ]
    if variant == "heads_first":
        nodes += [
            helper.make_node("Transpose", ["k"], ["q"], perm=[1, 0, 2, 3]),
            helper.make_node("Transpose", ["present.0.key"], ["kt"], perm=[1, 0, 3, 2]),
            helper.make_node("Transpose", ["present.0.value"], ["v"], perm=[1, 0, 2, 3]),
        ]
    else:
        nodes += [
            helper.make_node("Identity", ["k"], ["q"]),
            helper.make_node("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2]),
            helper.make_node("Identity", ["present.0.value"], ["v"]),
        ]
    nodes += [
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["attended0"]),
        helper.make_node(
            "Squeeze", ["attended0", "one" if variant != "heads_first" else "zero0"], ["h"]
        ),  # fmt: skip
        helper.make_node("MatMul", ["h", "out"], ["logits0"]),
    ]
    const["zero0"] = np.array([0], np.int64)
    extra = {
        "length": [helper.make_node("Cast", ["past"], ["extra"], to=TensorProto.FLOAT)],
        "reduce": [helper.make_node("ReduceSum", ["past_key_values.0.key"], ["extra"], keepdims=0)],
    }.get(variant)
    if extra:
        nodes += [*extra, helper.make_node("Add", ["logits0", "extra"], ["logits"])]
    else:
        nodes.append(helper.make_node("Identity", ["logits0"], ["logits"]))
    cache = ["batch", 1, "past", 4]
    graph = helper.make_graph(
        nodes,
        "toy",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, cache),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 8]),
            helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("present.0.value", TensorProto.FLOAT, None),
        ],
        [numpy_helper.from_array(v, k) for k, v in (weights | const).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / f"{variant}.onnx"
    save(model, path)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 8}))
    return tj.load(path)


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("plain", None),
        ("positions", None),
        ("heads_first", None),
        ("length", "uses a value of the cache length"),
        ("reduce", "padding rows of the cache reach"),
    ],
)
def test_toy_graphs_are_rewritten_or_refused(variant, reason, tmp_path):
    model = _toy(tmp_path, variant)
    # the toy attends without a causal mask: a prompt step padded to a bucket would show its
    # padding to the real tokens, so its prompts run in powers of two (no padding)
    spec = generation.context(tmp_path, model, max_new_tokens=5, prefill="pow2")
    ctx = generation.compile(spec, 2)
    assert ctx.mode == "grow"
    padding, why = pad_grow(ctx)
    if reason is not None:
        assert padding is None and reason in why
        assert not ctx.compiled.padded and reason in ctx.compiled.unpadded
        assert ctx.compiled.grow_cache == "exact"
    else:
        assert padding is not None, why
        assert padding.shifted == (("positions",) if variant == "positions" else ())
        # scores with the heads first: one padding for the batch, and the slots refused
        assert padding.per_row == (variant != "heads_first")
        refusal = "padded by one number of padding rows for the whole batch"
        assert (refusal in ctx.cache_mode.slot_refusal()) == (variant == "heads_first")
        if variant == "heads_first":  # rows of other lengths cannot share a step either
            with pytest.raises(ValueError, match="rows share one padding: a prefill step runs"):
                ctx.begin_prefill([Request((1, 2), max_new_tokens=1)] * 2)
        diff = _compare(model, ctx.cache, padding, 3, 16, 2)
        assert diff["logits"] < 1e-5 and diff["present"] < 1e-5, diff
    prompts = [[1, 2, 3], [4, 5, 6]]
    exact = generation.compile(spec, 2, grow_cache="exact")
    want = generation.generate(exact, prompts, [0, 1])
    assert generation.generate(ctx, prompts, [0, 1]) == want  # padded or not, same tokens
    # Exact: steps of 2 and 1 prompt tokens, then 4 decode steps, each its own cache length.
    assert len(exact.compiled.steps.shapes) == 6
    # Padded: 2 tokens on the empty cache, then 1 token on the 64-row cache (prompt and decode).
    assert len(ctx.compiled.steps.shapes) == (2 if reason is None else 6)


def test_a_bucketed_cache_grows_64_rows_at_a_time(tmp_path):
    model = _toy(tmp_path, "positions")
    prompts = [[1, 2, 3]]
    out = {}
    for policy in ("padded", "buckets"):  # the toy is not causal: prompts in powers of two
        ctx = generation.context(tmp_path, model, max_new_tokens=70, prefill="pow2")
        ctx = generation.compile(ctx, 1, grow_cache=policy)
        assert ctx.compiled.grow_cache == policy
        out[policy] = generation.generate(ctx, prompts, [0])
        shapes = ctx.compiled.steps.shapes
        if policy == "padded":  # the slots: the prompt in 64 rows, then the call's 128
            assert shapes == {(2, 0, False, 64), (1, 64, True, 64), (1, 128, True, 128)}
        else:  # generate()'s own: 64 rows until the cache holds 64 tokens, then 128
            assert shapes == {
                (2, 0, False, 64),
                (1, 64, True, 64),
                (1, 64, True, 128),
                (1, 128, True, 128),
            }
    assert out["buckets"] == out["padded"] and len(out["padded"][0]) == 70


def test_an_unknown_grow_cache_is_refused(workdir):
    with pytest.raises(ValueError, match="grow_cache must be one of"):
        generation.compile(context("whisper-optimum", workdir), 1, grow_cache="fixed")


def test_each_row_keeps_the_rows_that_end_at_its_last_real_token():
    """cache.ending_rows: a padded grow step's present (past rows, then the step's, each row's
    real tokens first) cut to each row's rows ending at its last real one, zeros before."""
    rng = np.random.default_rng(0)
    past, step, rows = 5, 4, 7  # row 0 keeps its last 7 rows of 9; the others fit whole
    present = rng.standard_normal((3, 2, past + step, 3)).astype(np.float32)
    real = np.array([4, 1, 0], np.int32)
    got = np.asarray(cache_modes.ending_rows(present, rows, step, real))
    for b in range(3):
        end = past + real[b]  # rows of ``present`` up to this one are kept
        kept = present[b, :, max(end - rows, 0) : end]
        want = np.concatenate([np.zeros((2, rows - kept.shape[1], 3), np.float32), kept], 1)
        np.testing.assert_array_equal(got[b], want)


def test_a_graph_that_scales_whole_tensors_runs_prompts_at_their_own_length():
    """DynamicQuantizeLinear scales by the whole tensor: padding a prompt step would change the
    real tokens' values, so such a graph's default prefill rule is "exact" (others "buckets")."""
    community = FIXTURES / "whisper-speech-community"
    quantized = tj.load(community / "onnx" / "decoder_model_merged_quantized.onnx")
    assert any(op == "DynamicQuantizeLinear" for _, op in quantized.all_op_types)
    plain = tj.load(community / "onnx" / "decoder_model_merged.onnx")
    given = ("encoder_hidden_states",)
    assert generation.context(community, quantized, given=given).prefill == "exact"
    assert generation.context(community, plain, given=given).prefill == "buckets"
    assert generation.context(community, quantized, given=given, prefill="pow2").prefill == "pow2"
    mode = cache_modes.GrowPadded()
    assert [mode.prompt_step(n, "exact") for n in (3, 37, 600)] == [3, 37, 512]
    assert [mode.prompt_step(n, "buckets") for n in (3, 37, 600)] == [16, 48, 512]
    assert [cache_modes.GrowExact().prompt_step(n, "buckets") for n in (3, 37)] == [2, 32]
