"""Generation: sampling, compiled shapes, options, on_token, prompt_inputs and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from generation_cases import FIXTURES, case, context, decoder

from transmuter_jax import generation

LLAMA = "llama-optimum"  # append
GQA = "llama-genai-fp32"  # in_place


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("generation-api")


def _prompts():
    return case(LLAMA, "batch")["prompts"]


@pytest.mark.parametrize("name", [LLAMA, GQA])
def test_sampling_is_reproducible_and_rows_are_independent(name, workdir):
    prompts = _prompts()[:3]
    options = dict(do_sample=True, temperature=1.5, top_k=40, top_p=0.95, max_new_tokens=12)
    ctx = generation.compile(context(name, workdir, eos_token_id=[], **options), 3)
    first = generation.generate(ctx, prompts, [1, 2, 3])
    assert generation.generate(ctx, prompts, [1, 2, 3]) == first
    assert generation.generate(ctx, prompts, [4, 5, 6]) != first
    # A row's tokens depend on its prompt and seed only, not on the other rows of its batch.
    alone = generation.generate(ctx, [prompts[1]], [2])
    assert alone[0] == first[1]
    assert all(len(row) == 12 for row in first)


def test_a_long_prompt_in_append_compiles_at_most_four_step_shapes(workdir):
    prompt = (_prompts()[2] * 2)[:45]
    ctx = generation.compile(context(LLAMA, workdir, max_new_tokens=20, eos_token_id=[]), 1)
    out = generation.generate(ctx, [prompt], [0])
    assert len(out[0]) == 20
    assert ctx.compiled.shapes <= 4  # 32, 8, 4 and 1 tokens over one buffer


def test_a_long_prompt_gives_the_tokens_of_a_prompt_run_whole(workdir):
    # Chunks of 32, 8, 4, 1 and a single 45-token prompt step predict the same first token.
    prompt = (_prompts()[2] * 2)[:45]
    ctx = generation.compile(context(GQA, workdir, max_new_tokens=1, eos_token_id=[]), 1)
    logits = np.asarray(
        decoder(GQA)(
            {
                "input_ids": np.array([prompt]),
                "attention_mask": np.ones((1, 45), np.int64),
                **{
                    e.input: np.zeros((1, e.heads, 0, e.head_size), np.float32)
                    for e in ctx.cache.entries
                },
            }
        )["logits"]
    )
    assert generation.generate(ctx, [prompt], [0])[0] == [int(logits[0, -1].argmax())]


def test_on_token_reports_each_step(workdir):
    prompts = _prompts()[:2]
    seen = []
    ctx = generation.compile(context(LLAMA, workdir, max_new_tokens=5, eos_token_id=[]), 3)
    out = generation.generate(ctx, prompts, [0, 0], on_token=lambda e: seen.append(e))
    tokens = np.stack([e["token"] for e in seen])  # [steps, rows]
    assert tokens.shape[1] == 2
    for row in range(2):
        assert [t for t in tokens[:, row] if t >= 0] == out[row]
    assert seen[-1]["finished"].all()
    assert not seen[0]["finished"].any()


def test_eos_stops_a_row_and_is_not_returned(workdir):
    greedy = case(LLAMA, "greedy")
    assert greedy["stopped_at_eos"] == [True]
    ctx = generation.compile(context(LLAMA, workdir, max_new_tokens=16), 1)
    assert generation.generate(ctx, greedy["prompts"], [0]) == greedy["tokens"]
    # eos_token_id=[]: no eos, the row runs to max_new_tokens through the former eos.
    ctx = generation.compile(context(LLAMA, workdir, max_new_tokens=16, eos_token_id=[]), 1)
    out = generation.generate(ctx, greedy["prompts"], [0])[0]
    eos = reference_eos(LLAMA)
    assert len(out) == 16 and out[: len(greedy["tokens"][0])] == greedy["tokens"][0]
    assert out[len(greedy["tokens"][0])] == eos


def reference_eos(name: str) -> int:
    return json.loads((FIXTURES / name / "generation_config.json").read_text())["eos_token_id"]


def test_options_merge_over_the_file_as_generation_config_update(workdir):
    ctx = context(LLAMA, workdir)
    assert ctx.options.eos_token_id == (reference_eos(LLAMA),)
    assert ctx.options.max_length == 256 and ctx.options.do_sample is False
    ctx = context(LLAMA, workdir, eos_token_id=None, pad_token_id=7, top_k=None)
    assert ctx.options.eos_token_id == () and ctx.options.pad_token_id == 7
    assert ctx.options.top_k is None
    with pytest.raises(
        ValueError, match="unknown generation option 'max_new_token'; did you mean 'max_new_tokens'"
    ):
        context(LLAMA, workdir, max_new_token=3)


def test_max_new_tokens_follows_the_pipelines_rule(tmp_path):
    folder = FIXTURES / "whisper-optimum"  # max_length 128 in its generation_config.json
    assert generation.max_new_tokens(folder, 3) == 125
    assert generation.max_new_tokens(folder, 3, max_new_tokens=7) == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": 20}))
    assert generation.max_new_tokens(tmp_path, 3) == 256
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 9}))
    assert generation.max_new_tokens(tmp_path, 3) == 9
    (tmp_path / "generation_config.json").write_text("{}")
    assert generation.max_new_tokens(tmp_path, 3) == 256


def test_outputs_keeps_logits_and_presents():
    names = ["logits", "present.0.key", "cross_attentions.0", "present.0.value", "hidden"]
    assert generation.outputs(names) == ["logits", "present.0.key", "present.0.value"]


@pytest.mark.parametrize("name", ["whisper-optimum", LLAMA, GQA])
def test_prompt_inputs_run_the_decoder_over_padded_text(name):
    model = decoder(name)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    inputs, static = generation.prompt_inputs(model, 2, 5, config)
    assert "input_ids" not in inputs
    if "use_cache_branch" in {i.name for i in model.inputs}:
        assert static == {"use_cache_branch": np.array([False])}
        inputs["encoder_hidden_states"] = np.zeros((2, 32, 64), np.float32)
    logits = model({**inputs, **static, "input_ids": np.ones((2, 5), np.int64)})["logits"]
    assert logits.shape[:2] == (2, 5)


def test_bad_input_gets_clear_errors(workdir):
    ctx = context(LLAMA, workdir, max_new_tokens=2)
    with pytest.raises(ValueError, match="compile"):
        generation.generate(ctx, [[1, 2]], [0])
    ctx = generation.compile(ctx, 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generation.generate(ctx, [[1, 512]], [0])
    with pytest.raises(ValueError, match="seeds has 1 values for 2 prompts"):
        generation.generate(ctx, [[1], [2]], [0])
    with pytest.raises(ValueError, match="3 prompts but the context is compiled for batches of 2"):
        generation.generate(ctx, [[1], [2], [3]], [0, 0, 0])
    with pytest.raises(ValueError, match="more than the model.s 256 positions"):
        generation.generate(ctx, [[1] * 300], [0])
    with pytest.raises(ValueError, match="batch_size"):
        generation.compile(ctx, 0)


def test_a_missing_given_input_is_named(workdir):
    ctx = context("whisper-optimum", workdir, given=("encoder_hidden_states",), max_new_tokens=2)
    ctx = generation.compile(ctx, 1)
    with pytest.raises(ValueError, match="missing input 'encoder_hidden_states'"):
        generation.generate(ctx, [[5]], [0])
    with pytest.raises(ValueError, match="not inputs of the decoder"):
        context("whisper-optimum", workdir, given=("nope",))


def test_a_decoder_of_embeddings_needs_its_embed_model():
    with pytest.raises(ValueError, match="embed="):
        generation.context(FIXTURES / "qwen25vl-genai-fp32", decoder("qwen25vl-genai-fp32"))


@pytest.mark.parametrize("name", [LLAMA, GQA])
def test_device_memory_does_not_grow_with_the_tokens(name, workdir):
    import jax

    counts = []
    ctx = generation.compile(context(name, workdir, max_new_tokens=64, eos_token_id=[]), 2)
    generation.generate(
        ctx, _prompts()[:2], [0, 0], on_token=lambda e: counts.append(len(jax.live_arrays()))
    )
    assert len(counts) >= 64
    # the cache, the chunk the device runs ahead of the one read (none in the last) and
    # nothing that piles up
    assert max(counts[4:]) == counts[4]
    assert len(set(counts[4:])) <= 2


def test_the_next_chunk_is_dispatched_before_the_tokens_of_one_are_read(workdir, monkeypatch):
    """generate() keeps the device a chunk ahead of the host, and dispatches none past the
    rows' max_new_tokens; the tokens are those of one chunk at a time (decode_steps=1 runs no
    chunk ahead: each step is its own program call, read before the next)."""
    from transmuter_jax.generation import slots

    calls = []
    launch, finish = slots.launch, slots.finish

    def launched(*args, **kwargs):
        state, chunk = launch(*args, **kwargs)
        calls.append(("launch", chunk))
        return state, chunk

    def finished(state, chunk):
        calls.append(("finish", chunk))
        return finish(state, chunk)

    monkeypatch.setattr(slots, "launch", launched)
    monkeypatch.setattr(slots, "finish", finished)
    options = dict(max_new_tokens=13, eos_token_id=[], do_sample=True, top_k=20)
    prompts = _prompts()[:2]
    out = generation.generate(
        generation.compile(context(GQA, workdir, decode_steps=4, **options), 2), prompts, [5, 6]
    )
    # 12 tokens after the prompt's: chunks of 4, 4 and 4
    assert [kind for kind, _ in calls] == ["launch", "launch", "finish", "launch", "finish",
                                           "finish"]  # fmt: skip
    order = [chunk for kind, chunk in calls if kind == "launch"]
    assert [chunk for kind, chunk in calls if kind == "finish"] == order  # read in order
    one = generation.compile(context(GQA, workdir, decode_steps=1, **options), 2)
    assert generation.generate(one, prompts, [5, 6]) == out


def test_the_callers_inputs_are_not_deleted(workdir):
    import jax.numpy as jnp

    states = jnp.zeros((1, 32, 64), jnp.float32)
    ctx = context("whisper-optimum", workdir, given=("encoder_hidden_states",), max_new_tokens=3)
    ctx = generation.compile(ctx, 1)
    generation.generate(ctx, [[5]], [0], {"encoder_hidden_states": states})
    assert not states.is_deleted() and float(states.sum()) == 0.0


def test_a_hub_id_resolves_offline_from_the_local_cache(tmp_path, monkeypatch):
    import shutil

    from transmuter_jax import hub

    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(FIXTURES / LLAMA / name, snapshot / name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert hub.read_json("org/tiny", "config.json")["model_type"] == "llama"
    ctx = generation.context("org/tiny", decoder(LLAMA), max_new_tokens=3)
    assert ctx.options.eos_token_id == (reference_eos(LLAMA),)
    with pytest.raises(ValueError, match="org/missing"):
        hub.folder("org/missing")
