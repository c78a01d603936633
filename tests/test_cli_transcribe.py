"""`transmuter-jax transcribe` on the tiny Whisper fixture: the same text and tokens as the
speech pipeline, JSON, SubRip, and clear errors."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest

from transmuter_jax import audio, cli
from transmuter_jax.audio.timestamps import clock
from transmuter_jax.audio.timestamps import spans as spans_of
from transmuter_jax.cli import inputs

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "whisper-speech-optimum"
MODEL = str(FIXTURE)
CLIP = str(FIXTURE / "stereo-44k.wav")
OPTIONS = ["--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def pipe():
    return audio.speech_to_text(MODEL)


def _run(capsys, *args: str) -> str:
    assert cli.main(["transcribe", *args]) == 0
    return capsys.readouterr().out


def test_text_is_the_pipelines(pipe, capsys):
    expected = pipe(CLIP, max_new_tokens=8)
    assert _run(capsys, MODEL, CLIP, *OPTIONS) == expected + "\n"
    assert _run(capsys, MODEL, CLIP, CLIP, *OPTIONS) == 2 * (expected + "\n")


def test_num_beams_one_decodes_greedily(pipe, capsys):
    """The default is the ASR pipeline's 5 beams; --num-beams 1 is the greedy transcript."""
    greedy = pipe.generate([CLIP], max_new_tokens=8, num_beams=1, token_logprobs=True)[0]
    lines = _run(capsys, MODEL, CLIP, "--json", "--num-beams", "1", *OPTIONS).splitlines()
    assert json.loads(lines[0])["token_ids"] == greedy.token_ids
    beams = json.loads(_run(capsys, MODEL, CLIP, "--json", *OPTIONS).splitlines()[0])
    assert beams["token_ids"] == pipe.generate([CLIP], max_new_tokens=8)[0].token_ids


def test_json_is_the_pipelines_result(pipe, capsys):
    result = pipe.generate([CLIP], max_new_tokens=8, language="de", token_logprobs=True)[0]
    lines = _run(capsys, MODEL, CLIP, "--json", "--language", "de", *OPTIONS).splitlines()
    record = json.loads(lines[0])
    assert len(lines) == 1
    assert record["file"] == CLIP
    assert record["token_ids"] == result.token_ids
    assert record["text"] == result.text
    assert record["finish_reason"] == result.finish_reason
    assert record["logprobs"] == pytest.approx(result.logprobs)


def test_srt_and_timestamps_follow_the_chunks(pipe, capsys):
    result = pipe.generate([CLIP], max_new_tokens=12, return_timestamps=True)[0]
    srt = _run(capsys, MODEL, CLIP, "--srt", "--max-new-tokens", "12")
    cues = re.findall(r"^(\d+)\n(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})$", srt, re.M)
    assert [int(c[0]) for c in cues] == list(range(1, len(result.chunks) + 1))
    for (_, begin, _end), chunk in zip(cues, result.chunks, strict=True):
        assert begin == clock(chunk["timestamp"][0], True)
    plain = _run(capsys, MODEL, CLIP, "--timestamps", "--max-new-tokens", "12")
    assert len(plain.splitlines()) == len(result.chunks)


def test_an_unfinished_last_chunk_ends_with_the_audio(tmp_path, capsys):
    """The pipeline's last chunk of the "timestamps" reference has no end (text after a lone
    timestamp): SubRip and --timestamps end it at the audio's duration (never before its
    start), and JSON keeps the pipeline's null."""
    soundfile = pytest.importorskip("soundfile")
    reference = json.loads((FIXTURE / "speech.json").read_text())["cases"]["timestamps"]
    chunks = reference["rows"][0]["chunks"]
    assert chunks[-1]["timestamp"][1] is None and chunks[0]["timestamp"][1] is not None
    with np.load(FIXTURE / "speech.npz") as data:
        samples = data["clip/noise"]
    path = str(tmp_path / "noise.wav")
    soundfile.write(path, samples, 16000, subtype="FLOAT")
    duration = len(samples) / 16000
    args = [MODEL, path, "--language", "en", "--max-new-tokens", "24", "--num-beams", "1"]
    srt = _run(capsys, *args, "--srt")
    cues = re.findall(r"^\d+\n(\S+) --> (\S+)\n(.*)$", srt, re.M)
    assert [c[2] for c in cues] == [c["text"].strip() for c in chunks]
    start = chunks[-1]["timestamp"][0]
    assert cues[-1][:2] == (clock(start, True), clock(max(start, duration), True))
    assert cues[0][1] == clock(chunks[0]["timestamp"][1], True)
    plain = _run(capsys, *args, "--timestamps").splitlines()
    assert plain[-1].startswith(f"[{clock(start)} - {clock(max(start, duration))}]")
    record = json.loads(_run(capsys, *args, "--json", "--timestamps"))
    assert record["chunks"] == chunks


def test_spans_fill_missing_times():
    chunks = [
        {"timestamp": (None, 1.0), "text": "a"},
        {"timestamp": (1.0, None), "text": "b"},
        {"timestamp": (None, 4.0), "text": "c"},
        {"timestamp": (3.0, 3.5), "text": "d"},
        {"timestamp": (5.0, None), "text": "e"},
    ]
    spans = spans_of(chunks, duration=9.0)
    assert spans == [(0.0, 1.0), (1.0, 3.0), (3.0, 4.0), (3.0, 3.5), (5.0, 9.0)]
    assert spans_of([{"timestamp": (12.0, None), "text": "x"}], duration=2.0) == [(12.0, 12.0)]


def test_model_and_audio_are_told_apart(tmp_path):
    assert inputs.model_and_audio([MODEL, CLIP]) == (MODEL, [CLIP])
    assert inputs.model_and_audio([CLIP]) == (None, [CLIP])
    assert inputs.model_and_audio(["speech-base", CLIP]) == ("speech-base", [CLIP])
    assert inputs.model_and_audio(["openai/whisper-tiny", "a.wav"]) == (
        "openai/whisper-tiny",
        ["a.wav"],
    )
    with pytest.raises(ValueError, match="no AUDIO file after MODEL"):
        inputs.model_and_audio([MODEL])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([MODEL, "/no/such/clip.wav"], "no audio file '/no/such/clip.wav'"),
        ([MODEL], "no AUDIO file after MODEL"),
    ],
)
def test_errors_are_one_clear_line(args, message, capsys):
    assert cli.main(["transcribe", *args]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_clock():
    assert clock(3725.5) == "01:02:05.500"
    assert clock(0.04, comma=True) == "00:00:00,040"
