"""CLI plumbing shared by `pwsim` and `pwruntime`: user errors, exit codes, subcommand dispatch, atomic output files
(PNG figures among them), fixed-width text tables, a benchmark's report.

A command module exposes `register(subparsers)` which adds its parser and sets `func=run`.
`UserError` (and its subclasses across the project) print one line `error: ...` and exit 2;
anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NoReturn, Sequence


class UserError(Exception):
    """Something the user can fix (bad file, bad flag, budget too small). Exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own misuse errors: one line naming the help, exit 2
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


class _CommandParser(_Parser):
    """A subcommand's parser (and its own subcommands'): an argument it does not know is its error, named after it.
    Left to argparse, the top-level parser would report it, naming neither the command nor where its options are."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def build_parser(prog: str, description: str, registrars: Sequence[Callable]) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
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
    except BrokenPipeError:  # the reader of stdout left (`| head`): stop quietly, as the shell's own tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's last flush is silent
        return 141


def check_counts(*flags: tuple[str, int | None]) -> None:
    """Refuse the first (flag, value) pair whose value is below 1 (counts and sizes), naming that flag and its value;
    None (a flag left out, its default decided later) passes."""
    for flag, value in flags:
        if value is not None and value < 1:
            raise UserError(f"{flag} must be positive, got {value}")


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    """Refuse a negative seed (numpy's generators take none) before any work; None (no seed given) passes."""
    if seed is not None and seed < 0:
        raise UserError(f"{flag} must be >= 0, got {seed}")


def check_time_scale(value: float) -> float:
    """`--time-scale` (pwsim run, pwruntime replay and bench serve): a number >= 0, which multiplies the arrival
    times (0: every request at once)."""
    if not 0 <= value < float("inf"):  # also refuses NaN
        raise UserError(f"--time-scale must be a number >= 0 (0: every request at once), got {value}")
    return value


def check_output(path: str | os.PathLike, flag: str = "--out", directory: bool = True) -> Path:
    """Refuse, before any long work and creating nothing, an output path that cannot be written: a file where a
    directory is wanted (or a directory where a file is), a path under a file, or a place this process cannot create
    entries in (probed with a temporary directory, removed at once), or an empty one. One UserError naming `flag`."""
    if str(path) == "":
        raise UserError(f"{flag} is empty; give a path")
    p = Path(path)
    if directory and p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p} is a file; give a directory")
    if not directory and p.is_dir():
        raise UserError(f"{flag} {p} is a directory; give a file name")
    base = p if directory and p.is_dir() else p.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{flag} {p}: {base} is a file, not a directory; choose another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pw-write-check.", dir=base))
    except OSError as e:
        raise UserError(f"{flag} {p}: cannot write in {base} ({e.strerror or e}); choose another path") from None
    return p


@contextmanager
def writing(path: str | os.PathLike, flag: str = "--out") -> Iterator[None]:
    """An OSError while writing `path` inside (a full disk, a folder gone or not writable) as one UserError naming
    it; the atomic writers below leave nothing behind."""
    try:
        yield
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write it ({e.strerror or e}); nothing was written") from None


def default_mode(path: str | os.PathLike) -> Path:
    """Give a file or folder made by `tempfile` (private: 0600, 0700) the permissions a plain `open`/`mkdir` would
    have under this process's umask, before it is moved into place."""
    umask = os.umask(0)
    os.umask(umask)
    p = Path(path)
    os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
    return p


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Let `write` fill a temporary binary file in the same folder, then rename it to `path`: a reader never sees a
    half-written file, and a write that fails leaves nothing behind."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        default_mode(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`text` in UTF-8, written atomically (see `write_atomic`)."""
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """`obj` as indented JSON with a final newline, written atomically (see `write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def report_bench(result: dict, command: str, out: Path | None, as_json: bool, text: Callable[[dict], None],
                 plot: Callable[[dict, Path], Any] | None = None) -> int:
    """A benchmark's ending, the same for every `pwsim bench` and `pwruntime bench` target: `result` written to
    `out` (with `plot`'s PNG beside it), then printed as JSON (stdout stays JSON: the reproducing command and the
    files go to stderr) or as `text` followed by them. Returns the exit code, 0."""
    figure = Path(out).with_suffix(".png") if out and plot is not None else None
    if out:
        with writing(out):
            write_json_atomic(out, result)
    if figure is not None:
        with writing(figure):
            plot(result, figure)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        text(result)
    ending = sys.stderr if as_json else sys.stdout
    print(f"\nreproduce: {command}", file=ending)
    if out:
        print(f"results: {out}" + (f" (figure: {figure})" if figure is not None else ""), file=ending)
    return 0


def millis(seconds: float | None) -> str:
    """Seconds as milliseconds to two decimals for a table or a line ("n/a" for None)."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Cells as a terminal table: each column as wide as its widest cell, the first `left` columns left-aligned and
    the others right-aligned, a rule of dashes under the header."""
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), imported on first use: commands that draw nothing
    do not pay for it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plain_log_ticks(ax) -> None:
    """Label a log-scaled axes' ticks as plain numbers at 1, 2 and 5 a decade, the minor ticks unlabelled (matplotlib's
    own labels overlapped, or left a short range with one)."""
    from matplotlib import ticker
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log":
            axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(ticker.NullFormatter())


def write_png(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Lay `fig` out, write it to `path` as a PNG (atomically, see `write_atomic`) and close it. The PNG names no
    matplotlib version, so the same plot is the same bytes wherever it is drawn with the same fonts."""
    try:
        fig.tight_layout()
        return write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi, metadata={"Software": None}))
    finally:
        pyplot().close(fig)
