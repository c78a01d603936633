"""A sweep generated from the parser itself: every flag of every command, alone with valid and
invalid values, and (in the slow sweep) every pair of flags with valid values. Each command line
either runs (exit 0) or gets exactly one ``transmuter-jax: error:`` line on stderr and exit 1
(an error) or 2 (a usage error): never a traceback, several lines, or another status.

The command lines run in this process (``cli.main``), on the tiny fixtures."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest

from transmuter_jax import cli
from transmuter_jax.cli.parser import build

FIXTURES = Path(__file__).parent / "fixtures"
PREFIX = "transmuter-jax: "
SKIPPED = {"help", "verbose"}  # --help exits 0 by design; --verbose adds the traceback
NOT_RUN = {"prepare", "serve"}  # they prepare models or start a server: parsed only

# What each command is given besides its flags (valid inputs of the tiny fixtures).
BASE = {
    "generate": [str(FIXTURES / "llama-optimum"), "Hello", "--no-chat-template"],
    "chat": ["<chat-model>"],  # llama-optimum with a chat template: the module's `chat_model`
    "translate": [str(FIXTURES / "marian-optimum"), "hello"],
    "transcribe": [
        str(FIXTURES / "whisper-speech-optimum"),
        str(FIXTURES / "whisper-speech-optimum" / "stereo-44k.wav"),
        "--num-beams",
        "1",
    ],
    "caption": [str(FIXTURES / "vitgpt2-optimum"), str(FIXTURES / "vitgpt2-optimum" / "noise.jpg")],
}
LIMIT = ["--max-new-tokens", "2"]  # keeps every run short (a flag of its own is swept too)

VALID = {
    "max_new_tokens": "2", "temperature": "0.7", "top_k": "5", "top_p": "0.9", "seed": "3",
    "num_beams": "2", "num_return_sequences": "2", "repetition_penalty": "1.1",
    "top_logprobs": "2", "system": "Be brief.", "regex": "[a-z]+", "stop": "x", "choice": "yes",
    "language": "en", "dtype": "fp32", "task": "transcribe",
}  # fmt: skip
INVALID_NUMBERS = ["-1", "abc", "nan", "1e999", ""]


def _files(tmp: Path) -> dict[str, list[str]]:
    """Valid and invalid values of the flags that take files."""
    folder = tmp / "a-folder"
    folder.mkdir(exist_ok=True)
    schema = tmp / "schema.json"
    schema.write_text(json.dumps({"type": "string", "maxLength": 3}))
    grammar = tmp / "grammar.lark"
    grammar.write_text('start: "a" | "b"\n')
    bad = tmp / "bad.json"
    bad.write_bytes(b"\xff{not json")
    return {
        "json_schema": [str(schema), str(folder), "/dev/zero", str(bad), "/no/such.json"],
        "grammar": [str(grammar), str(folder), "/dev/zero", "/no/such.lark"],
        "image": [str(FIXTURES / "smolvlm-community" / "wide.png"), str(folder), "/dev/null"],
        "file": ["model.onnx", "a-folder", "../model.onnx", "/etc/hostname"],
    }


def _values(action, files: dict[str, list[str]]) -> tuple[list[list[str]], list[list[str]]]:
    """(valid, invalid) argument lists of one flag."""
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [[flag]], []
    if action.dest in files:
        good, *bad = files[action.dest]
        return [[flag, good]], [[flag, b] for b in bad]
    if action.choices:
        return [[flag, str(next(iter(action.choices)))]], [[flag, "bogus"], [flag, ""]]
    good = VALID.get(action.dest, "x")
    if action.type is not None and action.dest not in ("stop",):
        return [[flag, good]], [[flag, v] for v in INVALID_NUMBERS]
    return [[flag, good]], [[flag, ""], [flag, "\udcff"]]


def _flags(command: str) -> list:
    return [a for a in build()[1][command]._actions if a.option_strings and a.dest not in SKIPPED]


def _run(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the command line ``argv`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    stdin = sys.stdin
    sys.stdin = io.StringIO("Hello\n")  # chat reads its turns: one line, then end of input
    run = cli.main
    if argv[0] in NOT_RUN:  # parsed only: a parsed line is status 0

        def run(argv):
            cli.parse(argv)
            return 0

    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = run(argv)
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else 2
    finally:
        sys.stdin = stdin
    return status, out.getvalue(), err.getvalue()


def _check(argv: list[str]) -> int:
    status, _, err = _run(argv)
    assert "Traceback" not in err, (argv, err)
    lines = [
        line
        for line in err.splitlines()
        if line.strip() and not line.startswith((f"{PREFIX}compiled", f"{PREFIX}warning"))
    ]
    if status == 0:
        assert not any(line.startswith(f"{PREFIX}error") for line in lines), (argv, err)
        return status
    assert status in (1, 2), (argv, status, err)
    assert len(lines) == 1 and lines[0].startswith(f"{PREFIX}error: "), (argv, err)
    return status


def _cases(tmp: Path, commands, invalid: bool, valid: bool) -> list[list[str]]:
    files = _files(tmp)
    cases = []
    for command in commands:
        base = [] if command in NOT_RUN else [*BASE[command], *LIMIT]
        for action in _flags(command):
            good, bad = _values(action, files)
            if invalid:
                cases += [[command, *base, *v] for v in bad]
            if valid and command not in NOT_RUN:
                cases += [[command, *base, *v] for v in good]
    return cases


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module", autouse=True)
def chat_model(tmp_path_factory):
    """A copy of llama-optimum with a chat template, so that `chat` lines reach generation
    (the fixture has none, and every chat line would stop at that error)."""
    folder = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(FIXTURES / "llama-optimum", folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    patch = pytest.MonkeyPatch()
    patch.setitem(BASE, "chat", [str(folder)])
    yield folder
    patch.undo()


COMMANDS = list(build()[1])
# The loaders the commands call (cli/pipelines.py): (module, name).
LOADERS = (("text", "generation"), ("text", "text_to_text"), ("audio", "speech_to_text"),
           ("vision", "image_text_to_text"), ("vision", "image_to_text"))  # fmt: skip


@pytest.fixture(scope="module")
def shared_pipelines():
    """Each pipeline loaded once for every command line of the module, so that its compiled
    programs serve each line of the same options (the lines still parse, check and run in full;
    a loader's error is raised each time, never kept). No command changes the pipeline it is
    given (checked by the
    generate sweep below)."""
    import importlib

    patch = pytest.MonkeyPatch()
    loaded: dict = {}
    for module_name, name in LOADERS:
        module = importlib.import_module(f"transmuter_jax.{module_name}")
        load = getattr(module, name)

        def shared(*args, _load=load, _name=name, **kwargs):
            key = (_name, tuple(map(str, args)), tuple(sorted(kwargs.items())))
            if key not in loaded:
                loaded[key] = _load(*args, **kwargs)
            return loaded[key]

        patch.setattr(module, name, shared)
    yield loaded
    patch.undo()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_with_an_invalid_value_gets_one_error_line(tmp_path, command):
    cases = _cases(tmp_path, [command], invalid=True, valid=False)
    assert cases or command in NOT_RUN
    statuses = [_check(argv) for argv in cases]
    assert all(s in (1, 2) for s in statuses if s), statuses


def _state(pipe) -> tuple:
    """What a command could change of a shared pipeline."""
    tokenizer = getattr(pipe, "tokenizer", None)
    return (dict(pipe.options), dict(pipe.defaults), getattr(tokenizer, "chat_template", None))


def test_every_flag_of_generate_with_a_valid_value_runs_or_gets_one_error_line(
    tmp_path, shared_pipelines
):
    first, *rest = _cases(tmp_path, ["generate"], invalid=False, valid=True)
    _check(first)
    assert shared_pipelines  # the lines run on shared pipelines, which no line changes
    before = {key: _state(pipe) for key, pipe in shared_pipelines.items()}
    for argv in rest:
        _check(argv)
    assert {key: _state(pipe) for key, pipe in shared_pipelines.items() if key in before} == before


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in NOT_RUN])
def test_every_pair_of_flags_runs_or_gets_one_error_line(tmp_path, command, shared_pipelines):
    files = _files(tmp_path)
    flags = [(a, _values(a, files)[0][0]) for a in _flags(command)]
    base = [*BASE[command], *LIMIT]
    for (_, first), (_, second) in itertools.combinations(flags, 2):
        _check([command, *base, *first, *second])


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in NOT_RUN and c != "generate"])
def test_every_flag_with_a_valid_value_runs_or_gets_one_error_line(
    tmp_path, command, shared_pipelines
):
    for argv in _cases(tmp_path, [command], invalid=False, valid=True):
        _check(argv)
