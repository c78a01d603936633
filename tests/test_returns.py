"""num_return_sequences and beam search with sampling.

Beam search with num_return_sequences: token-exact with transformers 4.57.6 generate() on the
fixtures ("beam_K_return_N" cases made by the fixture factory, each prompt alone; here in one
batch), with sequences_scores and log-probabilities within 1e-4. Sampling with n sequences and
beam sampling cannot reproduce torch's RNG: their tests check the seed rule, reproducibility,
independence from the batch, and the distribution of the beam candidates.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from generation_cases import case, context, encoder_inputs, reference

from transmuter_jax import generation, text
from transmuter_jax.generation.loop import through_slots
from transmuter_jax.generation.processors import Rows
from transmuter_jax.generation.select import beam_selection

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
RETURNS = ["llama-optimum", "llama-genai-fp32", "marian-optimum"]  # append, in_place, grow
GROW_CASES = ("beam_4_return_3", "beam_4_return_4_eos_list")  # grow compiles more: two cover it


def _return_cases():
    params = []
    for name in RETURNS:
        for c in reference(name)[0]["cases"]:
            if c["options"].get("num_return_sequences", 1) == 1:
                continue
            if name == "marian-optimum" and c["name"] not in GROW_CASES:
                continue
            params.append(pytest.param(name, c["name"], id=f"{name}/{c['name']}"))
    return params


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("returns")


def test_every_returns_fixture_has_its_cases():
    assert len(_return_cases()) == 4 + 4 + 2


@pytest.mark.parametrize(("name", "case_name"), _return_cases())
def test_beam_returns_equal_transformers(name, case_name, workdir):
    the_case = case(name, case_name)
    prompts = the_case["prompts"]
    n = the_case["options"]["num_return_sequences"]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts))))
    options = {k: v for k, v in the_case["options"].items() if k != "do_sample"}
    ctx = context(name, workdir, given=given, token_logprobs=True, **options)
    ctx = generation.compile(ctx, len(prompts))
    events = []
    out = generation.generate(ctx, prompts, [0] * len(prompts), inputs, on_token=events.append)
    assert [len(sequences) for sequences in out] == [n] * len(prompts)
    tokens = [[[t for t, _ in seq] for seq in sequences] for sequences in out]
    assert tokens == the_case["tokens"]
    np.testing.assert_allclose(events[-1]["scores"], the_case["sequences_scores"], atol=1e-4)
    np.testing.assert_array_equal(events[-1]["score"], events[-1]["scores"][:, 0])
    for sequences, logprobs in zip(out, the_case["logprobs"], strict=True):
        for seq, want in zip(sequences, logprobs, strict=True):
            np.testing.assert_allclose([lp for _, lp in seq], want[: len(seq)], atol=1e-4)


def test_beam_returns_start_with_the_one_best(workdir):
    """The first of the n sequences is what num_return_sequences=1 returns."""
    the_case = case("llama-optimum", "beam_4_return_3")
    prompts = the_case["prompts"]
    options = {k: v for k, v in the_case["options"].items() if k != "num_return_sequences"}
    ctx = generation.compile(context("llama-optimum", workdir, **options), len(prompts))
    best = generation.generate(ctx, prompts, [0] * len(prompts))
    assert best == [sequences[0] for sequences in the_case["tokens"]]


# -- sampling with n sequences per prompt ----------------------------------------------------


def _sampling(workdir, n, batch, **options):
    options = dict(do_sample=True, max_new_tokens=8, eos_token_id=[], **options)
    ctx = context("llama-optimum", workdir, num_return_sequences=n, **options)
    return generation.compile(ctx, batch)


def test_sampled_sequences_follow_the_seed_rule(workdir):
    """Sequence j of a prompt of seed s is the one sequence of seed return_seed(s, j); sequence
    0 is the n = 1 result; the rows do not depend on the batch."""
    prompts = case("llama-optimum", "batch")["prompts"]  # 5, 1, 40 and 9 tokens
    seeds = [7, 2**40 + 3, -5, 123456789]
    ctx = _sampling(workdir, 3, len(prompts))
    assert through_slots(ctx, {})  # each sequence in a slot of its own
    events = []
    out = generation.generate(ctx, prompts, seeds, on_token=events.append)
    assert [len(sequences) for sequences in out] == [3] * len(prompts)
    assert all(len(seq) == 8 for sequences in out for seq in sequences)
    assert events[0]["token"].shape == (len(prompts) * 3,)  # rows p * n + j
    assert generation.generate(ctx, prompts, seeds) == out  # reproducible
    for sequences in out:  # independent draws
        assert len({tuple(seq) for seq in sequences}) == 3
    one = _sampling(workdir, 1, 1)
    for prompt, seed, sequences in zip(prompts, seeds, out, strict=True):
        for j, seq in enumerate(sequences):
            assert generation.generate(one, [prompt], [generation.return_seed(seed, j)]) == [seq]
    alone = _sampling(workdir, 3, 1)
    assert generation.generate(alone, [prompts[2]], [seeds[2]]) == [out[2]]


def test_return_seed_rule():
    assert generation.return_seed(11, 0) == 11
    assert generation.return_seed(11, 1) == 11 + 0x9E3779B9
    assert generation.return_seed(2**32 - 1, 2) == (2**32 - 1 + 2 * 0x9E3779B9) % 2**32


def test_sampled_sequences_are_the_same_on_the_device_and_on_the_host(workdir):
    prompts = case("llama-optimum", "batch")["prompts"][:2]
    device = _sampling(workdir, 2, 2, token_logprobs=True)
    host = _sampling(workdir, 2, 2, token_logprobs=True, decode_steps=1)
    assert generation.on_device(device) and not generation.on_device(host)
    a = generation.generate(device, prompts, [3, 4])
    b = generation.generate(host, prompts, [3, 4])
    assert [[[t for t, _ in s] for s in p] for p in a] == [
        [[t for t, _ in s] for s in p] for p in b
    ]
    flat = lambda out: [lp for p in out for s in p for _, lp in s]  # noqa: E731
    np.testing.assert_allclose(flat(a), flat(b), 1e-5)


def test_sampled_sequences_of_an_encoder_decoder(workdir):
    """The encoder outputs follow the rows (grow, marian): sequence j is the one of its seed."""
    the_case = case("marian-optimum", "beam_4_return_3")
    rows = [0, 1]
    given, inputs = encoder_inputs("marian-optimum", the_case, rows)
    prompts = [the_case["prompts"][i] for i in rows]
    options = dict(do_sample=True, max_new_tokens=6, eos_token_id=[])
    ctx = context("marian-optimum", workdir, given=given, num_return_sequences=2, **options)
    out = generation.generate(generation.compile(ctx, 2), prompts, [5, 6], inputs)
    one = generation.compile(context("marian-optimum", workdir, given=given, **options), 2)
    for j in range(2):
        seeds = [generation.return_seed(5, j), generation.return_seed(6, j)]
        assert generation.generate(one, prompts, seeds, inputs) == [p[j] for p in out]


def test_greedy_with_several_sequences_is_refused(workdir):
    with pytest.raises(ValueError, match="needs sampling"):
        context("llama-optimum", workdir, num_return_sequences=2)


# -- beam search with sampling ----------------------------------------------------------------


def test_beam_candidates_are_drawn_without_replacement_from_the_softmax():
    """With do_sample, the K candidates of a prompt are drawn one after another without
    replacement, each with probability softmax(accumulated scores) renormalized over what is
    left: the frequencies of the first and second draws over 40000 seeds, within 5 sigma."""
    vocab, prompts = 4, 40000
    options = generation.Options(
        num_beams=2, do_sample=True, top_k=0, eos_token_id=(0,), max_new_tokens=4
    )
    select = beam_selection(options, (), {})
    logits = np.array([[1.0, 0.2, -0.5, 0.7], [0.3, 0.9, -1.0, 0.0]], np.float32)
    running = np.array([0.0, -0.6], np.float32)
    batch = 2 * prompts
    rows = Rows(
        np.full((batch, 1), -1, np.int32),
        np.ones(batch, np.int32),
        np.ones(batch, np.int32),
        np.full(batch, 5, np.int32),
    )
    out = np.asarray(
        select(
            np.tile(logits, (prompts, 1)),
            np.tile(running, prompts),
            np.arange(prompts, dtype=np.int32),
            np.full(prompts, 3, np.int32),
            rows,
            (),
        )
    )  # [P, K, 4]: token, source beam, bits of the accumulated score, bits of the logprob
    assert out.shape == (prompts, 4, 4)
    drawn = out[:, :, 1] * vocab + out[:, :, 0]  # [P, K] index into the 2 * vocab candidates
    ordered = np.sort(drawn, axis=1)
    assert (ordered[:, 1:] != ordered[:, :-1]).all()  # without replacement
    logprob = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    total = (logprob + running[:, None]).reshape(-1)
    np.testing.assert_allclose(
        out[:, :, 2].view(np.float32), total[drawn], rtol=1e-6
    )  # the accumulated score of each candidate
    np.testing.assert_allclose(out[:, :, 3].view(np.float32), logprob.reshape(-1)[drawn], 1e-6)
    p = np.exp(total - np.logaddexp.reduce(total))
    others = range(len(p))
    second = np.array([sum(p[i] * p[j] / (1 - p[i]) for i in others if i != j) for j in others])
    for want, got in ((p, drawn[:, 0]), (second, drawn[:, 1])):
        freq = np.bincount(got, minlength=len(p)) / prompts
        sigma = np.sqrt(want * (1 - want) / prompts)
        assert (np.abs(freq - want) < 5 * sigma + 1e-9).all(), (freq, want)
    again = select(
        np.tile(logits, (4, 1)),
        np.tile(running, 4),
        np.arange(4, dtype=np.int32),
        np.array([3, 3, 4, 4], np.int32),
        Rows(*(a[:8] for a in (rows.history, rows.prompt, rows.length, rows.max_length))),
        (),
    )
    again = np.asarray(again)[:2]  # the key is the seed and step's, whatever the batch
    np.testing.assert_array_equal(again[..., :2], out[:2, :, :2])
    np.testing.assert_allclose(
        again[..., 2:].view(np.float32), out[:2, :, 2:].view(np.float32), 1e-6
    )


def test_beam_sampling_is_reproducible_and_batch_independent(workdir):
    prompts = case("llama-optimum", "batch")["prompts"]
    seeds = [11, 12, 13, 14]
    options = dict(
        num_beams=3,
        do_sample=True,
        top_k=0,  # no warper: a beam's score is the sum of its tokens' log-probabilities
        num_return_sequences=3,
        max_new_tokens=8,
        eos_token_id=[],
        token_logprobs=True,
    )
    ctx = generation.compile(context("llama-optimum", workdir, **options), len(prompts))
    events = []
    out = generation.generate(ctx, prompts, seeds, on_token=events.append)
    assert generation.generate(ctx, prompts, seeds) == out
    tokens = lambda out: [[[t for t, _ in s] for s in p] for p in out]  # noqa: E731
    alone = generation.compile(context("llama-optimum", workdir, **options), 1)
    one = generation.generate(alone, [prompts[1]], [seeds[1]])
    assert tokens(one) == tokens([out[1]])
    np.testing.assert_allclose(
        [[lp for _, lp in s] for s in one[0]], [[lp for _, lp in s] for s in out[1]], 1e-5
    )
    assert tokens(generation.generate(ctx, prompts, [s + 100 for s in seeds])) != tokens(out)
    scores = events[-1]["scores"]
    assert (np.diff(scores, axis=1) <= 0).all()  # best first
    for sequences, row in zip(out, scores, strict=True):  # sum of log-probabilities / length
        np.testing.assert_allclose([sum(lp for _, lp in s) / len(s) for s in sequences], row, 1e-5)
    greedy = dict(options, do_sample=False)
    beams = generation.compile(context("llama-optimum", workdir, **greedy), len(prompts))
    assert tokens(generation.generate(beams, prompts, seeds)) != tokens(out)


# -- the text pipelines -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return text.generation(FIXTURES / "llama-optimum")


def test_text_generation_returns_n_results_per_prompt(llama, workdir):
    prompts = ["The quiet river", "A good translation keeps"]
    options = dict(num_beams=4, num_return_sequences=3, max_new_tokens=8)
    results = llama.generate(prompts, **options)
    assert [len(r) for r in results] == [3, 3]
    ids = [llama.prompt_ids(p) for p in prompts]
    ctx = generation.compile(context("llama-optimum", workdir, **options), 2)
    assert [[r.token_ids for r in rs] for rs in results] == generation.generate(ctx, ids, [0, 0])
    for rs in results:
        for r in rs:
            assert r.text == llama.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            assert r.finish_reason == ("length" if len(r.token_ids) == 8 else "eos")
    assert llama(prompts[0], **options) == [r.text for r in results[0]]
    assert llama(prompts, **options) == [[r.text for r in rs] for rs in results]
    assert results[0][0].text == llama(prompts[0], num_beams=4, max_new_tokens=8)
    sampled = llama(prompts[0], do_sample=True, num_return_sequences=2, seed=3, max_new_tokens=8)
    assert len(sampled) == 2
    assert sampled[0] == llama(prompts[0], do_sample=True, seed=3, max_new_tokens=8)
    seed = generation.return_seed(3, 1)
    assert sampled[1] == llama(prompts[0], do_sample=True, seed=seed, max_new_tokens=8)


def test_a_stream_of_several_sequences_gives_indexed_pieces(llama):
    options = dict(do_sample=True, num_return_sequences=2, seed=4, max_new_tokens=8)
    pieces = list(llama.stream("The quiet river", **options))
    assert {j for j, _ in pieces} <= {0, 1}
    joined = ["".join(p for j, p in pieces if j == i) for i in range(2)]
    assert joined == llama("The quiet river", **options)


def test_text_to_text_returns_n_texts():
    marian = text.text_to_text(FIXTURES / "marian-optimum")
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    out = marian(["Hello world.", "The sea."], **options)
    assert [len(o) for o in out] == [2, 2] and all(isinstance(t, str) for o in out for t in o)
    assert out[0][0] == marian("Hello world.", num_beams=3, max_new_tokens=6)
