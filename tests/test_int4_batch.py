"""int4 files (MatMulNBits accuracy_level 4, int8 activations by default): a row's greedy tokens
do not depend on the other rows of its batch, on the fixtures and on the default model.

The other rows have prompts of the row's length (prompts of other lengths change how the prompt
is cut into steps, and so the shapes of the attention products)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from generation_cases import FIXTURES, context, reference

from transmuter_jax import generation
from transmuter_jax.onnx.ops.quant import INT8_ENV, int8_activations

INT4 = sorted(p.parent.name for p in FIXTURES.glob("*-genai-int4/reference.json"))


def _levels(path) -> set[int]:
    proto = onnx.load(path, load_external_data=False)
    return {
        a.i
        for n in proto.graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "accuracy_level"
    }


def _rows_alone_and_batched(ctx_one, ctx_batch, prompts, check):
    batched = generation.generate(ctx_batch, prompts, list(range(len(prompts))))
    for i in check:
        assert generation.generate(ctx_one, [prompts[i]], [i])[0] == batched[i], f"row {i}"
    return batched


@pytest.mark.parametrize("name", INT4)
def test_int4_fixture_rows_do_not_depend_on_the_batch(name, tmp_path, monkeypatch):
    monkeypatch.delenv(INT8_ENV, raising=False)
    ref = reference(name)[0]
    assert 4 in _levels(FIXTURES / name / ref["files"]["decoder"]) and int8_activations(4)
    rng = np.random.default_rng(0)
    special = {ref["eos_token_id"], ref["pad_token_id"], ref["bos_token_id"]}
    ids = [i for i in range(ref["vocab_size"]) if i not in special]
    prompts = [rng.choice(ids, 9).tolist() for _ in range(8)]
    new = 24
    options = dict(max_new_tokens=new, min_new_tokens=new)
    one = generation.compile(context(name, tmp_path, **options), 1)
    eight = generation.compile(context(name, tmp_path, **options), 8)
    batched = _rows_alone_and_batched(one, eight, prompts, check=(0, 5))
    assert len({tuple(t) for t in batched}) > 1  # the rows are different problems
    same = generation.generate(eight, [prompts[0]] * 8, list(range(8)))
    assert all(tokens == batched[0] for tokens in same)


@pytest.mark.slow  # ~2 min; the fixtures' int4 rows run in the quick tier
@pytest.mark.default_model
def test_int4_default_model_row_0_equal_at_batch_1_and_8(default_model, monkeypatch):
    """SmolLM2-135M int4 (genai), 64 greedy tokens: the first chat prompt alone, in a batch of 8
    copies, and among 7 other prompts of its length."""
    import transmuter_jax as tj

    monkeypatch.delenv(INT8_ENV, raising=False)
    folder = default_model / "genai-int4"
    cases = json.loads((default_model / "hf" / "reference.json").read_text())["cases"]
    prompt = cases[0]["prompt_ids"]
    others = [c["prompt_ids"] for c in cases[1:]]
    rng = np.random.default_rng(0)
    mixed = [prompt]
    for i in range(7):  # the other prompts cut to the first one's length, then shuffled copies
        ids = list(others[i % len(others)][: len(prompt)])
        if i >= len(others):
            ids[3:] = rng.permutation(ids[3:]).tolist()
        mixed.append(ids)
    model = tj.load(folder / "model.onnx")
    options = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
    one = generation.compile(generation.context(folder, model, **options), 1)
    eight = generation.compile(generation.context(folder, model, **options), 8)
    alone = generation.generate(one, [prompt], [0])[0]
    assert len(alone) == 64
    copies = generation.generate(eight, [prompt] * 8, list(range(8)))
    assert all(tokens == alone for tokens in copies)
    batched = generation.generate(eight, mixed, list(range(8)))
    assert batched[0] == alone
    assert batched[1] == generation.generate(one, [mixed[1]], [0])[0]


def test_xla_computes_each_row_alike_at_any_batch():
    """With the library's compiler options an RMS norm of 8 rows gives each row the bits it gets
    alone (XLA's YNNPACK fusions, off, tile 8 rows otherwise)."""
    import jax
    import jax.numpy as jnp

    from transmuter_jax.runtime.jit import YNN_OPTION, cpu_options, jit_options

    if jax.default_backend() != "cpu" or YNN_OPTION not in cpu_options():
        pytest.skip("XLA CPU with YNNPACK fusions only")
    x = np.random.default_rng(0).standard_normal((8, 1, 576)).astype(np.float32)

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-5)

    fn = jax.jit(norm, **jit_options())
    np.testing.assert_array_equal(np.asarray(fn(x))[:1], np.asarray(fn(x[:1])))
