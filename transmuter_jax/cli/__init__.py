"""The command line: transmuter-jax generate | chat | translate | transcribe | caption | prepare.

Run ``transmuter-jax --help`` for the commands and ``transmuter-jax COMMAND --help`` for their
options. See docs/cli.md. The parser is :mod:`.parser` (its ``COMMANDS`` lists the command
modules, one per command); the options the commands share are in :mod:`.options`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from .output import PROG, CompileNotice, error_line
from .parser import COMMANDS, command_modules, parse, parser

__all__ = ["COMMANDS", "PROG", "main", "parse", "parser"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 error, 130 interrupted).

    A usage error exits with status 2 (SystemExit, as argparse does).
    """
    args = parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from ..runtime import stored

    notice = CompileNotice()
    stored.compile_listeners.append(notice)
    try:
        return command_modules()[args.command].run(args, notice)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        sys.stderr.close()  # a closed pipe (such as `| head`): stop quietly
        return 1
    except Exception as error:  # noqa: BLE001 - one clear line, the traceback with --verbose
        if args.verbose:
            traceback.print_exc()
        print(error_line(error, args.verbose), file=sys.stderr)
        return 1
    finally:
        stored.compile_listeners.remove(notice)
