"""The options the commands share: model files, generation, chat and images; and the
generation options they give, by transformers' names."""

from __future__ import annotations

import argparse
from typing import Any

from .constraints import add_constraint_arguments, constraint_options
from .output import warn
from .types import integer, nonempty, real

DEFAULTS_NOTE = (
    "Generation options left out take the values of the model's generation_config.json, else "
    "transformers' defaults."
)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--dtype, --file and --verbose."""
    parser.add_argument(
        "--dtype", help="variant of the ONNX files: fp32 (default), q4, int4, fp16, ..."
    )
    parser.add_argument("--file", help="the decoder .onnx file to use, relative to MODEL")
    parser.add_argument("--verbose", "-v", action="store_true", help="show details and tracebacks")


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """The generation options (transformers' names in :func:`generation_options`); a flag that
    every generating command takes goes here, and its option into :func:`generation_options`."""
    group = parser.add_argument_group("generation", DEFAULTS_NOTE)
    add_constraint_arguments(parser)  # --json-schema, --json-object, --regex, --grammar, --choice
    group.add_argument("--max-new-tokens", type=integer(1), metavar="N",
                       help="most tokens to generate "
                       "(default: generation_config.json's max_new_tokens, or its max_length "
                       "minus the prompt when not 20, else 256)")  # fmt: skip
    group.add_argument("--sample", action="store_true", help="sample instead of greedy decoding "
                       "(default: generation_config.json's do_sample, else greedy)")  # fmt: skip
    group.add_argument("--temperature", type=real(0), metavar="T",
                       help="sampling temperature "
                       "(implies --sample; 0 means greedy decoding; default 1.0)")  # fmt: skip
    group.add_argument(
        "--top-k",
        type=integer(0),
        metavar="K",
        help="sample from the K best tokens (implies --sample; default 50)",
    )
    group.add_argument(
        "--top-p",
        type=real(0, 1, above=True),
        metavar="P",
        help="nucleus sampling mass (implies --sample; default 1.0)",
    )
    group.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="sampling seed (default: random; only sampling uses it)",
    )
    group.add_argument("--num-beams", type=integer(1, 1024), metavar="K",
                       help="beam search with K beams "
                       "(default 1; transcribe: 5, as transformers' ASR pipeline); the answer "
                       "prints when the search ends")  # fmt: skip
    group.add_argument("--num-return-sequences", type=integer(1, 1024), metavar="N",
                       help="N answers: "
                       "samples (with --sample) or the N best beams (N <= --num-beams); printed "
                       "when done, as '[j] text' lines, with --json one object per line "
                       "(default 1)")  # fmt: skip
    group.add_argument("--repetition-penalty", type=real(0, above=True), metavar="R",
                       help="transformers' repetition_penalty (default 1.0)")  # fmt: skip
    group.add_argument("--stop", action="append", type=nonempty, metavar="STR",
                       help="stop when the answer "
                       "reaches STR, which is cut from it (repeatable)")  # fmt: skip


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    """--no-chat-template and --system."""
    parser.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="send the prompt as plain text instead of a user message in the chat template",
    )
    parser.add_argument("--system", help="a system message before the conversation")


def add_image_options(parser: argparse.ArgumentParser) -> None:
    """--image and --no-image-splitting."""
    group = parser.add_argument_group("images", "With --image, MODEL is an image-text-to-text "
                                      "model (SmolVLM / Idefics3).")  # fmt: skip
    group.add_argument("--image", action="append", metavar="IMAGE", help="an image file in the "
                       "first user message, before the text (repeatable)")  # fmt: skip
    group.add_argument("--no-image-splitting", dest="image_splitting", action="store_false",
                       default=None, help="only the global image, not its tiles (the "
                       "processor's do_image_splitting=False)")  # fmt: skip


def generation_options(args: argparse.Namespace, warn=warn) -> dict[str, Any]:
    """The generation options of the command line, with transformers' names."""
    options: dict[str, Any] = {}
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    if args.temperature == 0:  # greedy, as llm, ollama and the OpenAI API read it
        given = {"--sample": args.sample, "--top-k": args.top_k is not None}
        given["--top-p"] = args.top_p is not None
        ignored = [name for name, present in given.items() if present]
        if ignored:
            warn(f"--temperature 0 is greedy decoding: {', '.join(ignored)} ignored")
        options["do_sample"] = False
    elif args.sample or any(v is not None for v in sampling.values()):
        options["do_sample"] = True
        options.update({k: v for k, v in sampling.items() if v is not None})
    if args.num_beams is not None:
        options["num_beams"] = args.num_beams
    if args.num_return_sequences is not None:
        options["num_return_sequences"] = args.num_return_sequences
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    if args.stop:
        options["stop"] = list(args.stop)
    options.update(constraint_options(args))
    return options


def check_seed(args: argparse.Namespace, options: dict[str, Any], defaults: dict) -> None:
    """Warns when --seed is given but nothing samples."""
    if args.seed is not None and not options.get("do_sample", defaults.get("do_sample")):
        warn("--seed only matters when sampling (--sample, --temperature, --top-k, --top-p); "
              "greedy decoding and beam search ignore it")  # fmt: skip
