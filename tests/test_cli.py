"""The command line on fixtures: arguments, stdin, JSON, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from transmuter_jax import cli

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MODEL = str(FIXTURES / "llama-genai-fp32")


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transmuter_jax", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
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
        (["generate", MODEL, "hi", "--num-beams", "0"], "num_beams"),
        (["generate", MODEL, "-"], "empty"),
        (["translate", MODEL, "hi"], "has no encoder"),
    ],
)
def test_errors_are_one_clear_line(args, message):
    out = _cli(*args, stdin="")
    assert out.returncode == 1
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
    assert cli._options(args) == {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 5,
        "num_beams": 2,
    }
    greedy = cli.parser().parse_args(["generate", "p", "--max-new-tokens", "3"])
    assert cli._options(greedy) == {"max_new_tokens": 3}
