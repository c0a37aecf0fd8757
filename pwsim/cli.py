"""The `pwsim` command line: one subcommand per module, dispatched through traces.clikit."""
from __future__ import annotations

from typing import Sequence

from traces.clikit import build_parser, run_main


def _registrars():
    from pwsim import cmd_models
    return [cmd_models.register]


def main(argv: Sequence[str] | None = None) -> int:
    from policies.calibration import CalibrationError
    parser = build_parser("pwsim", "PagedWeight simulator: replay traces, compare planners under memory budgets.",
                          _registrars())
    return run_main(parser, argv, user_errors=(CalibrationError,))


if __name__ == "__main__":
    raise SystemExit(main())
