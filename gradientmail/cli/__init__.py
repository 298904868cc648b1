"""The ``gradientmail`` command.

Subcommands, one file each:

- ``run`` (``run.py``): a GradientMailRun as local node processes, with the environment the
  operator injects, a live table, clean Ctrl-C; ``spec.py`` reads and validates the file,
  ``_nodes.py`` starts, reads, restarts and stops the processes and watches the mailbox.
- ``status`` (``table.py``): the same table for any run, read from its mailbox.
- ``align`` and ``verify`` (``tools.py``): the newest parameters into one safetensors
  file; every commit recomputed.
- ``sweep`` and ``rm`` (``housekeeping.py``): deleting, after a confirmation.
- ``demo`` (``demo.py``): the bare mailbox coordination, without training.

``_common.py`` opens URLs with clear errors (bad URL, unreachable store, empty or foreign
prefix). Exit status: 0 ok, 1 failed, 2 bad usage (URL, flag, spec file), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from gradientmail.cli import demo, housekeeping, run, table, tools
from gradientmail.cli._common import CliError
from gradientmail.errors import MailboxError

__all__ = ["main"]

_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run.run_command,
    "status": table.run_status,
    "align": tools.run_align,
    "verify": tools.run_verify,
    "sweep": housekeeping.run_sweep,
    "rm": housekeeping.run_rm,
    "demo": demo.run,
    "_demo-node": demo.run,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradientmail",
        description="Distributed training whose nodes never connect: they meet in a mailbox "
        "(an object store or a directory).",
        epilog="Start with `gradientmail run`: a few nodes train on this machine through a "
        "fresh mailbox directory.",
    )
    from gradientmail import __version__

    parser.add_argument("--version", action="version", version=f"gradientmail {__version__}")
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    run.add_parser(sub)
    table.add_parser(sub)
    tools.add_parsers(sub)
    housekeeping.add_parsers(sub)
    demo.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words:  # `gradientmail run [options] -- COMMAND ...`
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1 :]
    parser = _parser()
    args = parser.parse_args(words)
    if command and args.subcommand != "run":
        parser.error(f"only `gradientmail run` takes a command after --, not {args.subcommand}")
    args.command = command
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        return _HANDLERS[args.subcommand](args)
    except CliError as exc:
        errors.print(f"gradientmail {args.subcommand}: {exc}", markup=False)
        return exc.status
    except (MailboxError, TimeoutError) as exc:
        errors.print(f"gradientmail {args.subcommand}: {exc}", markup=False)
        return 1
    except KeyboardInterrupt:
        errors.print("interrupted", markup=False)
        return 130
