"""Every fenced Python example of README.md and docs/*.md runs, so that none goes stale silently.

The examples of one file run in order, from the repository root, in one namespace, as a reader
runs them. An HTML comment just before a fence (blank lines between are fine) marks it:

- ``<!-- docs-test: skip REASON -->``: not run (a placeholder path, a hub download); the test
  of that example is skipped with REASON;
- ``<!-- docs-test: default-model -->``: run by the file's ``default_model`` test, with the other
  examples so marked, in a namespace of their own;
- ``<!-- docs-test: setup`` CODE ``-->``: CODE, which readers do not see, runs just before the
  example (to make what the text before it assumes, such as a ``ctx``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("skip", "default-model", "setup")
FENCE = re.compile(r"^```\s*(\w*)(.*)$")
MARKER = re.compile(r"<!--\s*docs-test:\s*([\w-]+)(.*?)-->", re.S)


@dataclasses.dataclass
class Example:
    """One fenced Python example and its marker."""

    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    kind: str = "run"  # "run", "skip" or "default-model"
    reason: str = ""
    setup: str = ""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples(path: pathlib.Path) -> list[Example]:
    """The Python examples of a Markdown file, with their markers.

    Raises:
        ValueError: a marker of an unknown kind, or one that no example follows.
    """
    lines = path.read_text().splitlines()
    found: list[Example] = []
    marks: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("<!--"):
            start = i
            while "-->" not in lines[i]:
                i += 1
            comment = "\n".join(lines[start : i + 1])
            match = MARKER.search(comment)
            if match:
                kind, rest = match.group(1), match.group(2)
                if kind not in KINDS:
                    raise ValueError(f"{path}:{start + 1}: unknown docs-test marker {kind!r}")
                marks.append((kind, rest))
        elif (fence := FENCE.match(line.strip())) is not None:
            start = i
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                i += 1
            if fence.group(1) in ("python", "py"):
                example = Example(path, start + 1, "\n".join(lines[start + 1 : i]))
                for kind, rest in marks:
                    if kind == "setup":
                        example.setup += rest.strip("\n") + "\n"
                    else:
                        example.kind, example.reason = kind, rest.strip()
                found.append(example)
            elif marks:
                raise ValueError(f"{path}:{start + 1}: a docs-test marker before non-Python code")
            marks = []
        elif line.strip() and marks:
            raise ValueError(f"{path}:{i + 1}: a docs-test marker that no example follows")
        i += 1
    if marks:
        raise ValueError(f"{path}: a docs-test marker at the end, with no example after it")
    return found


ALL = [e for path in FILES for e in examples(path)]


def _run(selected: list[Example], monkeypatch) -> None:
    """Runs the examples in order in one namespace; a failure names the example's line."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "__docs__"}
    for example in selected:
        for label, code in (("setup of", example.setup), ("", example.code)):
            if not code:
                continue
            try:
                exec(compile(code, example.name, "exec"), namespace)  # noqa: S102 - the docs' own code
            except Exception as error:  # noqa: BLE001 - reported with the example's place
                where = f"{label} {example.name}".strip()
                raise AssertionError(
                    f"the example at {where} fails:\n{traceback.format_exc()}"
                ) from error


def _files(kind: str) -> list[pathlib.Path]:
    return sorted({e.path for e in ALL if e.kind == kind})


@pytest.mark.parametrize("path", _files("run"), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(path, monkeypatch):
    _run([e for e in ALL if e.path == path and e.kind == "run"], monkeypatch)


@pytest.mark.default_model
@pytest.mark.parametrize("path", _files("default-model"), ids=lambda p: str(p.relative_to(ROOT)))
def test_default_model_examples_run(path, default_model, monkeypatch):
    _run([e for e in ALL if e.path == path and e.kind == "default-model"], monkeypatch)


@pytest.mark.parametrize("example", [e for e in ALL if e.kind == "skip"], ids=lambda e: e.name)
def test_marked_examples_are_skipped_with_a_reason(example):
    assert example.reason, f"{example.name}: a skip marker needs a reason"
    pytest.skip(f"{example.name}: {example.reason}")


def test_the_examples_are_found():
    assert len(ALL) >= 10
    assert {e.path.name for e in ALL} >= {"README.md", "text.md", "generation.md", "tracer.md"}
    assert all(e.code.strip() for e in ALL)


def test_a_marker_must_precede_an_example(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skipp typo -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test marker 'skipp'"):
        examples(page)
    page.write_text("<!-- docs-test: skip later -->\nSome text.\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="no example follows"):
        examples(page)
    page.write_text("<!-- docs-test: setup\nx = 2\n-->\n\n```python\nassert x == 2\n```\n")
    (example,) = examples(page)
    assert example.setup == "x = 2\n" and example.kind == "run"


def test_every_generation_option_is_in_the_options_table():
    from transmuter_jax.generation.options import DEFAULTS

    table = (ROOT / "docs" / "options.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)`", table, re.M))
    assert sorted(set(DEFAULTS) - rows) == [], "options missing from docs/options.md"


def test_every_generation_option_says_where_it_runs():
    from transmuter_jax.generation.options import DEFAULTS

    text = (ROOT / "docs" / "generation.md").read_text()
    table = text[text.index("## Every option") :].split("\n## ", 1)[0]
    named = set(
        re.findall(
            r"`(\w+)`",
            "\n".join(r.split("|")[1] for r in table.splitlines() if r.startswith("| `")),
        )
    )
    assert sorted(set(DEFAULTS) - named) == [], "options missing from docs/generation.md"


def test_without_onnxruntime_the_comparison_says_how_to_install_it(monkeypatch):
    import transmuter_jax as tj
    from transmuter_jax.testing import compare_with_onnxruntime, example_inputs

    model = tj.load(ROOT / "tests" / "fixtures" / "llama-optimum" / "model.onnx")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'transmuter_jax\[ort\]'"):
        compare_with_onnxruntime(model, example_inputs(model))
    script = (
        "import runpy, sys; sys.modules['onnxruntime'] = None; "
        "runpy.run_path('examples/run_fixture.py', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1
    assert "pip install 'transmuter_jax[ort]'" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("script", ["run_fixture.py", "text_to_text.py"])
def test_the_fixture_examples_run(script):
    out = subprocess.run(
        [sys.executable, f"examples/{script}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)),  # this checkout's package
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
