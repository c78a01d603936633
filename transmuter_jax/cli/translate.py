"""``transmuter-jax translate MODEL TEXT``: text to text with an encoder-decoder model."""

from __future__ import annotations

import argparse
from typing import Any

from .inputs import read, returns
from .options import add_generation_options, add_model_options, check_seed, generation_options
from .output import CompileNotice, print_json, print_texts, write_line
from .pipelines import text_pipeline

NAME = "translate"
GATHERS = False  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
    tr = commands.add_parser(
        "translate", help="text to text with an encoder-decoder model",
        description="Stream the output of an encoder-decoder model (such as a Marian translation "
        "model) for TEXT. TEXT '-' reads it from stdin.",
    )  # fmt: skip
    tr.add_argument("model", metavar="MODEL")
    tr.add_argument("text", metavar="TEXT")
    tr.add_argument("--json", action="store_true", help="print one JSON object")
    add_generation_options(tr)
    add_model_options(tr)

    return tr


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the command; returns the exit status."""
    source = read(args.text)
    pipe = text_pipeline("text_to_text", args.model, args)
    options = generation_options(args)
    check_seed(args, options, pipe.defaults)
    n = returns(options, pipe.defaults)
    if args.json or n > 1:
        out = pipe.generate([source], seed=args.seed, token_logprobs=args.json, **options)[0]
        notice.report()
        results = out if n > 1 else [out]
        if not args.json:
            print_texts(results)
            return 0
        print_json(results, n)
        return 0
    write_line(pipe.stream(source, seed=args.seed, **options))
    notice.report()
    return 0
