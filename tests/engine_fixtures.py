"""Test fixtures: an engine built as `pwruntime generate` builds it from its flags, and a stand-in for CUDA's
allocator count as the engine reads it (`pwruntime.engine.allocator_reserved`)."""
from __future__ import annotations


def cli_engine(*argv: str):
    """The LLMEngine `pwruntime generate ARGV` would serve with (build_engine of the parsed flags)."""
    from pwruntime.cli import _registrars
    from pwruntime.cmd_generate import build_engine
    from traces.clikit import build_parser

    return build_engine(build_parser("pwruntime", "", _registrars()).parse_args(["generate", *argv]))[0]


def fake_allocator(monkeypatch, values: list[int]) -> list[int]:
    """CUDA's allocator count as the engine reads it: `values` in turn, the last one again after them (the first read
    is the serving reserve's base, taken when the activation reserve is measured); returns the reads."""
    import pwruntime.engine as engine_module

    reads: list[int] = []

    def reserved(device) -> int:
        reads.append(values[min(len(reads), len(values) - 1)])
        return reads[-1]
    monkeypatch.setattr(engine_module, "allocator_reserved", reserved)
    return reads
