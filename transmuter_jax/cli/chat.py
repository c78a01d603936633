"""``transmuter-jax chat [MODEL]``: an interactive conversation."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .inputs import image_options, load_images, no_image_options, returns
from .options import (
    add_generation_options,
    add_image_options,
    add_model_options,
    check_seed,
    generation_options,
)
from .output import PROG, CompileNotice
from .pipelines import text_pipeline, vision_pipeline

NAME = "chat"
GATHERS = False  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
    chat = commands.add_parser(
        "chat", help="an interactive conversation", description="Talk with the model; the "
        "conversation keeps its history. Type a message per line; /reset clears the history, "
        "/exit, /quit or end of input ends. Ctrl-C stops an answer.",
    )  # fmt: skip
    chat.add_argument("model", nargs="?", metavar="MODEL")
    chat.add_argument("--system", help="a system message before the conversation")
    add_image_options(chat)
    add_generation_options(chat)
    add_model_options(chat)

    return chat


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the command; returns the exit status."""
    options = generation_options(args)
    if args.image:
        images = load_images(args.image)
        pipe = vision_pipeline(args.model, args)
        options.update(image_options(args))

        def message(role: str, text: str, first: bool = False) -> dict[str, Any]:
            head = [{"type": "image", "image": image} for image in images] if first else []
            return {"role": role, "content": [*head, {"type": "text", "text": text}]}
    else:
        no_image_options(args)
        pipe = text_pipeline("generation", args.model, args)
        if not pipe.has_chat_template:
            raise ValueError(f"{pipe.files.folder} has no chat template: use '{PROG} generate'")

        def message(role: str, text: str, first: bool = False) -> dict[str, Any]:
            return {"role": role, "content": text}

    check_seed(args, options, pipe.defaults)
    if returns(options, pipe.defaults) > 1:
        raise ValueError(f"chat gives one answer: use '{PROG} generate --num-return-sequences'")
    interactive = sys.stdin.isatty()
    start: list[dict[str, Any]] = [message("system", args.system)] if args.system else []
    history = list(start)
    if interactive:
        print("Chat with the model: /reset clears the history, /exit or /quit ends.",
              file=sys.stderr)  # fmt: skip
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(start)
            continue
        first = not any(m["role"] == "user" for m in history)  # the images come with it
        history.append(message("user", line, first))
        answer = []
        stream = pipe.stream(history, seed=args.seed, **options)
        try:
            for piece in stream:
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        finally:  # Ctrl-C while a piece is written too: its generation stops here
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        notice.report()
        history.append(message("assistant", "".join(answer)))
