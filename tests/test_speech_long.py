"""Long audio in the speech-to-text pipeline against transformers' ASR pipeline with
chunk_length_s=30 (references of tests/fixtures/make_speech.py on a tiny random Whisper)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from transmuter_jax.audio import SpeechToText, chunks, speech_to_text

FIXTURE = Path(__file__).parent / "fixtures" / "whisper-speech-optimum"
REF = json.loads((FIXTURE / "speech.json").read_text())
LONG = REF["long_cases"]
RATE = 16000
LOGPROB_ATOL = 1e-3  # as tests/test_speech_to_text.py


@pytest.fixture(scope="module")
def clips():
    with np.load(FIXTURE / "speech.npz") as data:
        found = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith("clip/")}
    for name, made in REF["recipes"].items():  # make_speech.long_clip
        parts = [(found[n][::-1] if r else found[n]) * np.float32(g) for n, g, r in made["pieces"]]
        found[name] = np.concatenate(parts)[: int(made["seconds"] * RATE)]
    return found


@pytest.fixture(scope="module")
def pipe() -> SpeechToText:
    return speech_to_text(FIXTURE)


def test_recipes_rebuild_the_long_inputs(clips):
    for name, made in REF["recipes"].items():
        assert len(clips[name]) == int(made["seconds"] * RATE)
        assert float(np.abs(clips[name]).sum(dtype=np.float64)) == pytest.approx(made["sum_abs"])


def _check(got, want, timestamps):
    assert got.text == want["text"]
    assert got.token_ids == want["tokens"]
    if timestamps:
        assert [c["text"] for c in got.chunks] == [c["text"] for c in want["chunks"]]
        assert [c["timestamp"] for c in got.chunks] == [
            tuple(c["timestamp"]) for c in want["chunks"]
        ]
    else:
        assert got.chunks is None


SLOW = {"chunk10"}  # 8 chunks of 10 s: a batch shape of its own


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(LONG)]
)
def test_long_audio_matches_the_pipeline(pipe, clips, name):
    """Every input chunked (chunk_length_s=30 given, as the pipeline was called): text, merged
    tokens and chunks as the pipeline's; all chunks of the batch in one generate call."""
    case = LONG[name]
    options = {"chunk_length_s": 30, **case["options"]}
    timestamps = bool(options.get("return_timestamps"))
    audio = [clips[c] for c in case["clips"]]
    results = pipe.generate(audio, sampling_rate=RATE, token_logprobs=True, **options)
    assert len(results) == len(case["rows"])
    for got, want in zip(results, case["rows"], strict=True):
        _check(got, want, timestamps)
        assert len(got.logprobs) == len(got.token_ids)
        assert all(np.isfinite(got.logprobs)) and all(p <= 0 for p in got.logprobs)
        if "max_new_tokens" in case["options"]:
            assert got.finish_reason == "length"  # max_new_tokens ends every chunk of these


DEFAULTS = ("default_timestamps", "default_options")  # the pipeline's defaults: 5 beams


def test_the_default_cases_give_no_num_beams():
    for name in DEFAULTS:
        assert "num_beams" not in LONG[name]["options"]
    assert LONG["pipeline_beams"]["options"]["num_beams"] == 5


@pytest.mark.parametrize("name", [*DEFAULTS, "pipeline_beams"])
def test_the_default_decoding_is_the_pipelines(clips, name):
    """speech_to_text() without options decodes as transformers' ASR pipeline without options
    (5 beams): texts, merged tokens and timestamps, long inputs in chunks and short ones whole."""
    pipe = speech_to_text(FIXTURE)
    case = LONG[name]
    options = {k: v for k, v in case["options"].items() if k != "num_beams"}
    options.setdefault("chunk_length_s", 30)
    timestamps = bool(options.get("return_timestamps"))
    results = pipe.generate([clips[c] for c in case["clips"]], sampling_rate=RATE, **options)
    for got, want in zip(results, case["rows"], strict=True):
        _check(got, want, timestamps)
    greedy = pipe.generate([clips[case["clips"][0]]], sampling_rate=RATE, num_beams=1, **options)
    assert greedy[0].token_ids != case["rows"][0]["tokens"]  # beams decide: the check can fail


def test_chunks_cut_and_merge_as_the_pipeline():
    """chunks.split gives the pipeline's strides, and chunks.merge of the pipeline's own chunk
    tokens gives its text, merged tokens and chunks (no model)."""
    config = json.loads((FIXTURE / "generation_config.json").read_text())
    begin = REF["timestamp_begin"]
    added = json.loads((FIXTURE / "tokenizer.json").read_text())["added_tokens"]
    special = frozenset(t["id"] for t in added if t["special"] and t["id"] < begin)
    from transmuter_jax.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(FIXTURE)
    assert chunks.lengths(30, None, RATE, 30 * RATE) == (480000, 80000, 80000)
    merged = 0
    for case in LONG.values():
        timestamps = bool(case["options"].get("return_timestamps"))
        sizes = chunks.lengths(
            case["options"].get("chunk_length_s", 30), case["options"].get("stride_length_s"),
            RATE, 30 * RATE,
        )  # fmt: skip
        for clip, row in zip(case["clips"], case["rows"], strict=True):
            length = int(REF["recipes"][clip]["seconds"] * RATE) if clip in REF["recipes"] else 0
            if length:
                cut = chunks.split(np.zeros(length, np.float32), *sizes)
                assert [list(w.stride) for w in cut] == row["strides"]
            got = chunks.merge(
                row["chunk_tokens"], [tuple(n / RATE for n in s) for s in row["strides"]],
                timestamps=timestamps, begin=begin, special=special,
                languages={i: t.strip("<|>") for t, i in config["lang_to_id"].items()},
                precision=0.02,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            )  # fmt: skip
            assert got.text == row["text"]
            assert [t for t, _, _ in got.tokens] == row["tokens"]
            if timestamps:
                assert [(c["timestamp"], c["text"]) for c in got.chunks] == [
                    (tuple(c["timestamp"]), c["text"]) for c in row["chunks"]
                ]
            merged += len(row["strides"]) > 1 and sum(map(len, row["chunk_tokens"])) > len(
                row["tokens"]
            )
    assert merged  # some overlap was merged away, so the overlap rule is tested


def test_long_input_alone_and_short_one_pass(pipe, clips):
    """Without chunk_length_s only the long input is chunked; the short one of the batch is
    one pass as alone, and the long one is as the pipeline gives it."""
    case = LONG["batch_detect"]
    long, short = (clips[c] for c in case["clips"])
    options = dict(case["options"])
    both = pipe.generate([long, short], sampling_rate=RATE, **options)
    _check(both[0], case["rows"][0], False)
    alone = pipe.generate([short], sampling_rate=RATE, **options)[0]
    assert both[1] == alone


def test_logprobs_come_from_the_chunks(pipe, clips):
    """Each merged token's log-probability is the one in the chunk it was taken from; a chunk
    decoded alone gives the pipeline's tokens of that chunk."""
    case = LONG["long45"]
    options = dict(case["options"])
    long = clips[case["clips"][0]]
    row = case["rows"][0]
    got = pipe.generate([long], sampling_rate=RATE, token_logprobs=True, **options)[0]
    pieces = [long[a : a + n] for a, (n, _, _) in zip((0, 320000), row["strides"], strict=True)]
    alone = pipe.generate(pieces, sampling_rate=RATE, token_logprobs=True, **options)
    assert [r.token_ids for r in alone] == row["chunk_tokens"]
    # two chunks: the merge keeps a head of the first and a tail of the second
    first, second = alone
    n = len(got.token_ids)
    heads = [
        k
        for k in range(n + 1)
        if first.token_ids[:k] + second.token_ids[len(second.token_ids) - (n - k) :]
        == got.token_ids
    ]
    wants = [first.logprobs[:k] + second.logprobs[len(second.logprobs) - (n - k) :] for k in heads]
    gaps = [np.max(np.abs(np.subtract(got.logprobs, want))) for want in wants]
    assert min(gaps) < LOGPROB_ATOL  # at one of the cuts that the tokens allow


def test_stream_of_long_audio_joins_to_the_text(pipe, clips):
    case = LONG["long45_timestamps"]
    pieces = list(pipe.stream(clips["long45"], sampling_rate=RATE, **case["options"]))
    assert "".join(pieces) == case["rows"][0]["text"]


def test_stereo_file_gives_the_tokens_of_transformers(pipe):
    """stereo-44k.wav through the loader (mixed down, soxr to 16 kHz) decodes as transformers
    generates from the same samples."""
    case = REF["file_cases"]["stereo"]
    options = {"num_beams": 1, **case["options"]}  # generate()'s greedy decoding
    got = pipe.generate([FIXTURE / case["file"]], token_logprobs=True, **options)[0]
    want = case["rows"][0]
    assert got.token_ids == want["tokens"] and got.text == want["text"]
    np.testing.assert_allclose(got.logprobs, want["logprobs"], atol=LOGPROB_ATOL, rtol=0)


def test_bad_chunk_options(pipe, clips):
    long = clips["long45"]
    with pytest.raises(ValueError, match=r"stride_length_s=6 is too large for chunk_length_s=10"):
        pipe.generate([long], sampling_rate=RATE, chunk_length_s=10, stride_length_s=6)
    with pytest.raises(ValueError, match="chunk_length_s=40 is longer than the feature extractor"):
        pipe.generate([clips["tone"]], sampling_rate=RATE, chunk_length_s=40)
    with pytest.raises(ValueError, match="chunk_length_s=0: sequential long-form"):
        pipe.generate([long], sampling_rate=RATE, chunk_length_s=0)
    with pytest.raises(ValueError, match="stride_length_s is not negative"):
        pipe.generate([long], sampling_rate=RATE, stride_length_s=-1)
    with pytest.raises(ValueError, match="not num_return_sequences=2"):
        pipe.generate([long], sampling_rate=RATE, num_beams=2, num_return_sequences=2)


def test_command_line_transcribes_a_long_file(clips, tmp_path, capsys):
    """`transmuter-jax transcribe --json --timestamps` on a 45 s wav: the pipeline's result."""
    import soundfile

    from transmuter_jax import cli

    case = LONG["long45_timestamps"]
    path = tmp_path / "long.wav"
    soundfile.write(path, clips["long45"], RATE, subtype="FLOAT")
    args = ["transcribe", str(FIXTURE), str(path), "--json", "--timestamps"]
    greedy = ["--num-beams", "1"]  # the reference's decoding
    assert cli.main([*args, "--language", "en", "--max-new-tokens", "24", *greedy]) == 0
    record = json.loads(capsys.readouterr().out)
    want = case["rows"][0]
    assert record["text"] == want["text"] and record["token_ids"] == want["tokens"]
    assert record["chunks"] == want["chunks"]
