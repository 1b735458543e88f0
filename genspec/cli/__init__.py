"""The ``genspec`` command line: ``genspec SUBCOMMAND ...``.

Each subcommand lives in its own module and exposes ``add_parser(subparsers)``; the parser it adds
sets ``func`` to a callable taking the parsed ``argparse.Namespace`` and returning an exit code.
Errors a user can fix (:class:`genspec.errors.GenspecError`) are printed as one line, exit code 2.
A reader that closes the output early (``genspec ... | head``) ends the command quietly, as it ends Unix
tools: no traceback, exit code 141 (128 + SIGPIPE, what a shell reports for a tool killed by it).
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from genspec import __version__
from genspec.errors import ConfigError, GenspecError

#: exit code after the reader of standard output went away (128 + SIGPIPE)
BROKEN_PIPE = 141

# subcommand modules, in the order ``genspec --help`` lists them
_SUBCOMMANDS = [
    "genspec.cli.theory",
    "genspec.cli.generate",
    "genspec.cli.demo",
    "genspec.cli.index",
    "genspec.cli.calibrate",
    "genspec.cli.train",
    "genspec.cli.export",
    "genspec.cli.bench",
    "genspec.cli.tradeoff",
    "genspec.cli.serve",
]


def finite_float(text: str) -> float:
    """The argparse type of every numeric option: a float, refusing ``nan`` and ``inf`` (which Python's
    ``float`` reads, and no setting means)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def float_list(text: str, option: str) -> list[float]:
    """A comma-separated list of finite numbers (``--eps 0,0.01,0.05``), or a one-line ConfigError naming ``option``."""
    try:
        return [finite_float(item) for item in text.split(",") if item.strip()]
    except argparse.ArgumentTypeError:
        raise ConfigError(f"{option} must be comma-separated finite numbers, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line plus usage, exit 2 (argparse's own convention)
        self.print_usage(sys.stderr)
        self.exit(2, f"genspec: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="genspec", description="Generalized speculative decoding for language models.")
    parser.add_argument("--version", action="version", version=f"genspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2 if args.command is None else 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so that a reader gone by now is noticed below, not at interpreter exit
        return code
    except GenspecError as exc:
        print(f"genspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("genspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # what is left in stdout's buffer can go nowhere: point stdout at /dev/null so that the flush at
        # exit does not raise again (the recipe of Python's signal module documentation)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE

