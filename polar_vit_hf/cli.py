"""Command-line plumbing shared by the scripts of ``training/``, ``conversion/`` and ``benchmarks/``.

A mistake in what the user asked for (a missing path, a dataset that is not reachable offline, an
invalid setting, a folder without weights) is a :class:`UserError`: the command prints one or two
lines naming the input and the fix and exits with status 2.  ``--debug`` (or ``POLAR_VIT_DEBUG=1``)
shows the traceback instead.  Any other exception is an internal error and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

DEBUG_ENV = "POLAR_VIT_DEBUG"
USER_ERROR_STATUS = 2


class UserError(Exception):
    """An error in the user's input, reported without a traceback (exit status 2)."""


def debug_requested(argv: list[str]) -> bool:
    """``--debug`` on the command line or ``POLAR_VIT_DEBUG`` set to anything but ``""`` / ``"0"``."""
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def command(name: str) -> Callable[[Callable[[list[str] | None], int]], Callable[[list[str] | None], int]]:
    """Wrap a ``main(argv) -> int``: a :class:`UserError` becomes ``name: error: message`` on stderr and status 2."""

    def wrap(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            args = list(sys.argv[1:] if argv is None else argv)
            try:
                return main(args)
            except UserError as error:
                if debug_requested(args):
                    raise
                print(f"{name}: error: {user_message(error)}", file=sys.stderr)
                return USER_ERROR_STATUS

        return run

    return wrap


def user_message(error: UserError) -> str:
    """The message of a user error; one re-raised by a DataLoader worker (``Caught X in DataLoader worker process
    N. Original Traceback ...``) is reduced to the worker's own message."""
    text = str(error)
    if "Original Traceback" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    return last.split(": ", 1)[1] if last.startswith(f"{type(error).__name__}: ") else last


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--debug`` option every command has."""
    parser.add_argument(
        "--debug", action="store_true", help=f"show the traceback of user errors too (or set {DEBUG_ENV}=1)"
    )


__all__ = ["DEBUG_ENV", "USER_ERROR_STATUS", "UserError", "add_debug_flag", "command", "debug_requested"]
