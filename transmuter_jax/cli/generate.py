"""``transmuter-jax generate [MODEL] PROMPT``: stream the answer to a prompt."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .inputs import (
    image_options,
    load_images,
    messages,
    no_image_options,
    read,
    returns,
    vision_messages,
)
from .options import (
    add_chat_options,
    add_generation_options,
    add_image_options,
    add_model_options,
    check_seed,
    generation_options,
)
from .output import CompileNotice, print_json, print_texts, say, write_line
from .pipelines import text_pipeline, vision_pipeline
from .types import integer

NAME = "generate"
GATHERS = True  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
    gen = commands.add_parser(
        "generate", help="stream the answer to a prompt", description="Stream the answer to "
        "PROMPT to stdout. PROMPT '-' reads it from stdin. With a chat template, the prompt is "
        "one user message in it. Options may come before, between or after MODEL and PROMPT.",
    )  # fmt: skip
    gen.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, "
                     "log-probabilities, finish reason")  # fmt: skip
    gen.add_argument("--top-logprobs", type=integer(0, 1024), metavar="K", default=0,
                     help="with --json, the K "
                     "most probable tokens at each step, with their log-probabilities")  # fmt: skip
    add_chat_options(gen)
    add_image_options(gen)
    add_generation_options(gen)
    add_model_options(gen)

    return gen


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the command; returns the exit status."""
    if len(args.args) > 2:
        raise ValueError(f"generate takes [MODEL] PROMPT, got {len(args.args)} arguments")
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    prompt = read(prompt)
    options = generation_options(args)
    chat = None if args.chat_template else False  # None: the template when the model has one
    if args.image:
        if not args.chat_template:
            raise ValueError("--image puts the images in a user message of the chat template: "
                             "it does not go with --no-chat-template")  # fmt: skip
        images = load_images(args.image)
        pipe = vision_pipeline(model, args)
        source: Any = vision_messages(args.system, prompt, images)
        options.update(image_options(args))
        extra: dict[str, Any] = {}
    else:
        no_image_options(args)
        pipe = text_pipeline("generation", model, args)
        if args.system and not (args.chat_template and pipe.has_chat_template):
            raise ValueError("--system needs the chat template")
        source = messages(args.system, prompt) if args.system else prompt
        extra = {"chat": chat}
    check_seed(args, options, pipe.defaults)
    start = time.perf_counter()
    n = returns(options, pipe.defaults)
    if args.json or n > 1:
        if args.json and args.top_logprobs:
            options["top_logprobs"] = args.top_logprobs
        out = pipe.generate([source], seed=args.seed, token_logprobs=args.json, **extra,
                            **options)[0]  # fmt: skip
        notice.report()
        results = out if n > 1 else [out]
        if not args.json:
            print_texts(results)
            return 0
        head = dict(model=pipe.files.folder, prompt=prompt)
        if args.image:
            head["images"] = list(args.image)
        print_json(results, n, pipe.tokenizer, **head)
        return 0
    count = write_line(pipe.stream(source, seed=args.seed, **extra, **options))
    notice.report()
    say(args, f"{count} pieces in {time.perf_counter() - start:.1f} s "
         f"(compiled shapes: {getattr(pipe, 'compiled_shapes', '-')})")  # fmt: skip
    return 0
