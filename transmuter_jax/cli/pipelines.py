"""The pipelines the commands load, with an error naming the command to use when the model is
for another task."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .output import PROG, say


def text_pipeline(task: str, model: str | None, args: argparse.Namespace):
    """The pipeline of ``task`` ("generation" or "text_to_text"), with the command to use when
    the model is of the other kind."""
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
        raise ValueError(f"{name} is an encoder-decoder model: use "
                         f"'{PROG} translate MODEL TEXT'") from None  # fmt: skip
    say(args, f"loaded {pipe.files.decoder} ({pipe.files.family}) in "
         f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return pipe


def vision_files(model: str | None, args: argparse.Namespace) -> tuple[Any, str]:
    """The files of ``model`` and the path of the vision encoder beside its decoder."""
    from ..tasks.runner import resolve
    from ..vision.image_text_to_text import vision_encoder_path

    files = resolve(model, args.dtype, args.file)
    return files, vision_encoder_path(files.decoder)


def vision_pipeline(model: str | None, args: argparse.Namespace):
    """The image-text-to-text pipeline of ``model`` for --image; a text-only model (the default
    one included) or an image-to-text model gets an error that says what to use."""
    from .. import vision

    if model is None:
        raise ValueError("--image needs MODEL, an image-text-to-text model (such as SmolVLM): "
                         "the default model is text-only and no default vision-language model "
                         f"ships ('{PROG} generate MODEL --image IMAGE PROMPT')")  # fmt: skip
    files, encoder = vision_files(model, args)
    if not os.path.exists(encoder):
        if files.encoder is not None and os.path.exists(
            os.path.join(files.folder, "preprocessor_config.json")
        ):
            raise ValueError(f"{model} is an image-to-text model (an image encoder and a text "
                             f"decoder): use '{PROG} caption MODEL IMAGE'")  # fmt: skip
        raise ValueError(f"{model} is a text-only model (no {os.path.basename(encoder)} beside "
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

    files, encoder = vision_files(model, args)
    if files.encoder is None:
        if os.path.exists(encoder):
            raise ValueError(f"{model} is an image-text-to-text model: use '{PROG} generate "
                             "MODEL --image IMAGE PROMPT'")  # fmt: skip
        raise ValueError(f"{model} has no image encoder (encoder_model.onnx): caption needs an "
                         "image-to-text model (an image encoder and a text decoder, such as "
                         "ViT-GPT2)")  # fmt: skip
    start = time.perf_counter()
    pipe = vision.image_to_text(model, dtype=args.dtype, file=args.file)
    say(args, f"loaded {pipe.files.decoder} in {time.perf_counter() - start:.1f} s")
    return pipe
