"""The `pwsim` command line: one subcommand per module, dispatched through traces.clikit."""
from __future__ import annotations

from typing import Sequence

from traces.clikit import build_parser, run_main


def _registrars():
    from pwsim import (cmd_bench, cmd_capacity, cmd_chrome_trace, cmd_compare, cmd_fidelity, cmd_hardware,
                       cmd_models, cmd_plan_log, cmd_policies, cmd_prefill_fit, cmd_run, cmd_traces)
    return [cmd_models.register, cmd_hardware.register, cmd_policies.register, cmd_traces.register,
            cmd_bench.register, cmd_run.register, cmd_compare.register, cmd_capacity.register, cmd_fidelity.register,
            cmd_prefill_fit.register, cmd_chrome_trace.register, cmd_plan_log.register]


def main(argv: Sequence[str] | None = None) -> int:
    from policies.calibration import CalibrationError
    from policies.registry import PolicyError
    parser = build_parser("pwsim", "PagedWeight simulator: replay traces, compare planners under memory budgets.",
                          _registrars())
    return run_main(parser, argv, user_errors=(CalibrationError, PolicyError))


if __name__ == "__main__":
    raise SystemExit(main())
