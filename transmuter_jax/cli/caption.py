"""``transmuter-jax caption [MODEL] IMAGE...``: image to text with a captioning model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .inputs import IMAGE_SUFFIXES, load_images, model_and_inputs, returns
from .options import add_generation_options, add_model_options, check_seed, generation_options
from .output import PROG, CompileNotice, print_json, print_texts, write_line
from .pipelines import caption_pipeline

DEFAULT_CAPTION_MODEL: str | None = None  # no wheel is known to ship trained captioning weights
NO_DEFAULT_CAPTION = (
    "no default captioning model ships with transmuter_jax (no package is known to carry "
    f"trained weights): pass one, '{PROG} caption MODEL IMAGE...', MODEL a folder or hub id of "
    "an image-to-text ONNX export (encoder_model.onnx and a decoder), such as "
    "Xenova/vit-gpt2-image-captioning"
)


NAME = "caption"
GATHERS = True  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
    cap = commands.add_parser(
        "caption", help="image to text with a captioning model",
        description="Caption each IMAGE file and stream the text to stdout, a line per image. "
        "MODEL is an image-to-text model (a VisionEncoderDecoder export such as ViT-GPT2 or "
        "TrOCR): a folder or a hub id. No default captioning model ships, so MODEL is needed.",
    )  # fmt: skip
    cap.add_argument("args", nargs="+", metavar="[MODEL] IMAGE")
    cap.add_argument("--json", action="store_true", help="print one JSON object per image: file, "
                     "text, token ids, log-probabilities, finish reason")  # fmt: skip
    add_generation_options(cap)
    add_model_options(cap)

    return cap


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the command; returns the exit status."""
    model, files = model_and_inputs(args.args, IMAGE_SUFFIXES, ("default",), "IMAGE")
    if model in (None, "default"):
        model = DEFAULT_CAPTION_MODEL
        if model is None:
            raise ValueError(NO_DEFAULT_CAPTION)
    images = load_images(files)
    pipe = caption_pipeline(model, args)
    options = generation_options(args)
    check_seed(args, options, pipe.defaults)
    n = returns(options, pipe.defaults)
    if not (args.json or n > 1):
        for image in images:
            write_line(pipe.stream(image, seed=args.seed, **options))
        notice.report()
        return 0
    out = pipe.generate(images, seed=args.seed, token_logprobs=args.json, **options)
    notice.report()
    for path, result in zip(files, out, strict=True):
        results = result if n > 1 else [result]
        if args.json:
            print_json(results, n, file=path)
        else:
            if len(files) > 1:
                print(f"{path}:")
            print_texts(results)
    sys.stdout.flush()
    return 0
