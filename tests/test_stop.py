"""Stop strings: the matching rule, token parity with transformers' generate(stop_strings=...,
tokenizer=...) on the llama-optimum "stop_*" cases (the fixture factory's references), host steps
and decode chunks, the text pipelines' stop= option (trimming, finish_reason, streaming) and
the CLI's --stop."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from generation_cases import case, decoder, tiered

from transmuter_jax import generation, text
from transmuter_jax.generation.stops import StopStrings
from transmuter_jax.onnx.errors import ModelFileError

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FOLDER = FIXTURES / "llama-optimum"
CASES = ["stop_split", "stop_overhang", "stop_prompt", "stop_several", "stop_multibyte"]
CASES += ["stop_batch"]


# -- the rule, on token texts made by hand ------------------------------------------------------

WORDS = ["st", "op", "stop", "opera", "sto", "pper", "las", "topper", "s", "to", "pped", "at"]
WORDS += ["tion", "", "p", "caf", "\u00e9", "\ufffd", "\u00e9t\u00e9"]


def _ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


@pytest.mark.parametrize(
    "words",
    [["st", "op"], ["stop"], ["st", "opera"], ["sto", "pper"], ["las", "topper"]]
    + [["s", "to", "pped"], ["s", "", "to", "p"], ["at", "stop"]],
)
def test_a_stop_string_that_ends_in_the_last_token_hits(words):
    assert StopStrings(["stop"], WORDS).hit(_ids(*words))


@pytest.mark.parametrize(
    "words",
    [["stop", "at"], ["st", "op", "at"], ["st", "opera", "tion"], ["st", "op", ""], ["sto"]],
)
def test_a_stop_string_the_last_token_does_not_reach_does_not_hit(words):
    assert not StopStrings(["stop"], WORDS).hit(_ids(*words))


def test_the_window_is_the_longest_string_in_tokens_and_unknown_ids_break_it():
    stops = StopStrings(["stop", "ab"], WORDS)
    assert stops.window == 4
    # five tokens back is outside the window, even when four of them are empty
    assert not stops.hit(_ids("s", "", "", "to", "p"))
    assert stops.hit(_ids("s", "", "to", "p"))
    unknown = len(WORDS) + 3
    assert not stops.hit([*_ids("st"), unknown])
    assert not stops.hit([*_ids("st"), unknown, *_ids("op")])
    texts = [*WORDS, None]  # an id the tokenizer does not know is None
    assert not StopStrings(["stop"], texts).hit([*_ids("st"), len(WORDS), *_ids("op")])


def test_multi_byte_strings_compare_characters_of_each_token_text():
    stops = StopStrings(["\u00e9"], WORDS)
    assert stops.hit(_ids("caf", "\u00e9"))
    assert stops.hit(_ids("caf", "\u00e9t\u00e9"))  # the last token runs past the string
    # the two bytes of a character are two tokens whose texts are U+FFFD: no hit
    assert not stops.hit(_ids("caf", "\ufffd", "\ufffd"))
    assert StopStrings(["\ufffd"], WORDS).hit(_ids("caf", "\ufffd"))


def test_strings_no_token_can_end_are_refused():
    with pytest.raises(ValueError, match="no token of the vocabulary can end"):
        StopStrings(["xyz"], WORDS)


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "stop_strings must not be empty"),
        ([""], "non-empty strings"),
        (["a", 3], "non-empty strings"),
        (7, "a string or a list of strings"),
    ],
)
def test_bad_stop_strings_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        generation.Options(stop_strings=value)


def test_stop_strings_take_a_string_or_a_list_and_run_with_beam_search():
    """Beam search with stop strings is transformers' (a stop string ends a candidate as eos
    does): token-exact in test_options_cases.py's "options_beam_stop_strings" cases."""
    assert generation.Options(stop_strings="ab").stop_strings == ("ab",)
    assert generation.Options(stop_strings=["a", "b"]).stop_strings == ("a", "b")
    ctx = generation.context(FOLDER, decoder("llama-optimum"), stop_strings=["a"], num_beams=2)
    assert ctx.stops.strings == ("a",) and ctx.options.num_beams == 2


def test_generation_config_json_with_stop_strings_loads_and_reads_the_tokenizer(tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FOLDER / name, tmp_path / name)
    config = json.loads((FOLDER / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "stop_strings": "ie"}))
    ctx = generation.context(tmp_path, decoder("llama-optimum"))
    assert ctx.options.stop_strings == ("ie",) and ctx.stops.strings == ("ie",)
    assert generation.context(tmp_path, decoder("llama-optimum"), stop_strings=None).stops is None
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match="no tokenizer.json"):
        generation.context(tmp_path, decoder("llama-optimum"))


# -- parity with transformers -------------------------------------------------------------------


def _context(stops, decode_steps, batch=1):
    ctx = generation.context(
        FOLDER, decoder("llama-optimum"), max_new_tokens=16, stop_strings=stops,
        decode_steps=decode_steps,
    )  # fmt: skip
    return generation.compile(ctx, batch)


def test_the_cases_stop_where_they_are_meant_to():
    """The references cover what they are named for (else the parity below proves little)."""
    full = case("llama-optimum", "text")["tokens"]
    texts = _context(["x"], 1).stops._texts
    split = case("llama-optimum", "stop_split")
    for stops, tokens in zip(split["stop_strings"], split["tokens"], strict=True):
        assert stops[0] not in texts[tokens[-1]]  # the string spans two tokens or more
    overhang = case("llama-optimum", "stop_overhang")
    for stops, tokens in zip(overhang["stop_strings"], overhang["tokens"], strict=True):
        assert not "".join(texts[t] for t in tokens).endswith(stops[0])  # the last token runs on
    assert case("llama-optimum", "stop_prompt")["tokens"] == [t[:1] for t in full]
    multibyte = case("llama-optimum", "stop_multibyte")
    assert "\u00e9" in multibyte["texts"][1] and multibyte["stopped_at_stop"] == [True, True, False]
    batch = case("llama-optimum", "stop_batch")
    assert all(batch["stopped_at_stop"]) and len({len(t) for t in batch["tokens"]}) == 3
    for name in CASES:
        c = case("llama-optimum", name)
        assert any(c["stopped_at_stop"]), name
        for tokens, reference in zip(c["tokens"], full, strict=True):
            assert tokens == reference[: len(tokens)]


@pytest.mark.parametrize(
    ("name", "decode_steps"),
    # the quick tier: every case in the device loop, every other one on the host path too
    [
        tiered(n, d, id=f"{n}-{d}", quick=d == 16 or i % 2 == 0)
        for i, n in enumerate(CASES)
        for d in (1, 16)
    ],  # fmt: skip
)
def test_tokens_equal_transformers_generate_with_stop_strings(name, decode_steps):
    the_case = case("llama-optimum", name)
    rows = zip(the_case["input_ids"], the_case["stop_strings"], the_case["tokens"], strict=True)
    for i, (prompt, stops, want) in enumerate(rows):  # one at a time, as transformers ran them
        ctx = _context(stops, decode_steps)
        assert generation.on_device(ctx) == (decode_steps > 1)
        assert generation.generate(ctx, [prompt], [0]) == [want], (name, i)


@pytest.mark.parametrize("decode_steps", [1, 4, 16])
def test_a_batch_whose_rows_stop_at_different_steps(decode_steps):
    the_case = case("llama-optimum", "stop_batch")
    prompts = the_case["input_ids"]
    ctx = _context(the_case["stop_strings"][0], decode_steps, batch=4)
    events = []
    out = generation.generate(ctx, [*prompts, []], [0] * 4, on_token=events.append)
    assert out == [*the_case["tokens"], []]
    tokens = np.array([e["token"] for e in events])  # [steps, rows]
    finished = np.array([e["finished"] for e in events])
    for row, want in enumerate(the_case["tokens"]):
        taken = tokens[tokens[:, row] >= 0, row].tolist()
        assert taken == want  # after the stop the row shows no token, even inside a chunk
        last = int(np.flatnonzero(tokens[:, row] >= 0)[-1])
        assert finished[last:, row].all() and not finished[:last, row].any()
    if decode_steps == 1:
        return
    host = []
    generation.generate(_context(the_case["stop_strings"][0], 1, 4), [*prompts, []], [0] * 4,
                        on_token=host.append)  # fmt: skip
    assert len(host) == len(events)
    for a, b in zip(host, events, strict=True):
        assert (a["token"] == b["token"]).all() and (a["finished"] == b["finished"]).all()


# -- the text pipeline --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return text.generation(FOLDER, max_new_tokens=16)


def _cut(text_: str, stops) -> str:
    hits = [text_.find(s) for s in stops if s in text_]
    return text_[: min(hits)] if hits else text_


@pytest.mark.parametrize("name", CASES)
def test_the_pipeline_cuts_the_stop_string_and_says_stop(llama, name):
    the_case = case("llama-optimum", name)
    rows = zip(the_case["texts"], the_case["stop_strings"], strict=True)
    for i, (source, stops) in enumerate(rows):
        kept = llama.generate([source], chat=False, stop_strings=stops)[0]
        assert kept.token_ids == the_case["tokens"][i]
        assert kept.text == the_case["decoded"][i]  # stop_strings alone keeps transformers' text
        cut = llama.generate([source], chat=False, stop=stops)[0]
        assert cut.token_ids == the_case["tokens"][i]
        stopped = the_case["stopped_at_stop"][i]
        assert cut.finish_reason == ("stop" if stopped else "length")
        if name == "stop_prompt":  # the string starts in the prompt: nothing of it is left
            assert cut.text == ""
        elif name != "stop_multibyte":
            assert cut.text == _cut(the_case["decoded"][i], stops) != the_case["decoded"][i]
        assert not any(s in cut.text for s in stops)


def test_stop_and_stop_strings_must_agree(llama):
    with pytest.raises(ValueError, match="disagree"):
        llama("The quiet river", chat=False, stop=["a"], stop_strings=["b"])
    with pytest.raises(ValueError, match="stop_strings must not be empty"):
        llama("The quiet river", chat=False, stop=[])


@pytest.mark.parametrize("name", ["stop_split", "stop_overhang", "stop_several", "stop_batch"])
def test_a_stream_never_sends_text_past_the_stop_string(llama, name):
    the_case = case("llama-optimum", name)
    rows = zip(the_case["texts"], the_case["stop_strings"], strict=True)
    for source, stops in rows:
        whole = llama(source, chat=False, stop=stops)
        pieces = list(llama.stream(source, chat=False, stop=stops))
        assert "".join(pieces) == whole
        for k in range(1, len(pieces) + 1):  # every prefix the reader sees is a prefix of it
            assert whole.startswith("".join(pieces[:k]))
    plain = case("llama-optimum", "text")
    assert "".join(llama.stream(plain["texts"][0], chat=False)) == plain["decoded"][0]


def test_the_cli_stop_option_cuts_the_answer():
    the_case = case("llama-optimum", "stop_several")
    source, stops = the_case["texts"][1], the_case["stop_strings"][1]
    args = [sys.executable, "-m", "transmuter_jax", "generate", str(FOLDER), source]
    args += ["--no-chat-template", "--max-new-tokens", "16"]
    for s in stops:
        args += ["--stop", s]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    record = subprocess.run([*args, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert record.returncode == 0, record.stderr
    result = json.loads(record.stdout)
    assert result["token_ids"] == the_case["tokens"][1]
    assert result["finish_reason"] == "stop"
    assert result["text"] == _cut(the_case["decoded"][1], stops)
    streamed = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == result["text"] + "\n"


def test_the_compiled_programs_do_not_depend_on_the_stop_strings():
    plain, stopping = generation.Options(), generation.Options(stop_strings=["a", "b"])
    assert stopping.program_key == plain.program_key == repr(plain)
    assert generation.Options(top_k=3).program_key != plain.program_key
