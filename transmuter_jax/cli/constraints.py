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


def constraint_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options of the structured-output flags (files read, a schema parsed).

    Raises:
        ValueError: for a file that cannot be read or a schema that is not JSON.
    """
    options: dict[str, Any] = {}
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        try:
            with open(schema, encoding="utf-8") as f:
                options["json_schema"] = json.load(f)
        except OSError as error:
            raise ValueError(f"--json-schema {schema}: {error.strerror}") from None
        except ValueError as error:
            raise ValueError(f"--json-schema {schema} is not JSON: {error}") from None
    if getattr(args, "json_object", False):
        options["json_object"] = True
    if getattr(args, "regex", None) is not None:
        options["regex"] = args.regex
    grammar = getattr(args, "grammar", None)
    if grammar is not None:
        try:
            with open(grammar, encoding="utf-8") as f:
                options["grammar"] = f.read()
        except OSError as error:
            raise ValueError(f"--grammar {grammar}: {error.strerror}") from None
    if getattr(args, "choice", None):
        options["choice"] = list(args.choice)
    if getattr(args, "json_whitespace", False):
        options["json_whitespace"] = True
    return options
