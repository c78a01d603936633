"""Several requests' prompts in one prefill step, and a long prompt's chunks between decode
chunks: each request gets the tokens it gets from its own prefill, and transformers' tokens."""

from __future__ import annotations

import numpy as np
import pytest
from generation_cases import case, context

from transmuter_jax import generation
from transmuter_jax.generation import Request

NEW = 6


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefill_many")


def _engine(name, workdir, capacity=128):
    spec = context(name, workdir, max_new_tokens=NEW)
    return generation.compile(spec, 4, capacity=capacity, top_logprobs=2)


def _run(eng, prefixes, steps=3):
    """Each prefix's tokens (first included), run side by side in the slots."""
    state, got = eng.init_state(), {}
    for slot, prefix in enumerate(prefixes):
        state = eng.insert(prefix, state, slot)
        got[slot] = [prefix.first] if prefix.first is not None else []
    while state.live_slots:
        state, tokens = eng.generate(state, steps)
        for t in tokens:
            got[t.slot].append(t)
    return [[(t.token, t.eos, t.done, t.finish_reason) for t in got[s]] for s in sorted(got)]


def _logprobs(eng, prefixes):
    state = eng.init_state()
    out = {s: [p.first.logprob] for s, p in enumerate(prefixes)}
    for slot, prefix in enumerate(prefixes):
        state = eng.insert(prefix, state, slot)
    while state.live_slots:
        state, tokens = eng.generate(state, 4)
        for t in tokens:
            out[t.slot].append(t.logprob)
    return [out[s] for s in sorted(out)]


@pytest.mark.parametrize("name", ["llama-genai-fp32", "llama-optimum", "gemma3-optimum"])
def test_prompts_prefilled_together_equal_their_own_prefills_and_transformers(name, workdir):
    eng = _engine(name, workdir)
    greedy = case(name, "greedy")
    prompts = case(name, "batch")["prompts"]
    requests = [
        Request(greedy["prompts"][0], max_new_tokens=NEW, logprobs=True),
        Request(prompts[1], do_sample=True, top_k=20, seed=5, max_new_tokens=NEW, logprobs=True),
        Request(prompts[2 % len(prompts)], max_new_tokens=0),
    ]
    together = eng.prefill_many(requests)
    alone = [eng.prefill(r) for r in requests]
    assert _run(eng, together) == _run(eng, alone)
    assert together[2].first is None
    tokens = [t for t, eos, *_ in _run(eng, together)[0] if not eos]
    assert tokens == greedy["tokens"][0][:NEW]  # transformers' greedy tokens
    a, b = _logprobs(eng, together[:2]), _logprobs(eng, alone[:2])
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


# 150 tokens = 64 + 64 + 22 (padded to 32; a grow cache drops the padding after each row)
@pytest.mark.parametrize(("name", "steps"), [("llama-optimum", 3), ("gemma3-optimum", 3)])
def test_a_long_prompt_in_chunks_between_decode_chunks_gives_its_own_prefills_tokens(
    name, steps, workdir
):
    eng = _engine(name, workdir, capacity=256)
    vocab = eng.vocab_size
    rng = np.random.default_rng(0)
    long = Request(tuple(int(t) for t in rng.integers(3, vocab, 150)), max_new_tokens=NEW)
    short = Request(case(name, "greedy")["prompts"][0], max_new_tokens=NEW)
    alone = _run(eng, [eng.prefill(short), eng.prefill(long)])
    state = eng.insert(eng.prefill(short), eng.init_state(), 0)
    got = {0: [], 1: []}
    pending = eng.begin_prefill([long], chunk=64)
    chunks = 0
    while not pending.done:
        pending = eng.advance_prefill(pending)  # a chunk of at most 64 tokens
        chunks += 1
        state, tokens = eng.generate(state, 1)  # the running slot decodes between the chunks
        got[0] += tokens
    assert chunks == steps
    (prefix,) = eng.end_prefill(pending)
    state = eng.insert(prefix, state, 1)
    got[1].append(prefix.first)
    while state.live_slots:
        state, tokens = eng.generate(state, 3)
        for t in tokens:
            got[t.slot].append(t)
    first = alone[0][:1]  # the short request's first token came from its prefix
    mine = [[(t.token, t.eos, t.done, t.finish_reason) for t in got[s]] for s in (0, 1)]
    assert first + mine[0] == alone[0] and mine[1] == alone[1]


def test_bad_requests_are_refused_by_index(workdir):
    eng = _engine("llama-optimum", workdir)
    good = Request((1, 2, 3), max_new_tokens=2)
    with pytest.raises(ValueError, match="request 1 needs .*capacity of 128"):
        eng.prefill_many([good, Request((1, 2, 3), max_new_tokens=500)])
    with pytest.raises(ValueError, match="at least one request"):
        eng.prefill_many([])
    with pytest.raises(ValueError, match="chunk must be a multiple of 64"):
        eng.begin_prefill([good], chunk=100)
    pending = eng.begin_prefill([good])
    with pytest.raises(ValueError, match="not all fed"):
        eng.end_prefill(pending)
