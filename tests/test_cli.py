"""The command line on fixtures: arguments, stdin, JSON, errors, warnings, beam streaming."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from transmuter_jax import cli
from transmuter_jax.cli.options import generation_options

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MODEL = str(FIXTURES / "llama-genai-fp32")


def _cli(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transmuter_jax", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
        timeout=300,
    )


def test_generate_streams_to_stdout_and_json_has_tokens():
    out = _cli("generate", MODEL, "hello world", "--max-new-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert len(record["token_ids"]) == len(record["logprobs"]) <= 6
    assert record["finish_reason"] in ("eos", "length")
    plain = _cli("generate", MODEL, "-", "--max-new-tokens", "6", stdin="hello world\n")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == record["text"] + "\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "/no/such/folder", "hi"], "no model folder '/no/such/folder'"),
        (["generate", str(FIXTURES / "processors"), "hi"], "has no decoder"),
        (["generate", MODEL, "hi", "--num-beams", "0"], "--num-beams: 0 is out of range"),
        (["generate", MODEL, "hi", "--max-new-tokens", "-3"], "--max-new-tokens: -3 is out of"),
        (["generate", MODEL, "-"], "empty"),
        (
            ["translate", MODEL, "hi"],
            "is a decoder-only text-generation model: use 'transmuter-jax generate MODEL PROMPT'",
        ),
        (["generate", str(FIXTURES / "marian-optimum"), "hi"], "use 'transmuter-jax translate"),
    ],
)
def test_errors_are_one_clear_line(args, message):
    out = _cli(*args, stdin="")
    assert out.returncode in (1, 2)  # 2: refused by the argument parser (a usage error)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("transmuter-jax: error:") and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_verbose_shows_the_traceback():
    out = _cli("generate", "/no/such/folder", "hi", "--verbose")
    assert out.returncode == 1 and "Traceback" in out.stderr


def test_python_m_and_the_console_script_are_one_program():
    assert cli.parser().prog == "transmuter-jax"
    out = _cli("--help")
    assert out.returncode == 0
    for command in ("generate", "chat", "translate", "prepare"):
        assert command in out.stdout


def test_options_map_to_transformers_names():
    args = cli.parser().parse_args(
        ["generate", "p", "--temperature", "0.7", "--top-k", "5", "--num-beams", "2"]
    )
    assert generation_options(args) == {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 5,
        "num_beams": 2,
    }
    greedy = cli.parser().parse_args(["generate", "p", "--max-new-tokens", "3"])
    assert generation_options(greedy) == {"max_new_tokens": 3}


def test_usage_errors_exit_2():
    out = _cli("generate", MODEL, "hi", "--no-such-option")
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-option" in out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", MODEL, "--dtype", "int4", "Hi"],
        ["generate", "--dtype", "int4", MODEL, "Hi"],
        ["generate", MODEL, "Hi", "--dtype", "int4"],
        ["generate", MODEL, "--dtype", "int4", "--", "Hi"],
    ],
)
def test_options_may_stand_anywhere(argv):
    args = cli.parse(argv)
    assert args.args == [MODEL, "Hi"] and args.dtype == "int4"


def test_a_prompt_after_dashes_may_start_with_a_dash():
    assert cli.parse(["generate", MODEL, "--", "-5 degrees"]).args == [MODEL, "-5 degrees"]


def test_temperature_0_is_greedy_and_warns_about_what_it_ignores():
    warnings = []
    args = cli.parse(["generate", "p", "--temperature", "0", "--top-k", "5"])
    assert generation_options(args, warnings.append) == {"do_sample": False}
    assert warnings == ["--temperature 0 is greedy decoding: --top-k ignored"]
    assert generation_options(
        cli.parse(["generate", "p", "--temperature", "0"]), warnings.append
    ) == {"do_sample": False}
    assert len(warnings) == 1


@pytest.fixture(scope="module")
def greedy_record():
    out = _cli("generate", MODEL, "hello world", "--max-new-tokens", "8", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_options_between_model_and_prompt_and_temperature_0_in_a_run(greedy_record):
    out = _cli(
        "generate", "--json", MODEL, "--temperature", "0", "--max-new-tokens", "8", "hello world"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == greedy_record["token_ids"]
    assert "transmuter-jax: warning" not in out.stderr


def test_seed_without_sampling_warns(capsys):
    args = ["generate", MODEL, "hello world", "--max-new-tokens", "2", "--seed", "3"]
    assert cli.main(args) == 0
    assert "warning: --seed only matters when sampling" in capsys.readouterr().err
    assert cli.main([*args, "--sample"]) == 0
    assert "transmuter-jax: warning" not in capsys.readouterr().err


@pytest.mark.parametrize("num_beams", ["2", "3", "4"])
def test_beam_search_streams_the_json_text(num_beams):
    args = ["generate", MODEL, "the little fox", "--max-new-tokens", "10", "--num-beams", num_beams]
    record = _cli(*args, "--json")
    assert record.returncode == 0, record.stderr
    streamed = _cli(*args)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == json.loads(record.stdout)["text"] + "\n"


def test_a_first_run_says_it_compiles_and_a_cached_run_is_quiet(tmp_path):
    args = ["generate", MODEL, "hello world", "--max-new-tokens", "3"]
    cold = _cli(*args, TRANSMUTER_JAX_COMPILE_CACHE=str(tmp_path))
    assert cold.returncode == 0, cold.stderr
    assert "transmuter-jax: compiling" in cold.stderr
    assert re.search(r"transmuter-jax: compiled \d+ programs? in \d+\.\d s", cold.stderr)
    warm = _cli(*args, TRANSMUTER_JAX_COMPILE_CACHE=str(tmp_path))
    assert warm.returncode == 0, warm.stderr
    assert warm.stdout == cold.stdout and "transmuter-jax: compil" not in warm.stderr


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize(
    "extra", [["--num-beams", "3"], ["--sample", "--seed", "5"]], ids=["beams", "sampling"]
)
def test_num_return_sequences_prints_one_json_object_per_sequence(extra, capsys):
    from transmuter_jax import text

    args = ["generate", MODEL, "the little fox", "--max-new-tokens", "6", *extra]
    assert cli.main([*args, "--num-return-sequences", "3", "--json"]) == 0
    records = _lines(capsys.readouterr().out)
    options = {"num_beams": 3} if "--num-beams" in extra else {"do_sample": True}
    seed = 5 if "--seed" in extra else None
    pipe = text.generation(MODEL)
    want = pipe.generate(
        ["the little fox"], seed=seed, max_new_tokens=6, num_return_sequences=3, **options
    )[0]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["token_ids"] for r in records] == [w.token_ids for w in want]
    assert [r["text"] for r in records] == [w.text for w in want]
    assert all(len(r["logprobs"]) == len(r["token_ids"]) for r in records)
    assert cli.main([*args, "--num-return-sequences", "3"]) == 0
    assert capsys.readouterr().out == "".join(f"[{j}] {w.text}\n" for j, w in enumerate(want))


def test_num_return_sequences_errors_are_clear(capsys):
    args = ["generate", MODEL, "hi", "--num-return-sequences", "3", "--num-beams", "2"]
    assert cli.main(args) == 1
    assert "num_return_sequences 3 is more than num_beams 2" in capsys.readouterr().err
    assert cli.main(["generate", MODEL, "hi", "--num-return-sequences", "2"]) == 1
    assert "needs sampling" in capsys.readouterr().err


def test_an_image_to_text_model_for_generate_is_one_clear_line():
    out = _cli("generate", str(FIXTURES / "vitgpt2-optimum"), "hi", stdin="")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert "is an image-to-text model: use 'transmuter-jax caption MODEL IMAGE'" in lines[0]
