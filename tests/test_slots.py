"""Slots: a request that joins a running batch at any step, next to any others, gets exactly the
tokens and log-probabilities it gets alone; its tokens are generate()'s and transformers'."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from generation_cases import case, context, encoder_inputs, reference, tiered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transmuter_jax import generation
from transmuter_jax.generation import Request, slots

IN_PLACE = ["llama-genai-fp32", "qwen2-genai-fp32", "gemma3-genai-fp32"]
APPEND = ["llama-optimum", "qwen2-optimum", "gpt2-optimum"]  # gpt2: position_ids, so append
GROW = [
    "gemma3-optimum"
]  # positions from the cache length: the padded rewrite, its valid rows last
# requests with inputs of their own: an encoder's outputs (Marian and Whisper, padded grow
# caches), image features (SmolVLM, append) and M-RoPE positions with them (Qwen2.5-VL, in_place)
ENCODER = ["marian-optimum", "whisper-optimum"]
VISION = ["smolvlm-torch", "qwen25vl-genai-fp32"]
NEW = 8
# the quick tier: one family per cache mode, and gpt2 (position_ids in an append cache), and
# one family of each kind of inputs
FAST = ["llama-genai-fp32", "llama-optimum", "gpt2-optimum", "gemma3-optimum", "marian-optimum",
        "qwen25vl-genai-fp32"]  # fmt: skip


def _tiered(names):
    return [tiered(n, quick=n in FAST, id=n) for n in names]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


_ENGINES: dict = {}


def engine(name, workdir, **options):
    key = (name, tuple(sorted(options.items())))
    if key not in _ENGINES:
        if name in ENCODER:
            options["given"] = encoder_inputs(name, case(name, "batch"), [0])[0]
        if name in VISION:
            options["image_token"] = case(name, "image")["image_token_id"]
        spec = context(name, workdir, max_new_tokens=NEW, **options)
        _ENGINES[key] = generation.compile(spec, 4, capacity=128, top_logprobs=3)
    return _ENGINES[key]


def inputs_of(name):
    """Each request's own inputs: an encoder's outputs for each prompt of the batch case; for a
    vision model, the image case's prompt first with its features (and M-RoPE positions)."""
    the_case = case(name, "batch")
    prompts = the_case["prompts"]
    if name in ENCODER:
        return prompts, [encoder_inputs(name, the_case, [i])[1] for i in range(len(prompts))]
    if name in VISION:
        image = case(name, "image")
        _, arrays = reference(name)
        own = {"image_features": arrays[image["image_features"][0]]}
        if "position_ids" in image:  # [3, 1, prompt]
            own["position_ids"] = arrays[image["position_ids"][0]][:, 0]
        return [image["prompts"][0], *prompts], [own] + [None] * len(prompts)
    return prompts, [None] * len(prompts)


def requests(name):
    prompts, inputs = inputs_of(name)
    return {
        "greedy": Request(
            prompts[0], max_new_tokens=NEW, logprobs=True, top_logprobs=2, inputs=inputs[0]
        ),
        "sampled": Request(
            prompts[1],
            inputs=inputs[1],
            do_sample=True,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            seed=7,
            max_new_tokens=NEW,
            logprobs=True,
        ),  # fmt: skip
        "penalized": Request(
            prompts[2 % len(prompts)],
            inputs=inputs[2 % len(prompts)],
            repetition_penalty=1.4,
            presence_penalty=0.5,
            min_p=0.05,
            do_sample=True,
            seed=3,
            max_new_tokens=NEW - 2,
            logprobs=True,
            top_logprobs=3,
        ),  # fmt: skip
    }


def _record(tokens, into):
    for t in tokens:
        into.setdefault(t.slot, []).append(t)


def _drain(eng, state, into, steps=4):
    while state.live_slots:
        state, tokens = eng.generate(state, steps)
        _record(tokens, into)
    return state


def _summary(prefix, tokens):
    out = [prefix.first] if prefix.first is not None else []
    out += tokens
    return [(t.token, t.eos, t.done, t.finish_reason, _bits(t.logprob),
             tuple((i, _bits(v)) for i, v in t.top)) for t in out]  # fmt: skip


def _bits(value):
    return None if math.isnan(value) else np.float32(value).tobytes()


def solo(eng, request, slot=0):
    state = eng.init_state()
    prefix = eng.prefill(request)
    state = eng.insert(prefix, state, slot)
    got = {}
    _drain(eng, state, got)
    return _summary(prefix, [t for t in got.get(slot, [])])


def _every_offset(name, workdir, offsets):
    """Each kind of request (greedy, seeded sampling, penalties; log-probabilities) inserted
    into slot 1 after ``offset`` steps of two others equals its solo run, for each offset."""
    eng = engine(name, workdir)
    reqs = requests(name)
    alone = {k: solo(eng, r) for k, r in reqs.items()}
    for target in ("greedy", "sampled", "penalized"):
        others = [k for k in reqs if k != target]
        for offset in offsets:
            state = eng.init_state()
            got: dict = {}
            state = eng.insert(eng.prefill(reqs[others[0]]), state, 0)
            state = eng.insert(eng.prefill(reqs[others[1]]), state, 3)
            if offset:
                state, tokens = eng.generate(state, offset)
                _record(tokens, got)
            prefix = eng.prefill(reqs[target])
            state = eng.insert(prefix, state, 1)
            got.pop(1, None)
            _drain(eng, state, got, steps=3)
            assert _summary(prefix, got.get(1, [])) == alone[target], (target, offset)


@pytest.mark.parametrize("name", _tiered(IN_PLACE + APPEND + GROW + ENCODER + VISION))
def test_a_request_inserted_at_every_step_offset_equals_its_solo_run(name, workdir):
    _every_offset(name, workdir, range(0, 6))


@pytest.mark.parametrize("name", _tiered(ENCODER + VISION))
def test_requests_with_inputs_get_transformers_tokens_in_the_slots(name, workdir):
    """Requests with their own inputs (an encoder's outputs of other lengths, image features,
    M-RoPE positions) running together in the slots, joined at other steps, each get
    transformers' greedy tokens."""
    eng = engine(name, workdir)
    prompts, inputs = inputs_of(name)
    if name in VISION:
        image = case(name, "image")
        expected = [image["tokens"][0], *case(name, "batch")["tokens"]]
    else:
        expected = case(name, "batch")["tokens"]
    state, got, prefixes = eng.init_state(), {}, {}
    for i, (prompt, own) in enumerate(zip(prompts[:4], inputs, strict=False)):
        prefixes[i] = eng.prefill(Request(prompt, max_new_tokens=NEW, inputs=own))
        state = eng.insert(prefixes[i], state, i)
        state, tokens = eng.generate(state, 1 + i)
        _record(tokens, got)
    _drain(eng, state, got, steps=3)
    assert len(prefixes) == min(4, len(prompts)) > 1
    for i, prefix in prefixes.items():
        tokens = [t.token for t in [prefix.first, *got.get(i, [])] if not t.eos]
        assert tokens == expected[i][:NEW], i


@pytest.mark.parametrize(
    "name", _tiered(["llama-genai-fp32", "llama-optimum", "qwen2-optimum", "gemma3-optimum"])
)
def test_a_request_beside_a_long_one_equals_its_solo_run(name, workdir):
    """A chunk reads only the cache rows its longest slot needs (64, 128, 256, ...): requests
    beside a long one run with more rows than alone, and get the same bits."""
    eng = generation.compile(context(name, workdir, max_new_tokens=NEW), 3, capacity=256,
                             top_logprobs=3)  # fmt: skip
    vocab = eng.vocab_size
    reqs = requests(name)
    long = Request(tuple((5 + 7 * i) % vocab for i in range(150)), max_new_tokens=NEW + 4,
                   logprobs=True, top_logprobs=3)  # fmt: skip
    alone = {k: solo(eng, r) for k, r in reqs.items()}
    for target in ("greedy", "sampled", "penalized"):
        state = eng.init_state()
        got: dict = {}
        state = eng.insert(eng.prefill(long), state, 0)
        state, tokens = eng.generate(state, 2)
        _record(tokens, got)
        prefix = eng.prefill(reqs[target])
        state = eng.insert(prefix, state, 2)
        _drain(eng, state, got, steps=3)
        assert _summary(prefix, got.get(2, [])) == alone[target], target
    assert slots.window_of(40, 256) == 64 and slots.window_of(65, 256) == 128
    assert slots.window_of(157, 256) == 256 and slots.window_of(300, 256) == 256


@pytest.mark.parametrize("name", ["llama-genai-fp32", "llama-optimum", "gemma3-optimum"])
def test_the_slots_hold_the_window_their_live_requests_need(name, workdir):
    """The slots' cache holds the smallest window the live requests need (64 of 128 rows for
    short ones): it grows for a long request and shrinks back when only short ones run, and a
    short request run after a long one in the same slot equals its solo run."""
    eng = engine(name, workdir)
    vocab = eng.vocab_size
    long = Request(tuple((5 + 7 * i) % vocab for i in range(90)), max_new_tokens=NEW)
    short = requests(name)["greedy"]
    alone = solo(eng, short)
    state = eng.init_state()
    assert slots.held(eng, state) == 64
    state = eng.insert(eng.prefill(long), state, 1)
    assert slots.held(eng, state) == 128  # its 90 prompt rows
    state = _drain(eng, state, {})
    state = eng.free(state, 1)
    prefix = eng.prefill(short)
    state = eng.insert(prefix, state, 1)
    got: dict = {}
    state, tokens = eng.generate(state, 2)
    _record(tokens, got)
    assert slots.held(eng, state) == 64  # only the short one runs
    _drain(eng, state, got)
    assert _summary(prefix, got.get(1, [])) == alone


def test_slots_that_read_no_windows_start_at_their_capacity(workdir):
    """Slots whose chunks read the whole capacity (generate()'s: ``slot_windows=False``) are
    made at that capacity, so nothing resizes them; a request in them equals its solo run in
    slots that hold windows."""
    name = "llama-genai-fp32"
    eng = engine(name, workdir)
    request = requests(name)["greedy"]
    alone = solo(eng, request)
    whole = dataclasses.replace(eng, slot_windows=False)
    state = whole.init_state()
    assert slots.held(whole, state) == whole.slot_capacity > slots.held(eng, eng.init_state())
    prefix = whole.prefill(request)
    state = whole.insert(prefix, state, 0)
    got: dict = {}
    state = _drain(whole, state, got)
    assert slots.held(whole, state) == whole.slot_capacity
    assert _summary(prefix, got.get(0, [])) == alone


@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-fp32"])
def test_a_request_gets_the_same_bits_in_every_slot_of_eight(name, workdir):
    """A row's place in the batch changes no bit (XLA's dot of a small weight summed the rows
    past its first tile of rows in another order: slots 6 and 7 of 8 on AVX2)."""
    eng = generation.compile(context(name, workdir, max_new_tokens=NEW), 8, capacity=128,
                             top_logprobs=3)  # fmt: skip
    request = requests(name)["penalized"]
    alone = solo(eng, request, slot=0)
    assert [solo(eng, request, slot=s) for s in range(1, 8)] == [alone] * 7


@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-int4"])
def test_the_step_computes_the_rows_of_live_slots_only(name, workdir):
    """The step's weight products compute the rows of the slots that take a token only
    (kernels.live_rows: float32 and int4 products), and a request gets the same bits whether
    the other slots are empty or all run."""
    import jax

    from transmuter_jax import kernels

    eng = generation.compile(context(name, workdir, max_new_tokens=NEW), 4, capacity=128,
                             top_logprobs=3)  # fmt: skip
    state = eng.init_state()
    if kernels.enabled():
        step = slots._step_function(eng, slots.held(eng, state), 3)
        hlo = jax.jit(step).lower(eng.model.params, state.rows).as_text()
        live = "tj_matmul_nbits_live" if "int4" in name else "tj_gemm_live_f32"
        assert live in hlo
    request = requests(name)["penalized"]
    alone = solo(eng, request, slot=3)
    prefix = eng.prefill(request)
    for slot in range(4):
        state = eng.insert(prefix, state, slot)
    got: dict = {}
    _drain(eng, state, got)
    assert [_summary(prefix, got[s]) for s in range(4)] == [alone] * 4


# every decoder-only text fixture: the slots' modes at every offset of a whole run (a grow one on
# its padded rewrite), one that keeps exact lengths refused with the reason
SWEEP = [
    "bloom-optimum", "cohere-optimum", "falcon-optimum", "gemma2-optimum", "gemma3-genai-fp32",
    "gemma3-genai-int4", "gemma3-optimum", "gpt-neox-optimum", "gpt2-optimum",
    "granite-genai-fp32", "granite-optimum", "llama-genai-fp32", "llama-genai-int4",
    "llama-optimum", "mistral-genai-fp32", "mistral-optimum", "mistral-window-genai-fp32",
    "mistral-window-optimum", "olmo2-optimum", "opt-optimum", "phi3-genai-fp32", "phi3-optimum",
    "qwen2-genai-fp32", "qwen2-genai-int4", "qwen2-optimum", "qwen3-genai-fp32", "qwen3-optimum",
    "smollm3-optimum", "stablelm-optimum",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEP)
def test_every_family_at_every_offset_equals_its_solo_run_or_refuses_slots(name, workdir):
    eng = engine(name, workdir)
    if eng.cache_mode.slot_refusal():  # a grow decoder of exact lengths: refused, saying why
        with pytest.raises(ValueError, match="cannot run slots: its grow cache"):
            eng.init_state()
        return
    _every_offset(name, workdir, range(0, NEW))


@pytest.mark.parametrize("name", ["llama-optimum", "llama-genai-fp32", "gemma3-optimum"])
def test_solo_runs_are_generates_and_transformers_tokens(name, workdir):
    eng = engine(name, workdir)
    greedy = case(name, "greedy")
    tokens = [
        t[0] for t in solo(eng, Request(greedy["prompts"][0], max_new_tokens=NEW)) if not t[1]
    ]
    assert tokens == greedy["tokens"][0][:NEW]
    options = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW,
                   repetition_penalty=1.4, token_logprobs=True)  # fmt: skip
    batch = generation.compile(context(name, workdir, **options), 1)
    prompt = case(name, "batch")["prompts"][1]
    expected = generation.generate(batch, [prompt], [7])[0]
    request = Request(prompt, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                      repetition_penalty=1.4, max_new_tokens=NEW, logprobs=True)  # fmt: skip
    got = [t for t in solo(eng, request) if not t[1]]
    assert [t[0] for t in got] == [t for t, _ in expected]
    logprobs = [np.frombuffer(t[4], np.float32)[0] for t in got]
    np.testing.assert_allclose(logprobs, [p for _, p in expected], rtol=1e-5, atol=1e-5)


def test_a_slot_freed_mid_chunk_is_reused(workdir):
    name = "llama-optimum"
    eng = engine(name, workdir)
    reqs = requests(name)
    state = eng.init_state()
    state = eng.insert(eng.prefill(reqs["greedy"]), state, 2)
    state, _ = eng.generate(state, 3)
    state = eng.free(state, 2)
    assert state.live_slots == [] and 2 in state.free_slots
    prefix = eng.prefill(reqs["sampled"])
    state = eng.insert(prefix, state, 2)
    got: dict = {}
    _drain(eng, state, got)
    assert _summary(prefix, got[2]) == solo(eng, reqs["sampled"])
    with pytest.raises(ValueError, match="holds a running request"):
        state = eng.insert(prefix, eng.insert(prefix, eng.init_state(), 0), 0)


def test_chunks_of_any_length_share_the_program_of_program_steps(workdir):
    """generate(state, steps, program_steps) runs the loop compiled for program_steps, stopped
    after steps: the same tokens as chunks of their own programs; bad values are refused."""
    name = "llama-optimum"
    eng = engine(name, workdir)
    request = requests(name)["sampled"]
    alone = solo(eng, request, slot=1)
    prefix = eng.prefill(request)
    state = eng.insert(prefix, eng.init_state(), 1)
    got: dict = {}
    for steps in (1, 3, 2, 4, 1, 4):
        state, tokens = eng.generate(state, steps, 4)
        assert len(tokens) <= steps
        _record(tokens, got)
    _drain(eng, state, got)
    assert _summary(prefix, got[1]) == alone
    for steps, program in ((4, 2), (0, 4), (2, 0), (2, 1.5)):
        with pytest.raises(generation.GenerationError, match="steps"):
            eng.generate(eng.init_state(), steps, program)


def test_a_slot_whose_request_ends_mid_chunk_takes_the_next_one(workdir):
    import dataclasses

    name = "llama-optimum"
    eng = engine(name, workdir)
    reqs = requests(name)
    long = dataclasses.replace(reqs["sampled"], eos_token_id=())  # runs all its 8 tokens
    short = Request(reqs["greedy"].prompt, max_new_tokens=3, eos_token_id=(), logprobs=True)
    state = eng.init_state()
    first_long, first_short = eng.prefill(long), eng.prefill(short)
    state = eng.insert(first_long, state, 0)
    state = eng.insert(first_short, state, 2)
    got: dict = {}
    state, tokens = eng.generate(state, 6)  # slot 2 ends after 2 of these steps, slot 0 runs on
    _record(tokens, got)
    assert state.live_slots == [0] and 2 in state.free_slots
    assert _summary(first_short, got.pop(2)) == solo(eng, short)
    prefix = eng.prefill(reqs["penalized"])
    state = eng.insert(prefix, state, 2)  # the done slot takes a new request, not freed first
    _drain(eng, state, got)
    assert _summary(prefix, got[2]) == solo(eng, reqs["penalized"])
    assert _summary(first_long, got[0]) == solo(eng, long)


def test_finish_reasons_and_bad_requests(workdir):
    name = "llama-optimum"
    eng = engine(name, workdir)
    greedy = case(name, "greedy")
    out = solo(eng, Request(greedy["prompts"][0], max_new_tokens=3))
    assert len(out) == 3 and out[-1][2:4] == (True, "length")
    first = greedy["tokens"][0][0]
    out = solo(eng, Request(greedy["prompts"][0], max_new_tokens=5, eos_token_id=(first,)))
    assert out == [(first, True, True, "stop", None, ())]
    with pytest.raises(ValueError, match="capacity of 128"):
        eng.prefill(Request(greedy["prompts"][0], max_new_tokens=500))
    with pytest.raises(ValueError, match="top_logprobs 9"):
        eng.prefill(Request(greedy["prompts"][0], top_logprobs=9))
    with pytest.raises(ValueError, match="at least one token"):
        Request(())


def test_a_grow_decoder_runs_slots_on_its_padded_rewrite_or_refuses_them_saying_why(workdir):
    """A grow decoder takes slots on its padded rewrite (each row's padding its own: its valid
    rows last); with exact lengths, or without a way to roll back drafts, it refuses."""
    spec = context("gemma3-optimum", workdir)
    padded = generation.compile(spec, 2, capacity=128)
    assert padded.compiled.grow_cache == "padded" and padded.compiled.steps.padding.per_row
    assert padded.init_state().free_slots == [0, 1]
    # a prefix of fewer rows than the slots hold (prefill_many's 64-row window beside a 90-token
    # request's 128) goes in with its valid rows last: the tokens of its solo run
    vocab = padded.vocab_size
    long = Request(tuple((5 + 7 * i) % vocab for i in range(90)), max_new_tokens=NEW)
    short = requests("gemma3-optimum")["greedy"]
    state = padded.insert(padded.prefill(long), padded.init_state(), 0)
    state, _ = padded.generate(state, 2)
    prefix = padded.prefill_many([short])[0]
    assert slots._rows_of(padded, prefix.rows.cache, 128) == 64 and slots.held(padded, state) == 128
    state = padded.insert(prefix, state, 1)
    got: dict = {}
    _drain(padded, state, got)
    alone = [t[0] for t in solo(padded, short)]
    assert [prefix.first.token] + [t.token for t in got[1]] == alone
    with pytest.raises(ValueError, match="valid rows last, so the rows of rejected drafts"):
        padded.prefill(Request((1, 2, 3), prompt_lookup_num_tokens=3))
    with pytest.raises(ValueError, match="valid rows last, so the rows of rejected drafts"):
        lookup = generation.compile(
            context("gemma3-optimum", workdir, prompt_lookup_num_tokens=3), 1
        )
        generation.generate(lookup, [[1, 2, 3]], [0])
    exact = generation.compile(spec, 2, grow_cache="exact")
    with pytest.raises(ValueError, match=r"keeps exact lengths.*because grow_cache='exact'"):
        exact.init_state()
    with pytest.raises(ValueError, match="cannot run slots"):
        exact.prefill(Request((1, 2, 3)))
    beams = generation.compile(context("llama-optimum", workdir, num_beams=2), 2)
    with pytest.raises(ValueError, match="beam search needs a program of its own"):
        beams.init_state()


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("generate"), st.integers(1, 5), st.just(0)),
    ),
    max_size=10,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_random_insert_free_generate_sequences_equal_solo_runs(ops, workdir):
    _random_sequence("llama-optimum", ops, workdir)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_random_sequences_in_a_grow_cache_equal_solo_runs(ops, workdir):
    """The same in a padded grow cache, whose valid rows come last."""
    _random_sequence("gemma3-optimum", ops, workdir)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_random_sequences_of_requests_with_encoder_outputs_equal_solo_runs(ops, workdir):
    """The same with Marian's requests, each with its encoder's outputs (of other widths)."""
    _random_sequence("marian-optimum", ops, workdir)


def _random_sequence(name, ops, workdir):
    eng = engine(name, workdir)
    reqs = list(requests(name).values())
    alone = _SOLO.setdefault(name, [solo(eng, r) for r in reqs])
    state = eng.init_state()
    running: dict = {}  # slot -> (request index, prefix, tokens)
    for op, a, b in ops:
        if op == "insert" and (state.hosts[b] is None or state.hosts[b].done):
            prefix = eng.prefill(reqs[a])
            state = eng.insert(prefix, state, b)
            running[b] = (a, prefix, [])
        elif op == "free":
            state = eng.free(state, a)
            running.pop(a, None)
        elif op == "generate":
            state, tokens = eng.generate(state, a)
            for t in tokens:
                running[t.slot][2].append(t)
    while state.live_slots:
        state, tokens = eng.generate(state, 4)
        for t in tokens:
            running[t.slot][2].append(t)
    for index, prefix, tokens in running.values():
        assert _summary(prefix, tokens) == alone[index]


_SOLO: dict = {}


@pytest.mark.parametrize("name", ["stop_split", "stop_overhang", "stop_several", "stop_prompt"])
def test_per_request_stop_strings_equal_transformers(name, workdir):
    from generation_cases import FIXTURES

    from transmuter_jax.generation.context import folder_texts

    texts = folder_texts(FIXTURES / "llama-optimum")
    spec = generation.context(FIXTURES / "llama-optimum", context("llama-optimum", workdir).model,
                              max_new_tokens=16, tokenizer=_Texts(texts))  # fmt: skip
    eng = generation.compile(spec, 2, capacity=128)
    the_case = case("llama-optimum", name)
    rows = zip(the_case["input_ids"], the_case["stop_strings"], the_case["tokens"], strict=True)
    for prompt, stops, want in rows:
        out = solo(eng, Request(prompt, max_new_tokens=16, stop_strings=tuple(stops)), slot=1)
        assert [t[0] for t in out if not t[1]] == want
        assert out[-1][2] and out[-1][3] in ("stop", "length")


class _Texts:
    def __init__(self, texts):
        self.token_texts = texts


def test_a_decoder_given_the_encoders_cross_cache_refuses_slots_saying_why(workdir):
    """onnxruntime-genai's Whisper decoder takes the encoder's cross-attention cache as given
    inputs, and its MultiHeadAttention keeps exact cache lengths: no slots, and the error says
    why (generate() runs it, tests/test_genai_whisper.py)."""
    from generation_cases import FIXTURES, load

    folder = FIXTURES / "whisper-genai-fp32"
    decoder = load(folder / "decoder.onnx")
    names = tuple(i.name for i in decoder.inputs if "_cross_" in i.name)
    spec = generation.context(folder, decoder, given=names, max_new_tokens=NEW)
    eng = generation.compile(spec, 2, capacity=64)
    with pytest.raises(ValueError, match="cannot run slots: .*MultiHeadAttention"):
        eng.init_state()


def test_bad_inputs_get_clear_errors_and_leave_the_slots_as_they_were(workdir):
    eng = engine("marian-optimum", workdir)
    prompts, inputs = inputs_of("marian-optimum")
    with pytest.raises(ValueError, match="needs inputs"):
        eng.prefill(Request(prompts[0]))
    with pytest.raises(ValueError, match="not the engine's"):
        eng.prefill(Request(prompts[0], inputs={**inputs[0], "pixel_values": np.zeros(3)}))
    two = {k: np.concatenate([v, v]) for k, v in inputs[0].items()}
    with pytest.raises(ValueError, match="must be one row"):
        eng.prefill(Request(prompts[0], inputs=two))
    with pytest.raises(ValueError, match="mapping"):
        Request(prompts[0], inputs=[1, 2])
    words = {**inputs[0], "encoder_attention_mask": np.array([["a", "b"]])}
    with pytest.raises(ValueError, match="must be numbers"):
        eng.prefill(Request(prompts[0], inputs=words))
    narrow = {**inputs[0], "encoder_hidden_states": inputs[0]["encoder_hidden_states"][..., :3]}
    with pytest.raises(ValueError, match="the decoder takes"):
        eng.prefill(Request(prompts[0], inputs=narrow))
    with pytest.raises(ValueError, match="drafts' steps do not"):
        eng.prefill(Request(prompts[0], inputs=inputs[0], prompt_lookup_num_tokens=3))
    mine = {k: np.array(v) for k, v in inputs[0].items()}
    before = {k: v.copy() for k, v in mine.items()}
    request = Request(prompts[0], inputs=mine, max_new_tokens=NEW)
    mine["encoder_hidden_states"][:] = 7.0  # the request keeps its own copy
    assert solo(eng, request) == solo(eng, Request(prompts[0], inputs=before, max_new_tokens=NEW))
    vision = engine("smolvlm-torch", workdir)
    with pytest.raises(ValueError, match="embedding model, which the drafts' steps do not"):
        vision.prefill(Request(inputs_of("smolvlm-torch")[0][1], prompt_lookup_num_tokens=2))
    image_prompts, image_inputs = inputs_of("smolvlm-torch")
    fewer = {"image_features": image_inputs[0]["image_features"][1:]}
    with pytest.raises(ValueError, match="image tokens"):
        vision.prefill(Request(image_prompts[0], inputs=fewer))
    with pytest.raises(ValueError, match="not the engine's"):  # no M-RoPE positions here
        vision.prefill(Request(image_prompts[0], inputs={**image_inputs[0], "position_ids": [[0]]}))


def test_a_decoder_without_an_encoder_mask_keeps_one_encoder_width(workdir):
    """Whisper's decoder (optimum) takes no encoder_attention_mask: a request whose encoder
    outputs have another width cannot join the slots, and saying so leaves them running."""
    name = "whisper-optimum"
    eng = engine(name, workdir)
    prompts, inputs = inputs_of(name)
    state = eng.init_state()
    first = eng.prefill(Request(prompts[0], inputs=inputs[0], max_new_tokens=NEW))
    state = eng.insert(first, state, 0)
    shorter = {k: v[:, :-1] for k, v in inputs[1].items()}
    other = eng.prefill(Request(prompts[1], inputs=shorter, max_new_tokens=2))
    with pytest.raises(ValueError, match="takes no encoder_attention_mask"):
        eng.insert(other, state, 1)
    got: dict = {}
    _drain(eng, state, got)
    assert _summary(first, got.get(0, [])) == solo(eng, first.request)


def test_generate_runs_models_with_inputs_through_the_slots(workdir):
    """generate() of an encoder-decoder or a vision model is a loop over the slots, each row's
    inputs its request's; a processor that reads the encoder's ids keeps the host rows."""
    from transmuter_jax.generation import loop

    the_case = case("marian-optimum", "batch")
    given, inputs = encoder_inputs("marian-optimum", the_case, [0, 1])
    eng = engine("marian-optimum", workdir)
    assert loop.through_slots(eng, inputs)
    assert loop.through_slots(engine("qwen25vl-genai-fp32", workdir), {})
    penalized = engine("marian-optimum", workdir, encoder_repetition_penalty=1.2)
    assert not loop.through_slots(penalized, {**inputs, "encoder_input_ids": [[1], [2]]})
    with pytest.raises(ValueError, match="encoder_repetition_penalty"):
        penalized.init_state()
    # its rows' inputs as requests: row 1's encoder outputs, not row 0's
    alone = generation.generate(eng, [the_case["prompts"][1]], [0],
                                {k: v[1:] for k, v in inputs.items()})  # fmt: skip
    both = generation.generate(eng, the_case["prompts"][:2], [0, 0], inputs)
    assert both[1] == alone[0] == the_case["tokens"][1][:NEW]


@pytest.mark.parametrize("name", _tiered(["llama-genai-fp32", "gemma3-optimum", "marian-optimum"]))
def test_prefixes_inserted_together_equal_inserts_one_at_a_time(name, workdir, monkeypatch):
    """slots.insert_many (generate()'s rows into new slots) gives the slots that inserts one at
    a time give, a finished prefix's slot taking a later one of the list too (encoder inputs:
    Marian; a padded grow cache: Gemma 3), in programs of up to INSERT_ROWS (2 here), and so the
    same tokens; a pair that cannot go in is refused before any does, the slots as they were."""
    import jax

    monkeypatch.setattr(slots, "INSERT_ROWS", 2)
    eng = engine(name, workdir)
    prompts, inputs = inputs_of(name)
    prefixes = [eng.prefill(r) for r in requests(name).values()]
    ended = eng.prefill(Request(prompts[0], inputs=inputs[0], max_new_tokens=1))
    assert ended.first.done
    pairs = [(ended, 2), (prefixes[0], 0), (prefixes[1], 3), (prefixes[2], 2)]
    apart = eng.init_state()
    for prefix, slot in pairs:
        apart = eng.insert(prefix, apart, slot)
    together = slots.insert_many(eng, pairs, eng.init_state())
    for a, b in zip(jax.tree.leaves((apart.rows, apart.given)),
                    jax.tree.leaves((together.rows, together.given)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [(h.request, h.done) for h in apart.hosts if h] == [
        (h.request, h.done) for h in together.hosts if h
    ]
    with pytest.raises(generation.GenerationError, match="slot 0 holds a running request"):
        slots.insert_many(eng, [(ended, 1), (prefixes[1], 0)], together)
    got_apart, got_together = {}, {}
    _drain(eng, apart, got_apart)
    _drain(eng, together, got_together)
    assert got_together.keys() == {0, 2, 3}
    for slot, prefix in ((0, prefixes[0]), (3, prefixes[1]), (2, prefixes[2])):
        assert _summary(prefix, got_together[slot]) == _summary(prefix, got_apart[slot])


def test_prefixes_inserted_unread_run_as_prefixes_inserted_read(workdir, monkeypatch):
    """generate()'s start: the slots take prompts' rows before their first tokens are read
    (prefill.select), a chunk runs, then the first tokens are read and settled: the same tokens
    as prefixes read before they go in; a row that its first token ends by a stop string takes
    none of the chunk's; generate() gives the same tokens and events either way."""
    from generation_cases import FIXTURES

    from transmuter_jax.generation import prefill
    from transmuter_jax.generation.context import folder_texts

    texts = folder_texts(FIXTURES / "llama-optimum")
    model = context("llama-optimum", workdir).model
    spec = generation.context(FIXTURES / "llama-optimum", model, max_new_tokens=8,
                              tokenizer=_Texts(texts))  # fmt: skip
    eng = generation.compile(spec, 4, capacity=128, top_logprobs=2)
    prompts = case("llama-optimum", "batch")["prompts"]
    first = eng.prefill(Request(prompts[0], max_new_tokens=8)).first.token
    stop = texts[first]
    assert stop.strip(), "the first token's text is the stop string: it must be one"
    reqs = [
        Request(prompts[0], max_new_tokens=8, stop_strings=(stop,)),  # ends at its first token
        Request(prompts[1], max_new_tokens=8, logprobs=True, top_logprobs=2),
        Request(prompts[2 % len(prompts)], max_new_tokens=6, do_sample=True, seed=3),
    ]
    read_first = prefill.prefill_many(eng, reqs)
    assert read_first[0].first.finish_reason == "stop"
    state = slots.insert_many(eng, [(p, i) for i, p in enumerate(read_first) if not p.first.done],
                              eng.init_state())  # fmt: skip
    want: dict = {}
    _drain(eng, state, want)

    pending = prefill.fed(eng, reqs)
    selected = prefill.select(eng, pending)
    assert all(p.unread and p.first is None for p in selected.prefixes)
    pairs = [(p, i) for i, p in enumerate(selected.prefixes)]
    state = slots.insert_many(eng, pairs, eng.init_state())
    assert state.live_slots == [0, 1, 2]
    state, chunk = slots.launch(eng, state, 4)
    prefixes = prefill.read(eng, pending, selected)
    with pytest.raises(generation.GenerationError, match="slot 3 holds no running request"):
        slots.settle(state, [(3, prefixes[0].first)])
    state = slots.settle(state, [(i, p.first) for i, p in enumerate(prefixes)])
    assert state.live_slots == [1, 2]
    state, tokens = slots.finish(state, chunk)
    got: dict = {}
    _record(tokens, got)
    _drain(eng, state, got)
    assert got.keys() == want.keys() == {1, 2}
    for i in range(3):
        assert _summary(prefixes[i], got.get(i, [])) == _summary(read_first[i], want.get(i, []))

    # generate(): a row of one token, a row its first token ends, the others; either start
    options = dict(max_new_tokens=6, stop_strings=[stop], tokenizer=_Texts(texts))
    ctx = generation.compile(generation.context(FIXTURES / "llama-optimum", model, **options), 4)
    batch = [prompts[0], prompts[1], [], prompts[2 % len(prompts)]]

    def run():
        events = []
        out = generation.generate(ctx, batch, [0, 1, 2, 3], on_token=events.append)
        return out, [{k: v.tolist() for k, v in e.items()} for e in events]

    from transmuter_jax.generation import slot_loop

    started = []
    real = slot_loop._started
    monkeypatch.setattr(slot_loop, "_started", lambda *a: started.append(1) or real(*a))
    cold = run()  # its decode program not run yet: the first tokens are read first
    early = run()
    assert len(started) == 1, "the second call starts its slots before the first tokens"
    monkeypatch.setattr(prefill, "together", lambda engine, requests: False)
    assert run() == early == cold
    assert early[0][0] == [first] and early[1][0]["finished"][0]  # the stop string's token


@pytest.mark.parametrize(
    "name", _tiered(["llama-genai-fp32", "gpt2-optimum", "gemma3-optimum", "marian-optimum"])
)
def test_generate_started_before_its_first_tokens_gives_transformers_tokens(
    name, workdir, monkeypatch
):
    """A generate() call whose decode program has run starts the slots before it reads the first
    tokens (a padded grow cache: Gemma 3; an encoder's windows: Marian): transformers' tokens,
    the same as a call that reads them first."""
    from transmuter_jax.generation import prefill, slot_loop

    started = []
    real = slot_loop._started
    monkeypatch.setattr(slot_loop, "_started", lambda *a: started.append(1) or real(*a))
    the_case = case(name, "batch")
    inputs = encoder_inputs(name, the_case, [0, 1])[1] if name in ENCODER else None
    eng = engine(name, workdir)
    prompts = the_case["prompts"][:2]
    first = generation.generate(eng, prompts, [0, 0], inputs)
    second = generation.generate(eng, prompts, [0, 0], inputs)
    assert started, "a call after the decode program ran starts its slots early"
    monkeypatch.setattr(prefill, "together", lambda engine, requests: False)
    assert generation.generate(eng, prompts, [0, 0], inputs) == second == first
    assert second == [t[:NEW] for t in the_case["tokens"][:2]]
