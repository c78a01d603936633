"""The command line's structured-output flags: --json-schema, --json-object, --regex, --grammar,
--choice (docs/structured-output.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the structured-output flags to ``parser`` (one constraint at most)."""
    group = parser.add_argument_group("structured output", "At most one constraint.")
    group.add_argument("--json-schema", metavar="FILE", help="the answer is one JSON document "
                       "valid under the JSON schema in FILE")  # fmt: skip
    group.add_argument("--json-object", action="store_true", help="the answer is one JSON object")
    group.add_argument("--regex", metavar="PATTERN", help="the answer fully matches PATTERN "
                       "(llguidance's regex dialect: Rust's regex crate)")  # fmt: skip
    group.add_argument("--grammar", metavar="FILE", help="the answer is a sentence of the Lark "
                       "grammar in FILE (llguidance's dialect)")  # fmt: skip
    group.add_argument("--choice", action="append", metavar="STR", help="the answer is exactly "
                       "one of the --choice strings (repeatable)")  # fmt: skip
    group.add_argument("--json-whitespace", action="store_true", help="JSON may hold whitespace "
                       "between its tokens (default: compact)")  # fmt: skip


MAX_FILE_BYTES = 16 << 20
"""The largest schema or grammar file read (16 MiB)."""


def read_file(flag: str, path: str, what: str) -> str:
    """The UTF-8 text of the file ``path`` given to ``flag``, refused by name when it is not a
    regular file (a folder, a FIFO, a device), larger than :data:`MAX_FILE_BYTES`, or not
    UTF-8."""
    from ..runtime.paths import not_a_file

    why = not_a_file(path, what)
    if why is not None:
        raise ValueError(f"{flag}: {why}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{flag} {path} holds more than {MAX_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} {path} is not UTF-8 text: {error.reason}") from None


def constraint_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options of the structured-output flags (files read, a schema parsed).

    Raises:
        ValueError: for a file that cannot be read or a schema that is not JSON.
    """
    options: dict[str, Any] = {}
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        text = read_file("--json-schema", schema, "a JSON schema")
        try:
            options["json_schema"] = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"--json-schema {schema} is not JSON: {error}") from None
    if getattr(args, "json_object", False):
        options["json_object"] = True
    if getattr(args, "regex", None) is not None:
        options["regex"] = args.regex
    grammar = getattr(args, "grammar", None)
    if grammar is not None:
        options["grammar"] = read_file("--grammar", grammar, "a grammar")
    if getattr(args, "choice", None):
        options["choice"] = list(args.choice)
    if getattr(args, "json_whitespace", False):
        options["json_whitespace"] = True
    return options
