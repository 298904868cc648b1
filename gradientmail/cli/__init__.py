"""The ``gradientmail`` command.

Subcommands, one file each:

- ``run`` (``run.py``): a GradientMailRun as local node processes, with the environment the
  operator injects, a live table, clean Ctrl-C; ``spec.py`` reads and validates the file,
  ``_nodes.py`` starts, reads, restarts and stops the processes and watches the mailbox,
  ``_report.py`` prints its progress and closing lines (the built-in language model's
  curves are the demo's, ``gradientmail/demo/report.py``).
- ``status`` (``table.py``): the same table for any run, read from its mailbox;
  ``_groups_table.py`` renders a Moshpit run's group rounds in it.
- ``align`` and ``verify`` (``tools.py``): the newest parameters into one safetensors
  file; every commit recomputed.
- ``sweep`` and ``rm`` (``housekeeping.py``): deleting, after a confirmation.
- ``demo`` (``demo.py``): the bare mailbox coordination, without training.

``__main__.py`` makes ``python -m gradientmail.cli`` the command; a command imports only its
own file (``status`` starts without pydantic, yaml or torch). ``_common.py`` opens URLs
with clear errors (bad URL, unreachable store, empty or foreign prefix) and bounded waits
(``--store-timeout``). Exit status: 0 ok, 1 failed, 2 bad usage (URL, flag, spec file), 130
on Ctrl-C.

Every failure is one line on stderr, ``gradientmail COMMAND: what went wrong``; with
``--debug`` (or ``GRADIENTMAIL_DEBUG=1``) the traceback is printed too. URLs are shown with
their query decoded (``endpoint=http://host:9000``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from rich.console import Console

from gradientmail.cli._common import (
    DEFAULT_STORE_TIMEOUT,
    STORE_TIMEOUT_ENV,
    CliError,
    readable_url,
    set_store_timeout,
    store_timeout,
)
from gradientmail.errors import MailboxError

__all__ = ["main"]

# Each subcommand's module (gradientmail.cli.<module>), with the function that adds its
# parser(s) and the commands it handles. A command imports only its own module: `status`,
# `sweep`, `rm` and `demo` never load `run`'s spec models (pydantic, yaml) nor torch
# (`align` and `verify` import torch when they run). --help and the tests build them all.
_MODULES: dict[str, tuple[str, dict[str, str]]] = {
    "run": ("add_parser", {"run": "run_command"}),
    "table": ("add_parser", {"status": "run_status"}),
    "tools": ("add_parsers", {"align": "run_align", "verify": "run_verify"}),
    "housekeeping": ("add_parsers", {"sweep": "run_sweep", "rm": "run_rm"}),
    "demo": ("add_parser", {"demo": "run", "_demo-node": "run"}),
}

# `run` imports these when it runs: a missing one is named when the command starts, as a
# missing `rich` is (gradientmail/_command.py), not as a traceback from inside `run`.
for _extra in ("yaml", "pydantic"):
    if importlib.util.find_spec(_extra) is None:
        raise ModuleNotFoundError(f"No module named {_extra!r}", name=_extra)


def _module(name: str) -> object:
    return importlib.import_module(f"gradientmail.cli.{name}")


def _handler(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    def handle(args: argparse.Namespace) -> int:
        found: Callable[[argparse.Namespace], int] = getattr(_module(module), function)
        return found(args)

    return handle


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    command: _handler(module, function)
    for module, (_, handlers) in _MODULES.items()
    for command, function in handlers.items()
}


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser; with ``only`` (a command), that one's in full and the
    others as bare names (their modules stay unimported)."""
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
    for module, (add, handlers) in _MODULES.items():
        if only is None or only in handlers:
            getattr(_module(module), add)(sub)
        else:
            for name in handlers:
                sub.add_parser(name)
    for command in sub.choices.values():
        _add_common_options(command)
    return parser


def _add_common_options(parser: argparse.ArgumentParser) -> None:
    """``--store-timeout`` and ``--debug`` on every subcommand (unless it has its own)."""
    taken = parser._option_string_actions
    if "--store-timeout" not in taken:
        parser.add_argument(
            "--store-timeout",
            type=float,
            metavar="SECONDS",
            help=f"seconds an S3 request of this command may take to connect, and to answer "
            f"({DEFAULT_STORE_TIMEOUT:g}, or ${STORE_TIMEOUT_ENV}); each is tried twice, so a "
            "store that hangs fails within about twice this",
        )
    if "--debug" not in taken:
        parser.add_argument(
            "--debug",
            action="store_true",
            help="print the traceback of a failure too (or set GRADIENTMAIL_DEBUG=1)",
        )


def _readable_urls(args: argparse.Namespace) -> None:
    """Every URL argument as people read it (the same mailbox; see readable_url)."""
    for name in ("url", "mailbox"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, readable_url(value))


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words:  # `gradientmail run [options] -- COMMAND ...`
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1 :]
    # Top-level options take no value: the first other word names the command.
    first = next((word for word in words if not word.startswith("-")), None)
    parser = _parser(first if first in _HANDLERS else None)
    args = parser.parse_args(words)
    if command and args.subcommand != "run":
        parser.error(f"only `gradientmail run` takes a command after --, not {args.subcommand}")
    args.command = command
    debug = bool(getattr(args, "debug", False)) or os.environ.get("GRADIENTMAIL_DEBUG", "") in (
        "1",
        "true",
        "yes",
    )
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    name = f"gradientmail {args.subcommand}"

    def fail(message: str, status: int) -> int:
        if debug:
            traceback.print_exc()
        errors.print(f"{name}: {' '.join(message.split())}", markup=False)
        return status

    try:
        set_store_timeout(getattr(args, "store_timeout", None))
        store_timeout()  # a bad $GRADIENTMAIL_STORE_TIMEOUT is bad usage, whatever the store
        _readable_urls(args)
        return _HANDLERS[args.subcommand](args)
    except CliError as exc:
        return fail(str(exc), exc.status)
    except (MailboxError, TimeoutError) as exc:
        return fail(str(exc) or type(exc).__name__, 1)
    except OSError as exc:  # a file the user named: unwritable, missing, a full disk
        if exc.strerror:
            return fail(f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror, 1)
        return fail(str(exc) or type(exc).__name__, 1)
    except KeyboardInterrupt:
        errors.print("interrupted", markup=False)
        return 130
    except Exception as exc:  # a bug: still one line, the traceback on request
        if debug:
            raise
        hint = "(--debug shows the traceback; please report it)"
        return fail(f"unexpected {type(exc).__name__}: {exc} {hint}", 1)
