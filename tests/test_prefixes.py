"""The prefix cache of the slots: a request that starts with a stored prompt gets the tokens and
log-probabilities of a plain prefill; the store stays under its byte bound. Also the per-slot
OpenAI options the server needs (frequency_penalty, logit_bias, min_new_tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from generation_cases import case, context

from transmuter_jax import generation
from transmuter_jax.generation import Request, prefixes
from transmuter_jax.generation import prefill as prefills
from transmuter_jax.generation.prefixes import (
    PrefixCache,
    _row_function,
    cache_bytes_per_token,
    rows_agree,
)

NEW = 8
_ENGINES: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefixes")


def engine(name, workdir):
    if name not in _ENGINES:
        spec = context(name, workdir, max_new_tokens=NEW)
        _ENGINES[name] = generation.compile(spec, 2, capacity=256, top_logprobs=3)
    return _ENGINES[name]


def _run(eng, prefix):
    state = eng.insert(prefix, eng.init_state(), 1)
    out = [prefix.first]
    while state.live_slots:
        state, tokens = eng.generate(state, 4)
        out += tokens
    return [_row(t) for t in out]


def _row(t):
    bits = lambda v: np.float32(v).tobytes()  # noqa: E731 - NaN (no logprobs) equals itself
    return (t.token, t.eos, t.done, t.finish_reason, bits(t.logprob),
            tuple((i, bits(v)) for i, v in t.top))  # fmt: skip


def _prompts(name):
    base = list(case(name, "greedy")["prompts"][0])
    rng = np.random.default_rng(0)
    draw = lambda n: [int(t) for t in rng.integers(4, 64, n)]  # noqa: E731 - in every vocab
    long = base + draw(130 - len(base))  # two whole blocks and a bit
    first = long + [5, 6, 7]
    return {
        "first": first,  # a miss: stores its two whole blocks
        "sibling": long + [9, 8],  # shares them
        "extension": first + draw(70),  # a later chat turn: shares them, stores three
        "short": long[:80] + [3],  # shares one block
        "other": [7] * 30,  # shares nothing
    }


@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-fp32", "qwen2-optimum"])
def test_prefixes_from_the_cache_equal_a_cache_that_misses(name, workdir):
    eng = engine(name, workdir)
    cache, nothing = PrefixCache(eng, max_bytes=1 << 30), PrefixCache(eng, max_bytes=0)
    for key, prompt in _prompts(name).items():
        request = Request(prompt, max_new_tokens=NEW, logprobs=True, top_logprobs=2)
        want = _run(eng, nothing.prefill(request))
        got = _run(eng, cache.prefill(request))
        assert got == want, key  # tokens and log-probabilities, bit for bit
        plain = _run(eng, eng.prefill(request))  # one prefill step: the same tokens
        assert [t[:4] for t in got] == [t[:4] for t in plain], key
    stats = cache.stats
    assert (stats.queries, stats.hits, stats.hit_tokens) == (5, 3, 128 + 128 + 64)
    assert stats.entries == 1  # the extension's three blocks replaced the first's two
    assert stats.bytes == 192 * cache_bytes_per_token(eng)
    assert nothing.stats.hits == 0 and nothing.stats.entries == 0


def test_the_cache_stays_under_its_byte_bound_and_evicts_the_oldest(workdir):
    eng = engine("llama-optimum", workdir)
    per_token = cache_bytes_per_token(eng)
    cache = PrefixCache(eng, max_bytes=2 * 64 * per_token)  # two prompts of one block
    prompts = [[t] * 64 + [1, 2] for t in (3, 4, 5)]
    for p in prompts:
        cache.prefill(Request(p, max_new_tokens=1))
    assert cache.stats.entries == 2 and cache.stats.bytes <= 2 * 64 * per_token
    cache.prefill(Request(prompts[0] + [9], max_new_tokens=1))  # the first was evicted
    cache.prefill(Request(prompts[2] + [9], max_new_tokens=1))  # the last was kept
    assert cache.stats.hits == 1
    nothing = PrefixCache(eng, max_bytes=0)
    nothing.prefill(Request(prompts[0], max_new_tokens=1))
    assert nothing.stats.entries == 0


def test_openai_options_per_slot_equal_their_solo_runs(workdir):
    name = "llama-optimum"
    eng = engine(name, workdir)
    prompts = case(name, "batch")["prompts"]
    greedy = Request(prompts[0], max_new_tokens=NEW, logprobs=True)
    plain = _run(eng, eng.prefill(greedy))
    first = plain[0][0]
    requests = {
        "frequency": Request(prompts[1], max_new_tokens=NEW, frequency_penalty=1.5, logprobs=True),
        "bias": Request(prompts[0], max_new_tokens=4, logit_bias={first + 1: 100.0}),
        "min_new": Request(prompts[0], max_new_tokens=4, eos_token_id=(first,), min_new_tokens=2),
    }
    alone = {k: _run(eng, eng.prefill(r)) for k, r in requests.items()}
    assert [t[0] for t in alone["bias"]] == [first + 1] * 4
    assert alone["min_new"][0][0] != first and len(alone["min_new"]) >= 2
    for key, request in requests.items():  # next to another request
        state = eng.insert(eng.prefill(greedy), eng.init_state(), 0)
        state, _ = eng.generate(state, 2)
        prefix = eng.prefill(request)
        state = eng.insert(prefix, state, 1)
        got = [prefix.first]
        while state.live_slots:
            state, tokens = eng.generate(state, 3)
            got += [t for t in tokens if t.slot == 1]
        assert [_row(t) for t in got] == alone[key], key
    with pytest.raises(ValueError, match="logit_bias takes at most"):
        Request([1], logit_bias={i: 1.0 for i in range(301)})


def test_prompts_run_together_equal_each_alone_bit_for_bit(workdir):
    """prefill_many: prompts of one, two and three blocks, one of them from the cache and one
    sampled, run together (a batch of 4, one padding row) give each one's prefix alone: first
    token, log-probabilities, cache rows; and the rows of a 2- and 4-row step agree on this
    machine (what the server checks at start-up)."""
    name = "llama-optimum"
    spec = context(name, workdir, max_new_tokens=NEW)
    eng = generation.compile(spec, 4, capacity=256, top_logprobs=3)
    assert rows_agree(eng, 2) and rows_agree(eng, 4)
    p = _prompts(name)
    requests = [
        Request(p["sibling"], max_new_tokens=NEW, logprobs=True, top_logprobs=2),
        Request(p["other"], max_new_tokens=NEW, do_sample=True, seed=7, logprobs=True),
        Request(p["extension"], max_new_tokens=NEW, logprobs=True, top_logprobs=2),
    ]
    nothing = PrefixCache(eng, max_bytes=0)
    alone = [nothing.prefill(r) for r in requests]
    cache = PrefixCache(eng, max_bytes=1 << 30)
    cache.prefill(Request(p["first"], max_new_tokens=1))  # stores two blocks
    together = cache.prefill_many(requests)
    assert cache.stats.hits == 2  # the sibling and the extension start with them
    for a, b in zip(together, alone, strict=True):
        n = len(a.request.prompt)
        for key in a.rows.cache:
            assert np.array_equal(a.rows.cache[key][:, :, :n], b.rows.cache[key][:, :, :n])
        assert _run(eng, a) == _run(eng, b)  # every token and log-probability


@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-fp32"])
def test_a_prompt_prefilled_in_a_window_over_a_long_requests_rows_equals_its_solo_run(
    name, workdir
):
    """A short prompt runs in a cache of its step's rows (not the slots' 256) and goes into a slot
    whose other rows still hold a long finished request's keys and values: the mask hides them,
    and its tokens and log-probabilities equal those of a fresh slot, bit for bit."""
    eng = engine(name, workdir)
    nothing = PrefixCache(eng, max_bytes=0)
    vocab = eng.vocab_size
    long = Request([(5 + 7 * i) % vocab for i in range(150)], max_new_tokens=NEW, logprobs=True)
    short = Request(list(case(name, "greedy")["prompts"][0]), max_new_tokens=NEW,
                    logprobs=True, top_logprobs=3)  # fmt: skip
    prefix = nothing.prefill(short)
    own = prefixes.width(eng, len(short.prompt))  # its one step's rows, not 256
    assert own < 64 and {a.shape[2] for a in prefix.rows.cache.values()} == {own}
    assert {a.shape[2] for a in nothing.prefill(long).rows.cache.values()} == {256}
    alone = _run(eng, prefix)
    state = eng.insert(nothing.prefill(long), eng.init_state(), 1)
    while state.live_slots:
        state, _ = eng.generate(state, 4)
    state = eng.free(state, 1)
    prefix = nothing.prefill(short)
    state = eng.insert(prefix, state, 1)
    got = [prefix.first]
    while state.live_slots:
        state, tokens = eng.generate(state, 4)
        got += tokens
    assert [_row(t) for t in got] == alone


def test_prefill_windows_and_a_stored_prompt_longer_than_the_window():
    assert prefills.windows(1024) == [64, 256, 1024] and prefills.windows(64) == [64]
    assert prefills.windows(200) == [64, 200]
    assert [prefills.window(n, 1024) for n in (1, 64, 65, 256, 257, 5000)] == [
        64, 64, 256, 256, 1024, 1024,
    ]  # fmt: skip
    cache = {"k": jnp.zeros((2, 1, 64, 2), jnp.float32)}
    stored = {"k": jnp.arange(128 * 2, dtype=jnp.float32).reshape(1, 1, 128, 2)}
    out = _row_function()(cache, stored, jnp.int32(1))["k"]
    assert np.array_equal(out[1], stored["k"][0, :, :64]) and not np.asarray(out[0]).any()


@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-fp32"])
def test_a_prompt_of_one_block_runs_in_one_step_of_its_bucket_as_slots_prefill_does(name, workdir):
    """A prompt of at most 64 tokens runs in one step of its prompt bucket (37 tokens: 48), the
    width slots.prefill runs it in, so its prefix equals slots.prefill's bit for bit; prompts of
    other widths run beside it in steps of their own, and each equals its run alone."""
    eng = engine(name, workdir)
    vocab = eng.vocab_size
    prompt = [(11 + 5 * i) % vocab for i in range(37)]
    request = Request(prompt, max_new_tokens=NEW, logprobs=True, top_logprobs=3)
    assert prefixes.width(eng, 37) == 48 and prefixes.width(eng, 64) == 64
    assert prefixes.width(eng, 65) == prefixes.BLOCK and prefixes.width(eng, 1) == 16
    nothing = PrefixCache(eng, max_bytes=0)
    before = set(eng.compiled.steps.shapes)
    mine = nothing.prefill(request)
    ran = set(eng.compiled.steps.shapes) - before
    assert all(shape[0] == 48 for shape in ran), ran  # steps of 48 tokens only
    theirs = eng.prefill(request)
    assert _row(mine.first) == _row(theirs.first)
    for key in mine.rows.cache:
        got, want = mine.rows.cache[key][:, :, :37], theirs.rows.cache[key][:, :, :37]
        assert np.array_equal(got, want), key
    assert _run(eng, mine) == _run(eng, theirs)
    others = [
        Request(prompt[:20], max_new_tokens=NEW, logprobs=True),  # 32 tokens
        Request(prompt * 2, max_new_tokens=NEW, logprobs=True),  # two blocks
    ]
    together = nothing.prefill_many([request, *others])
    for got, alone in zip(together, [mine] + [nothing.prefill(r) for r in others], strict=True):
        assert _row(got.first) == _row(alone.first)
        n = len(got.request.prompt)
        for key in got.rows.cache:
            assert np.array_equal(got.rows.cache[key][:, :, :n], alone.rows.cache[key][:, :, :n])


def test_after_the_warm_up_the_moves_between_windows_compile_nothing(workdir, caplog):
    """prefixes.warm compiles every move a server's requests make between windows: a short
    prompt's prefix put into slots that hold a long request's window, and the slots resized
    down and up again (no request waits for a compile)."""
    spec = context("llama-optimum", workdir, max_new_tokens=NEW)
    eng = generation.compile(spec, 2, capacity=256, top_logprobs=3)
    state = prefixes.warm(eng, eng.init_state(), [1, 2])
    vocab = eng.vocab_size
    cache = PrefixCache(eng, max_bytes=0)
    long = cache.prefill(Request([(3 + i) % vocab for i in range(150)], max_new_tokens=NEW))
    short = cache.prefill(Request([(7 + i) % vocab for i in range(30)], max_new_tokens=NEW))
    with jax.log_compiles(), caplog.at_level("WARNING"):
        caplog.clear()
        state = eng.insert(long, state, 0)  # the slots grow to the long prompt's window
        state = eng.insert(short, state, 1)  # a 64-row prefix into 256-row slots
        for rows in (64, 128, 256, 64):
            state = eng.free(state, 0) if rows == 64 and 0 in state.live_slots else state
            state = generation.slots.resized(eng, state, max(rows, 64))
    compiled = [r.getMessage()[:80] for r in caplog.records if "Compiling" in r.getMessage()]
    assert not [c for c in compiled if "insert" in c or "resize" in c], compiled
