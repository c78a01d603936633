"""``transmuter-jax serve``: an OpenAI-compatible server (its options and runner live in
:mod:`transmuter_jax.serving.cli`; docs/serving.md)."""

from __future__ import annotations

import argparse
from typing import Any

from .output import CompileNotice

NAME = "serve"
GATHERS = False  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
    from ..serving import cli as serve_cli  # argparse only; the server loads in run

    serve = commands.add_parser("serve", help=serve_cli.HELP, description=serve_cli.DESCRIPTION)
    serve_cli.add_arguments(serve)
    return serve


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the server until it is stopped; returns the exit status."""
    from ..serving import cli as serve_cli

    return serve_cli.run(args)
