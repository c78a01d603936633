"""The argument types and the parser class of the command line: usage errors are one
``transmuter-jax: error:`` line (exit 2), and numbers out of range are refused by the parser."""

from __future__ import annotations

import argparse
import math
import sys

from .output import PROG


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one ``transmuter-jax: error:`` line (exit 2);
    ``--help`` shows the usage."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{PROG}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)


def integer(least: int, most: int | None = None):
    """An argparse type: a whole number from ``least`` (to ``most``)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least or (most is not None and value > most):
            span = f"from {least} to {most}" if most is not None else f"at least {least}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {span}")
        return value

    return parse


def real(least: float, most: float | None = None, *, above: bool = False):
    """An argparse type: a finite number from ``least`` (or above it, with ``above``) to
    ``most``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low = value > least if above else value >= least
        if not math.isfinite(value) or not low or (most is not None and value > most):
            side = f"above {least:g}" if above else f"at least {least:g}"
            span = f"{side} and at most {most:g}" if most is not None else side
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be finite, {span}")
        return value

    return parse


def nonempty(text: str) -> str:
    """An argparse type: a non-empty string."""
    if not text:
        raise argparse.ArgumentTypeError("an empty string matches everywhere; give some text")
    return text
