"""CLI plumbing shared by `pwsim` and `pwruntime`: user errors, exit codes, subcommand dispatch.

A command module exposes `register(subparsers)` which adds its parser and sets `func=run`.
`UserError` (and its subclasses across the project) print one line `error: ...` and exit 2;
anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


class UserError(Exception):
    """Something the user can fix (bad file, bad flag, budget too small). Exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own misuse errors: one line, exit 2
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser(prog: str, description: str, registrars: Sequence[Callable]) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in registrars:
        register(sub)
    return parser


def run_main(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
             user_errors: tuple[type[BaseException], ...] = ()) -> int:
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (UserError, *user_errors) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
