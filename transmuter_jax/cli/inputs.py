"""What the commands read: prompts from stdin, MODEL among input files, images, messages."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3", ".opus", ".aiff", ".aif")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm",
                  ".pgm", ".pbm", ".ico")  # fmt: skip


def read(text: str) -> str:
    """``text``, or stdin's text when it is '-'."""
    if text != "-":
        return text
    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    try:
        data = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as error:
        raise ValueError(
            f"standard input is not UTF-8 text: byte 0x{raw[error.start]:02x} at offset "
            f"{error.start} ({error.reason}); give UTF-8 text"
        ) from None
    if not data.strip():
        raise ValueError("the prompt read from stdin is empty")
    return data.rstrip("\n")


def messages(system: str | None, prompt: str) -> list[dict[str, str]]:
    """The chat messages of a prompt: a system message (when given), then the user's."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


def returns(options: dict[str, Any], defaults: dict[str, Any]) -> int:
    """The sequences per prompt the options ask for (else generation_config.json's)."""
    n = options.get("num_return_sequences", defaults.get("num_return_sequences"))
    return 1 if n is None else int(n)


def model_and_inputs(
    items: Sequence[str], suffixes: Sequence[str], aliases: Sequence[str], kind: str
) -> tuple[str | None, list[str]]:
    """The MODEL (None: the default) and the input files of ``items``: the first item is the
    model when it is a folder, one of ``aliases``, or not a file and not named like an input
    (a hub id)."""
    first = items[0]
    is_model = (
        os.path.isdir(first)
        or first in aliases
        or (not os.path.exists(first) and not first.lower().endswith(tuple(suffixes)))
    )
    model, files = (first, list(items[1:])) if is_model and len(items) > 1 else (None, list(items))
    if is_model and len(items) == 1:
        raise ValueError(f"no {kind} file after MODEL {first!r}")
    return model, files


def model_and_audio(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """transcribe's MODEL (None: the default) and AUDIO files: the first item is the model when
    it is a folder, a speech alias, or not a file and not named like audio (a hub id)."""
    from ..default.speech import SPEECH_ALIASES

    return model_and_inputs(items, AUDIO_SUFFIXES, (*SPEECH_ALIASES, "default"), "AUDIO")


def load_images(paths: Sequence[str]) -> list[Any]:
    """The images of ``paths``, loaded now so that a missing or unreadable file is an error
    before anything runs (vision.ImageError names it)."""
    from ..vision import load_image

    return [load_image(path) for path in paths]


def image_options(args: argparse.Namespace) -> dict[str, Any]:
    """The image processor options of the command line, by transformers' names."""
    if args.image_splitting is None:
        return {}
    return {"do_image_splitting": args.image_splitting}


def no_image_options(args: argparse.Namespace) -> None:
    """Image options given without --image are an error, not ignored."""
    if args.image_splitting is not None:
        raise ValueError("--no-image-splitting goes with --image")


def vision_messages(system: str | None, prompt: str, images: Sequence[Any]) -> list[dict]:
    """The chat messages of --image: a system message (when given), then one user message of
    the images and the prompt."""
    head = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    parts = [{"type": "image", "image": image} for image in images]
    return [*head, {"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]
