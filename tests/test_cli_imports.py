"""The command line imports only what a command needs: ``--help`` (the program's and each
command's) runs without jax, onnx or tokenizers, checked in a fresh process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from transmuter_jax.cli.parser import command_modules

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAVY = ("jax", "jaxlib", "onnx", "onnxruntime", "tokenizers")
CHILD = """
import json, runpy, sys
sys.argv = ["transmuter-jax", *json.loads(sys.argv[1])]
try:
    runpy.run_module("transmuter_jax", run_name="__main__")
    code = None
except SystemExit as stop:
    code = stop.code
print("\\n@@" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _help(*argv: str) -> tuple[str, dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    text, _, tail = done.stdout.rpartition("\n@@")
    return text, json.loads(tail)


@pytest.mark.parametrize("command", [None, *command_modules()])
def test_help_imports_no_jax_onnx_or_tokenizers(command):
    text, child = _help(*([command] if command else []), "--help")
    assert child["code"] == 0
    assert f"usage: transmuter-jax{' ' + command if command else ''}" in text
    heavy = [m for m in child["modules"] if m.split(".")[0] in HEAVY]
    assert not heavy, f"--help imported {sorted({m.split('.')[0] for m in heavy})}"


def test_the_check_sees_an_import(tmp_path):
    """The child reports what it imported: a command that runs (and fails on a missing model)
    has loaded jax."""
    _, child = _help("translate", str(tmp_path / "missing"), "text")
    assert child["code"] == 1
    assert "jax" in child["modules"]
