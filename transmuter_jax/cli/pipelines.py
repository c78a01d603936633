"""The pipelines the commands load; a model for another task gets one line naming the command
that runs it (the task comes from :func:`transmuter_jax.tasks.detect.detect`)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .output import PROG, say


def text_pipeline(task: str, model: str | None, args: argparse.Namespace):
    """The pipeline of ``task`` ("generation" or "text_to_text"), with the command to use when
    the model is for another task."""
    from .. import text

    make = text.generation if task == "generation" else text.text_to_text
    start = time.perf_counter()
    try:
        pipe = make(model, dtype=args.dtype, file=args.file)
    except text.WrongTask as error:
        name = model or "the default model"
        if error.task == "image_to_text":
            raise ValueError(str(error)) from None
        if error.task == "generation":
            raise ValueError(f"{name} has no encoder (a decoder-only model): use "
                             f"'{PROG} generate MODEL PROMPT'") from None  # fmt: skip
        if error.task == "speech_to_text":
            raise ValueError(f"{name} is a speech-to-text model: use "
                             f"'{PROG} transcribe MODEL AUDIO'") from None  # fmt: skip
        raise ValueError(f"{name} is an encoder-decoder model: use "
                         f"'{PROG} translate MODEL TEXT'") from None  # fmt: skip
    say(args, f"loaded {pipe.files.decoder} ({pipe.files.family}) in "
         f"{time.perf_counter() - start:.1f} s")  # fmt: skip
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
    if task is detect.IMAGE_TO_TEXT:
        raise ValueError(f"{model} is an image-to-text model (an image encoder and a text "
                         f"decoder): use '{task.command}'")  # fmt: skip
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
    if task is detect.IMAGE_TEXT_TO_TEXT:
        raise ValueError(f"{model} is an image-text-to-text model: use '{task.command}'")
    if task is not detect.IMAGE_TO_TEXT and files.encoder is None:
        raise ValueError(f"{model} has no image encoder (encoder_model.onnx): caption needs an "
                         "image-to-text model (an image encoder and a text decoder, such as "
                         "ViT-GPT2)")  # fmt: skip
    start = time.perf_counter()
    pipe = vision.image_to_text(model, dtype=args.dtype, file=args.file)
    say(args, f"loaded {pipe.files.decoder} in {time.perf_counter() - start:.1f} s")
    return pipe
