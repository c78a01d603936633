"""The pipelines the commands load; a model for another task gets one line naming the command
that runs it (the task comes from :func:`transmuter_jax.tasks.detect.detect`)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .output import PROG, say


def use_instead(model: str | None, task_key: str) -> ValueError:
    """The one-line error for a model given to the wrong command: what the model is, and the
    command that runs it (``task_key``: a :attr:`~transmuter_jax.tasks.detect.Task.key`)."""
    from ..tasks import detect

    name = model or "the default model"
    task = next((t for t in detect.TASKS if t.key == task_key), None)
    if task is None:
        return ValueError(f"{name} is not a model this command runs")
    article = "an" if task.name[0] in "aeiou" else "a"
    what = "decoder-only text-generation" if task is detect.TEXT_GENERATION else task.name
    return ValueError(f"{name} is {article} {what} model: use '{task.command}'")


def _load(load, model: str | None, args: argparse.Namespace) -> tuple[Any, float]:
    """``load(model, dtype=, file=)`` and its seconds; a model for another task gets the
    command to use."""
    from ..tasks import detect

    start = time.perf_counter()
    try:
        pipe = load(model, dtype=args.dtype, file=args.file)
    except detect.WrongTask as error:
        raise use_instead(model, error.task) from None
    return pipe, time.perf_counter() - start


def text_pipeline(task: str, model: str | None, args: argparse.Namespace):
    """The pipeline of ``task`` ("generation" or "text_to_text"), with the command to use when
    the model is for another task."""
    from .. import text

    make = text.generation if task == "generation" else text.text_to_text
    pipe, seconds = _load(make, model, args)
    say(args, f"loaded {pipe.files.decoder} ({pipe.files.family}) in {seconds:.1f} s")
    return pipe


def speech_pipeline(model: str | None, args: argparse.Namespace):
    """The speech-to-text pipeline of ``model``, with the command to use when the model is for
    another task."""
    from .. import audio

    pipe, seconds = _load(audio.speech_to_text, model, args)
    say(args, f"loaded {pipe.files.decoder} in {seconds:.1f} s")
    return pipe


def detected(model: str | None, args: argparse.Namespace) -> tuple[Any, Any]:
    """The files of ``model`` and the task they are for."""
    from ..tasks import detect
    from ..tasks.runner import resolve

    files = resolve(model, args.dtype, args.file)
    return files, detect.detect_files(files)


def vision_pipeline(model: str | None, args: argparse.Namespace):
    """The image-text-to-text pipeline of ``model`` for --image; a text-only model (the default
    one included) or an image-to-text model gets an error that says what to use."""
    from .. import vision
    from ..tasks import detect

    if model is None:
        raise ValueError("--image needs MODEL, an image-text-to-text model (such as SmolVLM): "
                         "the default model is text-only and no default vision-language model "
                         f"ships ('{PROG} generate MODEL --image IMAGE PROMPT')")  # fmt: skip
    files, task = detected(model, args)
    if task in (detect.IMAGE_TO_TEXT, detect.SPEECH_TO_TEXT, detect.TEXT_TO_TEXT):
        raise use_instead(model, task.key)
    if task is not detect.IMAGE_TEXT_TO_TEXT:
        encoder = detect.vision_encoder_path(files.decoder)
        kind = "text-only" if task is detect.TEXT_GENERATION else task.name
        raise ValueError(f"{model} is a {kind} "
                         f"model (no {os.path.basename(encoder)} beside "
                         f"{os.path.basename(files.decoder)}): --image needs an "
                         "image-text-to-text model such as SmolVLM")  # fmt: skip
    start = time.perf_counter()
    pipe = vision.image_text_to_text(model, dtype=args.dtype, file=args.file)
    say(args, f"loaded {pipe.files.decoder} and {pipe.vision_encoder} in "
         f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return pipe


def caption_pipeline(model: str, args: argparse.Namespace):
    """The image-to-text pipeline of ``model``; another kind of model gets an error that says
    what to use."""
    from .. import vision
    from ..tasks import detect

    files, task = detected(model, args)
    if task is not detect.IMAGE_TO_TEXT:
        raise use_instead(model, task.key)
    pipe, seconds = _load(vision.image_to_text, model, args)
    say(args, f"loaded {pipe.files.decoder} in {seconds:.1f} s")
    return pipe
