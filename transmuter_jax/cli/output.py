"""What the commands print: streamed lines, JSON records, notices on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

PROG = "transmuter-jax"


def error_line(error: BaseException, verbose: bool = False) -> str:
    """The one line of stderr that reports ``error``: its message with its lines joined (the
    exception's name when it has none, and also with ``verbose``); for a model of another task
    (``WrongTask``) anywhere below the commands, the command that runs it."""
    message = " ".join(str(error).split()) or type(error).__name__
    task = getattr(error, "task", None)
    if type(error).__name__ == "WrongTask" and isinstance(task, str):
        from ..tasks import detect

        command = next((t.command for t in detect.TASKS if t.key == task), None)
        if command is not None and command not in message:
            message += f" (on the command line: '{command}')"
    if verbose and message != type(error).__name__:
        message += f" ({type(error).__name__})"
    return f"{PROG}: error: {message}"


def warn(message: str) -> None:
    """A warning on stderr, named by the program."""
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def say(args: argparse.Namespace, message: str) -> None:
    """A detail on stderr, with --verbose only."""
    if getattr(args, "verbose", False):
        print(message, file=sys.stderr, flush=True)


class CompileNotice:
    """Says on stderr when this process compiles programs (a first run), and for how long."""

    def __init__(self) -> None:
        self.count, self.seconds, self.told = 0, 0.0, False

    def __call__(self, event: str, seconds: float) -> None:
        if event == "start" and not self.told:
            self.told = True
            print(f"{PROG}: compiling (a first run with these shapes; later runs load the "
                  "programs from the compile cache) ...", file=sys.stderr, flush=True)  # fmt: skip
        elif event == "done":
            self.count += 1
            self.seconds += seconds

    def report(self) -> None:
        """Says how long the compiling since the last report took, if there was any."""
        if self.count:
            plural = "s" if self.count > 1 else ""
            print(f"{PROG}: compiled {self.count} program{plural} in {self.seconds:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.count, self.seconds, self.told = 0, 0.0, False


def record(result: Any, index: int | None = None, **head: Any) -> dict[str, Any]:
    """The JSON object of one result: ``head``, then text, token ids, log-probabilities and
    finish reason, then its ``index`` among several sequences (when given)."""
    out = dict(head, text=result.text, token_ids=result.token_ids)
    out.update(logprobs=result.logprobs, finish_reason=result.finish_reason)
    if index is not None:
        out["index"] = index
    return out


def write_line(pieces: Iterable[str]) -> int:
    """Writes streamed pieces to stdout as they come, then a newline; returns their count.
    The stream is closed however this ends (Ctrl-C while a piece is written included): its
    generation stops before the process exits."""
    count = 0
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            count += 1
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return count


def print_texts(results: Sequence[Any]) -> None:
    """The texts of several sequences, each on a line of its own after its index: '[j] text'."""
    for j, result in enumerate(results):
        print(f"[{j}] {result.text}")
    sys.stdout.flush()


def print_json(results: Sequence[Any], n: int, tokenizer: Any = None, **head: Any) -> None:
    """One JSON object per result (``head`` first; with n > 1, each with its index); with
    ``tokenizer``, the top log-probabilities of each token too, OpenAI-style."""
    for j, result in enumerate(results):
        out = record(result, j if n > 1 else None, **head)
        if tokenizer is not None and result.top_logprobs is not None:
            decode = tokenizer.decode
            out["top_logprobs"] = [
                [{"token_id": t, "token": decode([t]), "logprob": lp} for t, lp in best]
                for best in result.top_logprobs
            ]
        print(json.dumps(out, ensure_ascii=False))
