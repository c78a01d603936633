"""Speculative decoding by prompt lookup: greedy with drafts gives plain greedy's tokens on every
fixture family and cache mode, wherever a row ends (eos, max_new_tokens, a stop string) inside an
accepted run; sampled, plain sampling's tokens for the seed; slots that speculate and slots that
do not share a batch; bad options and grow caches are refused."""

from __future__ import annotations

import numpy as np
import pytest
from generation_cases import FIXTURES, case, context, tiered

from transmuter_jax import generation
from transmuter_jax.generation import Request, slot_loop, speculative

IN_PLACE = ["llama-genai-fp32", "qwen2-genai-fp32", "gemma3-genai-fp32", "llama-genai-int4",
            "qwen2-genai-int4", "gemma3-genai-int4", "granite-genai-fp32", "mistral-genai-fp32",
            "mistral-window-genai-fp32", "phi3-genai-fp32", "qwen3-genai-fp32"]  # fmt: skip
APPEND = ["llama-optimum", "qwen2-optimum", "gpt2-optimum", "cohere-optimum", "falcon-optimum",
          "gpt-neox-optimum", "granite-optimum", "mistral-optimum", "olmo2-optimum",
          "opt-optimum", "qwen3-optimum", "smollm3-optimum", "stablelm-optimum"]  # fmt: skip
GROW = ["bloom-optimum", "gemma2-optimum", "gemma3-optimum", "mistral-window-optimum",
        "phi3-optimum"]  # fmt: skip
FAST = ["llama-optimum", "llama-genai-fp32"]  # one of each mode in the quick tier
NEW = 20
LOOKUP = 4


def _tiered(names, fast=FAST):
    """The quick tier runs the names in ``fast``; the others are marked slow."""
    return [tiered(n, quick=n in fast, id=n) for n in names]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("speculative")


@pytest.fixture(autouse=True)
def free_rows(monkeypatch):
    """Verifications priced as where rows cost nothing (an accelerator's long steps): every
    draft is verified and no slot pauses, so the random fixtures' drafts run (the CPU's
    pricing, which drafts less, has a test of its own)."""
    monkeypatch.setattr(speculative, "ROW_COST", {"cpu": 1e9})


def _prompts(name):
    """The batch case's prompts, each also followed by a copy of itself (drafts that hit)."""
    prompts = [list(p) for p in case(name, "batch")["prompts"]]
    return [prompts[0], prompts[0] + prompts[0], prompts[-1] + prompts[-1][:3] + prompts[-1]]


@pytest.mark.parametrize("name", _tiered(IN_PLACE + APPEND, ["llama-optimum"]))
def test_generate_with_prompt_lookup_equals_plain_greedy(name, workdir):
    prompts = _prompts(name)
    options = dict(max_new_tokens=NEW, token_logprobs=True)
    plain = generation.compile(context(name, workdir, **options), len(prompts))
    spec = generation.compile(
        context(name, workdir, prompt_lookup_num_tokens=LOOKUP, max_matching_ngram_size=3,
                **options),
        len(prompts),
    )  # fmt: skip
    want = generation.generate(plain, prompts, [0] * len(prompts))
    got = generation.generate(spec, prompts, [0] * len(prompts))
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose([p for _, p in a], [p for _, p in b], rtol=1e-4, atol=1e-4)
    rows = [(p, NEW, 0) for p in prompts]
    _, stats = slot_loop.run(spec, rows)
    assert stats.accepted > 0 and stats.drafted >= stats.accepted  # drafts were kept
    assert stats.steps + stats.accepted == stats.tokens


@pytest.mark.parametrize("name", _tiered(["llama-genai-fp32", "qwen2-optimum"]))
def test_processors_apply_at_every_verified_position(name, workdir):
    prompts = _prompts(name)
    options = dict(max_new_tokens=NEW, repetition_penalty=1.2, no_repeat_ngram_size=4,
                   min_new_tokens=6, sequence_bias=[[[prompts[1][-1]], 2.0]])  # fmt: skip
    plain = generation.compile(context(name, workdir, **options), len(prompts))
    spec = generation.compile(
        context(name, workdir, prompt_lookup_num_tokens=6, max_matching_ngram_size=1, **options),
        len(prompts),
    )
    want = generation.generate(plain, prompts, [0] * len(prompts))
    assert generation.generate(spec, prompts, [0] * len(prompts)) == want
    _, stats = slot_loop.run(spec, [(p, NEW, 0) for p in prompts])
    assert stats.drafted > 0


# -- the slots: cuts inside accepted runs -------------------------------------------------------

_ENGINES: dict = {}


def _engine(name, workdir, **options):
    key = (name, tuple(sorted(options.items())))
    if key not in _ENGINES:
        spec = context(name, workdir, max_new_tokens=NEW, **options)
        _ENGINES[key] = generation.compile(spec, 3, capacity=128, top_logprobs=2)
    return _ENGINES[key]


def _solo(eng, request, steps=3):
    state = eng.init_state()
    prefix = eng.prefill(request)
    state = eng.insert(prefix, state, 1)
    tokens = [prefix.first] if prefix.first is not None else []
    while state.live_slots:
        state, more = eng.generate(state, steps)
        tokens += more
    return [(t.token, t.eos, t.done, t.finish_reason) for t in tokens], tokens, state


def _lookup(request, k=LOOKUP, n=2):
    return Request(**{**request.__dict__, "prompt_lookup_num_tokens": k,
                      "max_matching_ngram_size": n})  # fmt: skip


@pytest.mark.parametrize("name", _tiered(IN_PLACE[:3] + APPEND[:3], ["llama-genai-fp32"]))
def test_every_cut_inside_accepted_runs_equals_plain(name, workdir):
    eng = _engine(name, workdir)
    for prompt in _hitting(eng, name):  # a prompt whose drafts are accepted
        plain, _, _ = _solo(eng, Request(prompt, max_new_tokens=NEW))
        ran, _, state = _solo(eng, _lookup(Request(prompt, max_new_tokens=NEW)))
        assert ran == plain
        if speculative.stats(state, 1).accepted > 0:
            break
    else:
        raise AssertionError("no prompt had drafts accepted")
    tokens = [t for t, *_ in plain]
    for m in range(1, NEW + 1):  # max_new_tokens reached at every position
        request = Request(prompt, max_new_tokens=m)
        assert _solo(eng, _lookup(request))[0] == _solo(eng, request)[0], m
    for e, token in enumerate(tokens):  # an eos id at every position where it first occurs
        if token in tokens[:e]:
            continue
        request = Request(prompt, max_new_tokens=NEW, eos_token_id=(token,))
        got = _solo(eng, _lookup(request))[0]
        assert got == _solo(eng, request)[0] and got[-1] == (token, True, True, "stop"), e


def _hitting(eng, name):
    """Prompts to try for drafts that hit: the copies, then each prompt followed by its greedy
    continuation and itself again (the continuation is often repeated)."""
    yield from _prompts(name)
    for prompt in _prompts(name):
        more = [t for t, eos, *_ in _solo(eng, Request(prompt, max_new_tokens=NEW))[0] if not eos]
        yield prompt + more + prompt


def test_drafts_hit_at_the_first_step_and_k_adapts(workdir):
    name = "llama-optimum"
    eng = _engine(name, workdir)
    # a prompt that ends inside a greedy run, where its last token and the first new one occur
    # before, first followed by the next greedy token: the first step's draft hits
    for prompt in [list(p) for p in case(name, "batch")["prompts"]] + _prompts(name):
        row = prompt + [t for t, *_ in _solo(eng, Request(prompt, max_new_tokens=NEW))[0]]
        cuts = [j for j in range(len(prompt) + 1, len(row) - 2) if _hit(row, j)]
        if cuts:
            cut = cuts[0]
            break
    request = _lookup(Request(row[:cut], max_new_tokens=NEW), k=8)
    state = eng.init_state()
    state = eng.insert(eng.prefill(request), state, 0)
    state, got = eng.generate(state, 1)
    first = speculative.stats(state, 0)
    assert first.steps == 1 and first.accepted > 0 and len(got) == first.accepted + 1
    assert [t.token for t in got] == row[cut + 1 : cut + 1 + len(got)]
    k = np.asarray(state.rows.drafts.k)[0]
    assert (k == 8) == (first.accepted == first.drafted)  # all kept: k grew (capped at 8)


def _hit(row, j):
    """Whether the first earlier match of row[j - 1 : j + 1] drafts row[j + 1] (prompt lookup)."""
    first = next((i for i in range(j - 1) if row[i : i + 2] == row[j - 1 : j + 1]), None)
    return first is not None and row[first + 2] == row[j + 1]


def test_stop_strings_inside_accepted_runs_equal_plain(workdir):
    from transmuter_jax.generation.context import folder_texts

    name = "llama-optimum"
    texts = folder_texts(FIXTURES / name)
    spec = generation.context(FIXTURES / name, context(name, workdir).model,
                              max_new_tokens=NEW, tokenizer=_Texts(texts))  # fmt: skip
    eng = generation.compile(spec, 2, capacity=128)
    prompt = _prompts(name)[1]
    plain, _, _ = _solo(eng, Request(prompt, max_new_tokens=NEW))
    tokens = [t for t, *_ in plain]
    tried = 0
    for e in range(1, len(tokens)):
        stop = (texts[tokens[e - 1]] or "") + (texts[tokens[e]] or "")
        if not stop.strip():
            continue
        request = Request(prompt, max_new_tokens=NEW, stop_strings=(stop,))
        want = _solo(eng, request)[0]
        assert _solo(eng, _lookup(request))[0] == want, e
        tried += want[-1][3] == "stop"
    assert tried


class _Texts:
    def __init__(self, texts):
        self.token_texts = texts


@pytest.mark.parametrize("name", _tiered(["llama-optimum", "llama-genai-fp32"], ["llama-optimum"]))
def test_speculating_and_plain_slots_share_a_batch(name, workdir):
    eng = _engine(name, workdir)
    prompts = _prompts(name)
    sampled = dict(do_sample=True, temperature=0.8, top_k=20, seed=5, logprobs=True)
    requests = [
        _lookup(Request(prompts[1], max_new_tokens=NEW, logprobs=True, top_logprobs=2)),
        Request(prompts[2], max_new_tokens=NEW - 3, repetition_penalty=1.3),
        _lookup(Request(prompts[2], max_new_tokens=NEW, **sampled), k=6, n=1),
    ]
    alone = []
    for r in requests:  # the plain run of each request, alone
        plain = Request(**{**r.__dict__, "prompt_lookup_num_tokens": 0})
        alone.append(_solo(eng, plain)[1])
    state = eng.init_state()
    got: dict = {}
    for slot, r in enumerate(requests):
        prefix = eng.prefill(r)
        got[slot] = [prefix.first]
        state = eng.insert(prefix, state, slot)
    while state.live_slots:
        state, tokens = eng.generate(state, 2)
        for t in tokens:
            got[t.slot].append(t)
    for slot, want in enumerate(alone):
        assert [t.token for t in got[slot]] == [t.token for t in want], slot
        assert [t.finish_reason for t in got[slot]] == [t.finish_reason for t in want]
        np.testing.assert_allclose(
            [t.logprob for t in got[slot]], [t.logprob for t in want], rtol=1e-4, atol=1e-4
        )
    assert speculative.stats(state, 0).drafted > 0 and speculative.stats(state, 1).drafted == 0


def test_sampling_with_prompt_lookup_is_reproducible_and_plain_sampling(workdir):
    name = "llama-genai-fp32"
    eng = _engine(name, workdir)
    prompt = _prompts(name)[1]
    for seed in (1, 2, 3):
        request = Request(prompt, max_new_tokens=NEW, do_sample=True, temperature=1.3, seed=seed)
        want = _solo(eng, request)[0]
        assert _solo(eng, _lookup(request, k=5, n=1))[0] == want
        assert _solo(eng, _lookup(request, k=5, n=1), steps=1)[0] == want


def test_bad_options_and_grow_caches_are_refused(workdir):
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be in"):
        generation.Options(prompt_lookup_num_tokens=-1)
    with pytest.raises(ValueError, match="max_matching_ngram_size must be in"):
        generation.Options(prompt_lookup_num_tokens=3, max_matching_ngram_size=0)
    with pytest.raises(ValueError, match="does not run with beam search"):
        generation.Options(prompt_lookup_num_tokens=3, num_beams=2)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be an integer"):
        generation.Options(prompt_lookup_num_tokens=2.5)
    eng = _engine("llama-optimum", workdir)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens and num_assistant_tokens"):
        eng.prefill(Request([1, 2], prompt_lookup_num_tokens=-2))
    for name in GROW[:1]:
        spec = generation.compile(context(name, workdir, prompt_lookup_num_tokens=3), 1)
        with pytest.raises(ValueError, match="needs a cache whose rejected rows a mask hides"):
            generation.generate(spec, [[1, 2, 3]], [0])


# -- an assistant model -------------------------------------------------------------------------


def test_an_assistant_model_drafts_and_greedy_and_sampling_equal_plain(workdir):
    name, helper = "llama-optimum", "llama-genai-int4"  # one tokenizer, other weights
    prompts = _prompts(name)
    plain = generation.compile(context(name, workdir, max_new_tokens=NEW), len(prompts))
    want = generation.generate(plain, prompts, [0] * len(prompts))
    spec = context(name, workdir, max_new_tokens=NEW, num_assistant_tokens=4,
                   num_assistant_tokens_schedule="heuristic",
                   assistant=context(helper, workdir))  # fmt: skip
    eng = generation.compile(spec, len(prompts), capacity=128)
    assert generation.generate(eng, prompts, [0] * len(prompts)) == want
    _, stats = slot_loop.run(eng, [(p, NEW, 0) for p in prompts])
    assert stats.accepted > 0 and stats.steps < stats.tokens
    # sampled (the p/q rule over the draft model's distribution): reproducible with the seed,
    # the same beside other slots (a plain one, one sampled with another seed)
    sampled = Request(prompts[1], max_new_tokens=NEW, do_sample=True, temperature=1.2, seed=4)
    alone, _, solo = _solo(eng, sampled, steps=2)
    assert _solo(eng, sampled, steps=2)[0] == alone
    assert speculative.stats(solo, 1).drafted > 0
    other = Request(**{**sampled.__dict__, "seed": 9, "prompt": tuple(prompts[2])})
    state = eng.init_state()
    state = eng.insert(eng.prefill(sampled), state, 0)
    state = eng.insert(eng.prefill(other), state, 1)
    state = eng.insert(eng.prefill(Request(prompts[0], num_assistant_tokens=0)), state, 2)
    got = [alone[0]]
    while state.live_slots:
        state, tokens = eng.generate(state, 2)
        got += [(t.token, t.eos, t.done, t.finish_reason) for t in tokens if t.slot == 0]
    assert got == alone
    assert speculative.stats(state, 0).drafted > 0 and speculative.stats(state, 2).drafted == 0


# -- the speculative sampling rule: the target's distribution, on a tiny vocabulary ------------

# a target and a draft "model" over 4 tokens: the next token's probabilities given the last one
TARGET = np.array(
    [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.6, 0.1, 0.2]]
)
DRAFT = np.array(
    [[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]
)


def _sampled_runs(rule, seeds=20000, drafted=3, new=3):
    """The first ``new`` tokens after token 0 of each seed, decoded speculatively: each step
    the draft model draws ``drafted`` tokens (speculative.draft_draws), ``rule`` verifies them
    (speculative.speculative_sampling's signature), and the target draws the token after an
    accepted run with plain sampling's key (the slots' step)."""
    import jax
    import jax.numpy as jnp

    target, draft = jnp.asarray(TARGET, jnp.float32), jnp.asarray(DRAFT, jnp.float32)

    @jax.jit
    def run(seeds):
        b = seeds.shape[0]
        last, count = jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32)
        out, made = jnp.full((b, new * (drafted + 1)), -1, jnp.int32), jnp.zeros(b, jnp.int32)
        for _ in range(new):  # each step gives one token or more
            context, drafts, qs = last, [], []
            for i in range(drafted):
                q = draft[context]
                context = speculative.draft_draws(jnp.log(q), seeds, count + i)
                drafts.append(context)
                qs.append(q)
            drafts, qs = jnp.stack(drafts, 1), jnp.stack(qs, 1)
            p = target[jnp.concatenate([last[:, None], drafts], 1)]  # [B, drafted + 1, V]
            accepted, tokens = rule(p[:, :drafted], qs, drafts, seeds, count)
            kept = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), 1), 1)
            plain = jax.vmap(lambda r, s, c: jax.random.categorical(
                jax.random.fold_in(jax.random.key(s), c), r))  # fmt: skip
            after = plain(jnp.log(p[:, drafted]), seeds, count + drafted).astype(jnp.int32)
            full = jnp.concatenate([tokens, after[:, None]], 1)
            for j in range(drafted + 1):
                at = jnp.where(j <= kept, made, out.shape[1])
                out = out.at[jnp.arange(b), at].set(full[:, j], mode="drop")
                made = made + (j <= kept)
            last = jnp.take_along_axis(full, kept[:, None], 1)[:, 0]
            count = count + kept + 1
        return out[:, :new]

    return np.asarray(run(jnp.arange(seeds, dtype=jnp.int32)))


def _fits_the_target(runs) -> float:
    """The chi-square test's p-value of the runs' first three tokens against the target's
    (plain sampling's) probabilities of every sequence of three."""
    from scipy import stats

    cells = runs[:, 0] * 16 + runs[:, 1] * 4 + runs[:, 2]
    seen = np.bincount(cells, minlength=64)
    want = np.array([TARGET[0, c // 16] * TARGET[c // 16, c // 4 % 4] * TARGET[c // 4 % 4, c % 4]
                     for c in range(64)])  # fmt: skip
    return stats.chisquare(seen, want / want.sum() * len(runs)).pvalue


def test_speculative_sampling_keeps_the_target_distribution():
    import jax
    import jax.numpy as jnp

    assert _fits_the_target(_sampled_runs(speculative.speculative_sampling)) > 1e-3

    def from_target(p, q, drafts, seeds, steps):  # wrong: a rejected draft redrawn from p
        accepted, _ = speculative.speculative_sampling(p, q, drafts, seeds, steps)
        keys = jax.random.split(jax.random.key(7), drafts.shape)
        redrawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, jnp.log(p))
        return accepted, jnp.where(accepted, drafts, redrawn.astype(jnp.int32))

    def every_draft(p, q, drafts, seeds, steps):  # wrong: the draft model's distribution
        return jnp.ones(drafts.shape, bool), drafts

    for wrong in (from_target, every_draft):  # the test can fail
        assert _fits_the_target(_sampled_runs(wrong)) < 1e-6, wrong.__name__


def _other_tokenizer(folder, into):
    """A copy of ``folder``'s json files whose tokenizer swaps the ids of two tokens."""
    import shutil

    from generation_cases import swap_two_tokens

    into.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        shutil.copy(folder / name, into / name)
    swap_two_tokens(folder, into)
    return into


def test_an_assistant_of_another_vocabulary_is_refused(workdir):
    from generation_cases import decoder

    other = _other_tokenizer(FIXTURES / "gpt2-optimum", workdir / "other-tokenizer")
    helper = generation.context(other, decoder("gpt2-optimum"))
    with pytest.raises(ValueError, match="a draft model must share the target's tokenizer"):
        context("llama-optimum", workdir, assistant=helper)
    with pytest.raises(ValueError, match="not with beam search"):
        context("llama-optimum", workdir, num_beams=2,
                assistant=context("llama-genai-int4", workdir))  # fmt: skip
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule must be one of"):
        generation.Options(num_assistant_tokens_schedule="fast")


def test_the_pipeline_takes_prompt_lookup_and_an_assistant_model():
    from transmuter_jax import text

    pipe = text.generation(FIXTURES / "llama-optimum", max_new_tokens=12)
    prompt = "hello hello world hello world"
    want = pipe(prompt, chat=False)
    assert pipe(prompt, chat=False, prompt_lookup_num_tokens=3) == want
    helped = text.generation(FIXTURES / "llama-optimum", max_new_tokens=12,
                             assistant_model=FIXTURES / "llama-genai-int4")  # fmt: skip
    assert helped(prompt, chat=False, num_assistant_tokens=3) == want


def test_the_server_fields_switch_prompt_lookup_on():
    from types import SimpleNamespace

    from transmuter_jax.serving import app, protocol

    served = SimpleNamespace(max_model_len=100, pipe=None, generation_config=False,
                             vocab_size=512, decode_steps=0, speculative_tokens=None)  # fmt: skip
    for field in ("prompt_lookup_num_tokens", "num_speculative_tokens"):
        body = protocol.CompletionRequest(model="m", prompt="x", temperature=0, **{field: 4})
        options = dict(app._submission(served, body, [1, 2, 3], 5, None, "prompt").options)
        assert options["prompt_lookup_num_tokens"] == 4
    body = protocol.CompletionRequest(model="m", prompt="x", num_speculative_tokens=0)
    options = dict(app._submission(served, body, [1, 2, 3], 5, None, "prompt").options)
    assert "prompt_lookup_num_tokens" not in options and "num_assistant_tokens" not in options
    body = protocol.CompletionRequest(model="m", prompt="x", n=2, prompt_lookup_num_tokens=4)
    with pytest.raises(protocol.ApiError, match="speculative decoding takes n=1"):
        app._submission(served, body, [1, 2, 3], 5, None, "prompt")
    with pytest.raises(ValueError):
        protocol.CompletionRequest(model="m", prompt="x", prompt_lookup_num_tokens=0)


def test_the_server_fields_with_a_draft_model():
    """With --speculative-model: the server's K by default, the request's num_speculative_tokens
    (0: none), prompt lookup first where asked; n > 1 drafts only when asked, and is refused."""
    from types import SimpleNamespace

    from transmuter_jax.serving import app, protocol

    served = SimpleNamespace(max_model_len=100, pipe=None, generation_config=False,
                             vocab_size=512, decode_steps=0, speculative_tokens=5)  # fmt: skip

    def options(**fields):
        body = protocol.CompletionRequest(model="m", prompt="x", temperature=0.5, **fields)
        got = dict(app._submission(served, body, [1, 2, 3], 5, None, "prompt").options)
        return got.get("num_assistant_tokens"), got.get("prompt_lookup_num_tokens")

    assert options() == (5, None)
    assert options(num_speculative_tokens=2) == (2, None)
    assert options(num_speculative_tokens=0) == (0, None)
    assert options(prompt_lookup_num_tokens=3) == (None, 3)
    assert options(prompt_lookup_num_tokens=3, num_speculative_tokens=2) == (None, 3)
    assert options(n=2) == (0, None)  # the server's default: not for n > 1
    for fields in ({"num_speculative_tokens": 2}, {"prompt_lookup_num_tokens": 2}):
        with pytest.raises(protocol.ApiError, match="speculative decoding takes n=1") as error:
            options(n=2, **fields)
        assert error.value.status == 400 and error.value.param == "n"
    for bad in (-1, 33):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            protocol.CompletionRequest(model="m", prompt="x", num_speculative_tokens=bad)


def test_a_request_that_does_not_draft_skips_the_draft_models_prompt(workdir):
    """On an engine with a draft model, a request with num_assistant_tokens=0 gets an empty
    draft cache (the draft model never ran its prompt) and plain greedy's tokens, alone and
    prefilled together with one that drafts."""
    import jax

    from transmuter_jax.generation import prefill as prefills

    name, helper = "llama-optimum", "llama-genai-int4"
    prompts = _prompts(name)[:2]
    plain = generation.compile(context(name, workdir, max_new_tokens=NEW), len(prompts))
    want = generation.generate(plain, prompts, [0] * len(prompts))
    spec = context(name, workdir, max_new_tokens=NEW, assistant=context(helper, workdir))
    eng = generation.compile(spec, 2, capacity=128)
    quiet = Request(prompts[0], num_assistant_tokens=0)
    drafting = Request(prompts[1], num_assistant_tokens=4)

    def empty(prefix):
        cache = jax.device_get(prefix.rows.drafts.cache)
        return bool(cache) and not any(np.any(a) for a in cache.values())

    assert empty(eng.prefill(quiet)) and not empty(eng.prefill(drafting))
    together = prefills.prefill_many(eng, [quiet, drafting])
    assert empty(together[0]) and not empty(together[1])
    state = eng.init_state()
    for slot, prefix in enumerate(together):
        state = eng.insert(prefix, state, slot)
    got = [[] if p.first.eos else [p.first.token] for p in together]
    while state.live_slots:
        state, tokens = eng.generate(state, 3)
        for t in tokens:
            if not t.eos:
                got[t.slot].append(t.token)
    assert got == want
    assert speculative.stats(state, 0).drafted == 0 and speculative.stats(state, 1).drafted > 0


def test_a_failing_prompt_lookup_slot_pauses_and_a_right_guess_resumes_it():
    from transmuter_jax.generation import drafts as drafting

    # slots: lookup k=1 misses; lookup k=0 guessed right; lookup k=0 guessed wrong;
    # draft model k=1 misses; lookup k=3 keeps all; constant schedule k=1 misses;
    # lookup k=4 keeps 1 of 4; lookup k=4 keeps none; draft model k=4 keeps none
    d = drafting.empty(9, lookup=4, ngram=2, host=True)
    d.k[:] = [1, 0, 0, 1, 3, 1, 4, 4, 4]
    d.model[[3, 8]] = True
    d.adaptive[5] = False
    count = np.array([1, 0, 0, 1, 3, 1, 4, 4, 4], np.int32)
    accepted = np.array([0, 0, 0, 0, 3, 0, 1, 0, 0], np.int32)
    live = np.ones(9, bool)
    hit = np.array([False, True, False, False, False, False, False, False, False])
    after = drafting.adapted(d, count, accepted, live, hit | ~hit, hit)
    # paused; resumed at 1; still paused; a draft model keeps 1; grown (capped at 4); constant;
    # k - 1 (some kept, or none: transformers' schedule), for a draft model too
    assert np.asarray(after.k).tolist() == [0, 1, 0, 1, 4, 1, 3, 3, 3]
    dead = drafting.adapted(d, count, accepted, np.zeros(9, bool), hit, hit)
    assert np.asarray(dead.k)[1] == 0  # a free slot's guess resumes nothing
    # the rate: half the old one and half whether the first draft (or the guess) was right
    rate = np.asarray(after.rate)
    assert rate[4] == rate[6] == 0.75 and rate[0] == rate[7] == 0.25 and rate[1] == 0.75
    assert np.asarray(dead.rate).tolist() == [0.5] * 9


def test_a_verification_is_as_long_as_its_expected_tokens_pay_for():
    from transmuter_jax.generation import drafts as drafting
    from transmuter_jax.generation.speculative import lengths_of

    sizes = lengths_of(10)  # (1, 2, 4, 8, 11)

    def best(rates, counts, row_cost=16.0):
        d = drafting.empty(len(rates), lookup=10, ngram=2, host=True)
        d.rate[:] = rates
        live = np.ones(len(rates), bool)
        values = drafting.worth(d, np.array(counts, np.int32), live, sizes, row_cost)
        return sizes[int(np.argmax(np.asarray(values)))]

    assert best([0.9], [10]) >= 8  # one slot copying: a long step
    assert best([0.02], [10]) == 1  # one slot that never hits: plain steps
    assert best([0.5] * 4 + [0.0] * 4, [1] * 4 + [0] * 4) == 1  # 8 rows more for ~2 tokens
    assert best([0.9] * 4, [3] * 4) == 4  # four copying slots
    assert best([0.5] * 8, [1] * 8, row_cost=256.0) == 2  # where the weights cost the most


def test_the_proposers_guess_ignores_k_and_is_minus_one_without_a_match():
    from transmuter_jax.generation import drafts as drafting

    history = np.array([[5, 6, 7, 8, 5, 6, -1, -1], [1, 2, 3, 4, -1, -1, -1, -1]], np.int32)
    length = np.array([6, 4], np.int32)
    d = drafting.empty(2, lookup=3, ngram=2, host=True)
    d.k[:] = 0  # paused: drafts nothing, guesses still
    tokens, count, guess = drafting.propose(history, length, d, np.array([3, 3]), 3, 2)
    assert np.asarray(count).tolist() == [0, 0]
    assert np.asarray(guess).tolist() == [7, -1]  # "5 6" occurs before, followed by 7
    d.k[:] = 2
    tokens, count, guess = drafting.propose(history, length, d, np.array([3, 3]), 3, 2)
    assert np.asarray(count).tolist() == [2, 0] and np.asarray(tokens)[0, :2].tolist() == [7, 8]


def test_the_cpus_pricing_keeps_the_tokens(workdir, monkeypatch):
    name = "llama-optimum"
    prompts = _prompts(name)
    plain = generation.compile(context(name, workdir, max_new_tokens=NEW), len(prompts))
    want = generation.generate(plain, prompts, [0] * len(prompts))
    drafted = {}
    for cost in (16.0, 1e9):
        monkeypatch.setattr(speculative, "ROW_COST", {"cpu": cost})
        spec = generation.compile(
            context(name, workdir, max_new_tokens=NEW, prompt_lookup_num_tokens=LOOKUP),
            len(prompts),
        )
        assert generation.generate(spec, prompts, [0] * len(prompts)) == want
        _, stats = slot_loop.run(spec, [(p, NEW, 0) for p in prompts])
        assert stats.steps + stats.accepted == stats.tokens
        drafted[cost] = stats.drafted
    assert drafted[16.0] < drafted[1e9]  # the CPU pauses and cuts drafts; the tokens stay


@pytest.mark.parametrize(("lanes", "factor"), [(16, 2.0), (8, 1.0), (None, 1.0)])
def test_a_rows_price_halves_with_512_bit_kernels(monkeypatch, lanes, factor):
    """On a CPU whose kernels use 16-float vectors a row's products cost half while a step's
    rows fit one pass of the product kernel: the step's cost apart from its rows counts twice as
    many rows (AVX2's 8 floats, no kernels, steps of more rows: as given)."""
    from transmuter_jax import kernels

    monkeypatch.setattr(speculative, "ROW_COST", {"cpu": 16.0})
    monkeypatch.setattr(kernels.build, "vector_lanes", lambda: lanes)
    monkeypatch.setattr(speculative.jax, "default_backend", lambda: "cpu")
    assert speculative.row_cost(11) == speculative.row_cost(speculative.WIDE_ROWS) == 16.0 * factor
    assert speculative.row_cost(speculative.WIDE_ROWS + 1) == speculative.row_cost() == 16.0
    monkeypatch.setattr(speculative.jax, "default_backend", lambda: "gpu")
    assert speculative.row_cost(11) == speculative.ROW_COST_OTHER
