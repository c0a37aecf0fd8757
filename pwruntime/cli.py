"""The `pwruntime` command line: one subcommand per module, dispatched through traces.clikit."""
from __future__ import annotations

from typing import Sequence

from traces.clikit import build_parser, run_main


def _registrars():
    # each entry: a module with register(subparsers); imported lazily so --help stays fast
    import importlib
    names = ["cmd_demo", "cmd_record", "cmd_replay", "cmd_serve", "cmd_generate", "cmd_perplexity", "cmd_quantize", "cmd_bench", "cmd_calibrate", "cmd_quality"]
    return [importlib.import_module(f"pwruntime.{n}").register for n in names]


def main(argv: Sequence[str] | None = None) -> int:
    from policies.calibration import CalibrationError
    from policies.registry import PolicyError
    parser = build_parser("pwruntime", "PagedWeight runtime: serve MoE models with any-precision expert weights.",
                          _registrars())
    return run_main(parser, argv, user_errors=(CalibrationError, PolicyError))


if __name__ == "__main__":
    raise SystemExit(main())
