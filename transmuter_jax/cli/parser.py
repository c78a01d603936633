"""The argument parser: the program's options and one sub-parser per command module.

:data:`COMMANDS` lists the modules of the commands, in the order ``--help`` shows them. A
command module has ``NAME``, ``GATHERS`` (whether its positional items may stand among its
options), ``add(commands)`` (adds its sub-parser) and ``run(args, notice)`` (runs it, returns the
exit status), and imports nothing heavy (jax, onnx, tokenizers) before ``run``: ``--help`` loads
every command module. A command of another package (such as the server's ``serve``) is one more
entry here, that package's module path.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType

from .output import PROG
from .types import Parser

COMMANDS: list[str] = [
    "transmuter_jax.cli.generate",
    "transmuter_jax.cli.chat",
    "transmuter_jax.cli.translate",
    "transmuter_jax.cli.transcribe",
    "transmuter_jax.cli.caption",
    "transmuter_jax.cli.prepare",
    "transmuter_jax.cli.serve",
]


def command_modules() -> dict[str, ModuleType]:
    """The command modules of :data:`COMMANDS`, by command name."""
    modules = [importlib.import_module(name) for name in COMMANDS]
    return {module.NAME: module for module in modules}


def build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and the sub-parser of each command by name."""
    main = Parser(
        prog=PROG,
        description="Run Hugging Face ONNX language models as compiled JAX programs. MODEL is a "
        "folder or a hub id; without it, the default model (SmolLM2-135M-Instruct, prepared "
        "offline on first use). 'default-int4' and 'default-optimum' name its other exports.",
        epilog="Exit status: 0 done, 1 an error, 2 a usage error, 130 interrupted.",
    )
    commands = main.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )
    return main, {name: module.add(commands) for name, module in command_modules().items()}


def parser() -> argparse.ArgumentParser:
    """The argument parser of the command line."""
    return build()[0]


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed arguments; options may stand anywhere among generate's MODEL and PROMPT (and
    transcribe's and caption's inputs).

    A usage error exits with status 2, as argparse does.
    """
    main, commands = build()
    gathers = {name for name, module in command_modules().items() if module.GATHERS}
    args, extra = main.parse_known_args(argv)
    unknown, after_dashes = [], False
    for item in extra:
        if item == "--" and not after_dashes:
            after_dashes = True
        elif args.command in gathers and (after_dashes or item == "-" or item[:1] != "-"):
            args.args.append(item)
        else:
            unknown.append(item)
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args
