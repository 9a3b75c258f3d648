# PYTHON_ARGCOMPLETE_OK  (argcomplete's global completion looks for this marker)
"""`pstranspile`: the command line (also `python -m transpiler`).

Each subcommand is one function decorated with `@command(...)`, which declares its
arguments; `COMMANDS` at the bottom is the one place that lists them. To add one:

    @command("plan", "print the partition plan", arg("program"), arg("--pservers", required=True))
    def plan_command(args: argparse.Namespace) -> int:
        ...
        return EXIT_OK

and append `plan_command` to `COMMANDS`.

Errors a user can cause (our `PsTranspilerError`s, unreadable or unwritable files, bad
arguments) become exactly one line on stderr, `pstranspile: error: ...`, and exit code 2,
never a traceback; `UnknownFieldsWarning`s from serde and the verifier's warnings (once per
file) become `pstranspile: warning: ...`.
Anything else is a bug: one `pstranspile: internal error: ...` line and exit code 3
(`PSTRANSPILE_TRACEBACK=1` re-raises it to show the traceback). `serve` and `launch`
exit 1 when the training job itself fails (a trainer vanished or failed, a process
exited non-zero), with the reason in one `pstranspile: error: ...` line.

Every command takes `-q/--quiet` (no warnings about the input programs, no progress or
live status lines) and `--full`: by default no line printed to the terminal is longer than
about `MAX_WIDTH` characters (a long list keeps its first items and says `... and N more`;
a long op line of a dump continues on indented lines); `--full` prints every line whole.
Shell completion comes from `argcomplete` when it is installed (the `completion` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from transpiler import __version__
from transpiler.errors import PsTranspilerError, VerifyError

# What a command needs is imported inside it: `--version`, `--help` and the quick commands
# should not pay for the IR, numpy, grpc or networkx (see tests/test_cli_startup.py).
if TYPE_CHECKING:
    from transpiler.ir.program import Program

PROG = "pstranspile"
EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `... | head`
EXIT_JOB_FAILED = 1  # serve / launch: the training job failed at run time (a trainer vanished, a process failed)
EXIT_INTERRUPTED = 130
MAX_WIDTH = 200  # characters of a printed line, unless --full
# -q and --full, set once per run by `_main` (the helpers below read them)
_OUTPUT = {"quiet": False, "full": False}


class UsageError(Exception):
    """Bad command-line arguments (raised instead of argparse's print-usage-and-exit)."""


class CliError(Exception):
    """An error the CLI itself detects (an output format it cannot write, a missing tool)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# ------------------------------------------------------------------ registry


class Arg(NamedTuple):  # a NamedTuple, not a dataclass: importing dataclasses costs the CLI's startup 10 ms
    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    """One `add_argument` call, declared next to the command that takes it."""
    return Arg(flags, options)


class Command(NamedTuple):
    name: str
    help: str
    args: tuple[Arg, ...]
    run: Callable[[argparse.Namespace], int]
    # Only reads and writes files, then the process may end without the interpreter's
    # teardown (see `run`).
    quick_exit: bool = False


def command(
    name: str, help: str, *args: Arg, quick_exit: bool = False
) -> Callable[[Callable[[argparse.Namespace], int]], Command]:
    def wrap(run: Callable[[argparse.Namespace], int]) -> Command:
        return Command(name, help, args, run, quick_exit)

    return wrap


# ------------------------------------------------------------------ helpers


def program_path(path: str | Path, what: str = "program") -> Path:
    """The file a program argument names: the file itself, or a folder's `__model__`
    (Fluid 1.8's layout)."""
    p = Path(path)
    if p.is_dir():
        if (p / "__model__").is_file():
            return p / "__model__"
        raise CliError(f"{what} {path} is a folder without __model__")
    return p  # a missing file: the OSError names it


def load_program(path: str | Path, what: str = "program") -> Program:
    """Load a `.pb` (any name, or a folder holding `__model__`), turning serde's
    `UnknownFieldsWarning`s and the verifier's warnings (one line per kind for the file,
    e.g. ops that repeat attrs) into warning lines (none with -q)."""
    from transpiler.ir.program import Program
    from transpiler.ir.serde import UnknownFieldsWarning
    from transpiler.ir.verifier import check_warnings

    path = str(program_path(path, what))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownFieldsWarning)
        program = Program.load(path)
    seen: list[str] = []
    for warning in caught:
        if issubclass(warning.category, UnknownFieldsWarning):
            text = str(warning.message)
            if text not in seen:
                seen.append(text)
                warn(text, noisy=True)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    for text in check_warnings(program, name=path):
        warn(text, noisy=True)
    return program


def warn(text: str, *, noisy: bool = False) -> None:
    """One warning line on stderr; a `noisy` one (about the input programs) not with -q."""
    if noisy and _OUTPUT["quiet"]:
        return
    print(fit_line(f"{PROG}: warning: {_one_line(text)}"), file=sys.stderr)


# ------------------------------------------------------------------ line width


def fit_line(line: str, width: int = MAX_WIDTH) -> str:
    """`line`, or (over `width` characters, without --full) its first part: a list
    (`label: a, b, c, ...`) keeps the items that fit and says `... and N more`; other text
    is cut and says how much was left out."""
    if _OUTPUT["full"] or len(line) <= width:
        return line
    items = _split_top(line, ", ")
    if len(items) > 2:  # a list: the items that fit
        kept: list[str] = []
        used = 0
        for item in items:
            if used + len(item) + 2 > width - 40:
                break
            kept.append(item)
            used += len(item) + 2
        if kept:
            return f"{', '.join(kept)}, ... and {len(items) - len(kept)} more (--full shows all)"
    # a message: its longest bracketed list cut, then its longest word (a path) cut in the middle
    line = _shorten_group(line, width)
    if len(line) <= width:
        return line
    word = max(line.split(" "), key=len)
    excess = len(line) - width + 3
    if len(word) - excess >= 24:
        keep = len(word) - excess
        return line.replace(word, f"{word[:keep // 3]}...{word[len(word) - (keep - keep // 3):]}", 1)
    tail = 50  # the end of a message often says what to do
    head = width - tail - 45
    return f"{line[:head]} [... {len(line) - head - tail} more characters; --full shows all ...] {line[-tail:]}"


def _shorten_group(line: str, width: int) -> str:
    """`line` with its longest bracketed list, `(a, b, c)` or `[a, b, c]`, cut to the items
    that let the line fit (or to its first) and `... and N more`."""
    groups = []
    depth, start = 0, 0
    for i, ch in enumerate(line):
        if ch in "([":
            if depth == 0:
                start = i
            depth += 1
        elif ch in ")]" and depth:
            depth -= 1
            if depth == 0:
                groups.append((start, i))
    for start, end in sorted(groups, key=lambda g: g[0] - g[1]):
        items = _split_top(line[start + 1:end], ", ")
        if len(items) < 2:
            continue
        # The most items that fit (at least one), in one pass over the items.
        fixed = start + 1 + len(line) - end + len(", ... and  more") + len(str(len(items)))
        keep, used = 1, len(items[0])
        while keep < len(items) - 1 and fixed + used + 2 + len(items[keep]) <= width:
            used += 2 + len(items[keep])
            keep += 1
        return f"{line[:start + 1]}{', '.join(items[:keep])}, ... and {len(items) - keep} more{line[end:]}"
    return line


def wrap_line(line: str, width: int = MAX_WIDTH, lead: str = "") -> list[str]:
    """A dump line (`  op 3 mul X=[a] -> Out=[b] {...}`) as lines of at most about `width`
    characters: it breaks between slots and between attrs, continuation lines indented by 4
    more (after `lead`, a unified diff's ` `/`-`/`+`); a list too long for a line keeps the
    items that fit and says `... and N more`. Whole without --full."""
    if _OUTPUT["full"] or len(line) <= width:
        return [line]
    body = line[len(lead):]
    indent = len(body) - len(body.lstrip(" "))
    cont = lead + " " * (indent + 4)
    room = max(40, width - len(cont))
    out: list[str] = []
    current = lead + " " * indent
    fresh = True
    for token in _split_top(body.strip(), " "):
        for piece in _fit_token(token, room):
            if not fresh and len(current) + 1 + len(piece) > width:
                out.append(current)
                current, fresh = cont, True
            current += piece if fresh else " " + piece
            fresh = False
    out.append(current)
    return out


def _fit_token(token: str, room: int) -> list[str]:
    """One token of a dump line as pieces of at most about `room` characters: `{a=1, b=2}`
    (the attrs) breaks between attrs; a `[...]` list too long keeps what fits."""
    if len(token) <= room:
        return [token]
    if token.startswith("{") and token.endswith("}"):
        items = _split_top(token[1:-1], ", ")
        if len(items) > 1:
            pieces = ["{" + items[0] + ","] + [item + "," for item in items[1:-1]] + [items[-1] + "}"]
            return [piece for item in pieces for piece in _fit_token(item, room)]
    start = token.find("[")
    if start >= 0 and token.rstrip(",}").endswith("]"):
        end = len(token.rstrip(",}"))
        items = _split_top(token[start + 1:end - 1], ", ")
        kept: list[str] = []
        used = start + 30
        for item in items:
            if used + len(item) + 2 > room:
                break
            kept.append(item)
            used += len(item) + 2
        if len(kept) < len(items):
            shown = ", ".join(kept) + (", " if kept else "")
            return [f"{token[:start + 1]}{shown}... and {len(items) - len(kept)} more]{token[end:]}"]
    cut = max(20, room - 40)
    return [f"{token[:cut]}... ({len(token) - cut} more characters)"]


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside brackets, braces, parentheses and quotes."""
    parts: list[str] = []
    depth, quote, escaped, start, i = 0, "", False, 0, 0
    n, k = len(text), len(sep)
    while i < n:
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            i += k
            start = i
            continue
        i += 1
    parts.append(text[start:])
    return [part for part in parts if part]


def _print_lines(lines, out=None) -> None:
    """Print each line fitted to the width (lists shortened)."""
    out = out or sys.stdout
    for line in lines:
        out.write(fit_line(line) + "\n")


def _print_json(data: Any) -> None:
    import json

    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_output(path: str, data: bytes) -> None:
    """Write atomically, so a failed run never leaves half a file behind."""
    from transpiler.fileio import write_bytes_atomic

    try:
        write_bytes_atomic(Path(path), data)
    except OSError as exc:  # name the file the user asked for, not the temp file
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None


def _emit(text: str, output: str | None, *, wrap: bool = False) -> None:
    """`text` to stdout (a dump's long lines wrapped, with `wrap`, unless --full), or
    whole into the file `output`."""
    if output is None or output == "-":
        if wrap and not _OUTPUT["full"]:
            text = "".join(piece + "\n" for line in text.splitlines() for piece in wrap_line(line))
        sys.stdout.write(text)
    else:
        write_output(output, text.encode("utf-8"))


def _check_block(program: Program, block: int | None, path: str) -> None:
    """Reject `--block N` out of range before any output is written."""
    if block is not None and not 0 <= block < program.num_blocks:
        raise CliError(f"{path}: --block {block} is out of range: the program has blocks 0..{program.num_blocks - 1}")


def _one_line(text: str) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else str(text).strip() or "unknown error"


# ------------------------------------------------------------------ commands


@command(
    "dump",
    "print a program as text, one op per line (verifies it first)",
    arg("program", metavar="P.pb", help="a serialized ProgramDesc (or a folder holding __model__)"),
    arg("--block", type=int, metavar="N", help="only block N"),
    arg("--json", action="store_true", help="JSON instead of text (carries attr types)"),
    arg("--all-attrs", action="store_true", help="keep noise attrs (op_callstack, op_namescope) and op versions"),
    arg("--no-verify", action="store_true", help="dump even a program that fails verification"),
    arg("-o", "--output", metavar="FILE", help="write to FILE instead of stdout"),
)
def dump_command(args: argparse.Namespace) -> int:
    from transpiler.ir.printer import dump, dump_json_text
    from transpiler.ir.verifier import verify

    program = load_program(args.program)
    if not args.no_verify:
        verify(program, name=args.program)
    _check_block(program, args.block, args.program)
    if args.json:
        text = dump_json_text(program, block=args.block, all_attrs=args.all_attrs)
    else:
        text = dump(program, block=args.block, all_attrs=args.all_attrs)
    _emit(text, args.output, wrap=not args.json)
    return EXIT_OK


@command(
    "diff",
    "compare two programs: a summary, then a unified diff of their dumps (exit 0 equal, 1 different)",
    arg("a", metavar="A.pb", help="the program before"),
    arg("b", metavar="B.pb", help="the program after"),
    arg("--all-attrs", action="store_true", help="compare noise attrs (op_callstack, op_namescope) too"),
    arg("--summary-only", action="store_true", help="print the summary without the line diff"),
    arg("--json", action="store_true", help="the summary (and, without --summary-only, the line diff) as JSON"),
)
def diff_command(args: argparse.Namespace) -> int:
    from transpiler.ir.diff import diff_programs

    a, b = load_program(args.a), load_program(args.b)
    result = diff_programs(a, b, names=(args.a, args.b), all_attrs=args.all_attrs)
    if args.json:
        _print_json(diff_json(result, summary_only=args.summary_only))
        return EXIT_OK if result.equal else EXIT_DIFFERENT
    if result.equal:
        return EXIT_OK
    _print_lines(result.summary_lines())
    body = result.text_diff or result.detail_diff
    if body and not args.summary_only:
        sys.stdout.write("\n")
        for line in body.splitlines():
            if line.startswith(("---", "+++", "@@")) or not line:
                sys.stdout.write(fit_line(line) + "\n")
            else:
                sys.stdout.write("".join(piece + "\n" for piece in wrap_line(line, lead=line[0])))
    return EXIT_DIFFERENT


DIFF_SCHEMA = "pstranspile.diff/1"


def diff_json(result: Any, *, summary_only: bool = False) -> dict[str, Any]:
    """`diff --json`'s document (schema `pstranspile.diff/1`, docs/cli.md)."""
    def counts(pairs) -> dict[str, int]:
        return {name: n for name, n in pairs}

    return {
        "schema": DIFF_SCHEMA,
        "a": result.names[0],
        "b": result.names[1],
        "equal": result.equal,
        "version": None if result.version_change is None else
        {"before": result.version_change[0], "after": result.version_change[1]},
        "blocks": [
            {
                "idx": block.idx,
                "ops_before": block.ops_before,
                "ops_after": block.ops_after,
                "ops_added": counts(block.ops_added),
                "ops_removed": counts(block.ops_removed),
                "vars_added": list(block.vars_added),
                "vars_removed": list(block.vars_removed),
                "vars_changed": [
                    {"name": change.name,
                     "changes": [{"field": word, "before": x, "after": y} for word, x, y in change.changes]}
                    for change in block.vars_changed
                ],
                "parent": None if block.parent_change is None else
                {"before": block.parent_change[0], "after": block.parent_change[1]},
            }
            for block in result.blocks
        ],
        "blocks_added": [{"idx": idx, "ops": counts(ops)} for idx, ops in result.blocks_added],
        "blocks_removed": [{"idx": idx, "ops": counts(ops)} for idx, ops in result.blocks_removed],
        "notes": list(result.notes),
        "diff": None if summary_only else (result.text_diff or result.detail_diff),
    }


DOT_SUFFIXES = (".dot", ".gv")


@command(
    "graph",
    "draw the op graph as Graphviz DOT (or SVG through the `dot` program; verifies the program first)",
    arg("program", metavar="P.pb", help="a serialized ProgramDesc"),
    arg("-o", "--output", required=True, metavar="OUT", help="OUT.dot / OUT.gv (DOT text) or OUT.svg (needs Graphviz)"),
    arg("--block", type=int, metavar="N", help="only block N (default: every block, one cluster each)"),
    arg("--no-verify", action="store_true", help="draw even a program that fails verification"),
)
def graph_command(args: argparse.Namespace) -> int:
    import shutil

    from transpiler.ir.dot import to_dot
    from transpiler.ir.verifier import verify

    suffix = Path(args.output).suffix.lower()
    if suffix not in (*DOT_SUFFIXES, ".svg"):
        raise CliError(f"cannot tell the format of {args.output!r}: name it .dot, .gv or .svg")
    dot_program = shutil.which("dot") if suffix == ".svg" else None
    if suffix == ".svg" and dot_program is None:
        raise CliError(
            f"writing {args.output} needs Graphviz's `dot` program, which is not on PATH: "
            "install Graphviz or write .dot instead"
        )
    program = load_program(args.program)
    if not args.no_verify:
        verify(program, name=args.program)
    _check_block(program, args.block, args.program)
    text = to_dot(program, block=args.block, name=Path(args.program).name)
    if suffix in DOT_SUFFIXES:
        write_output(args.output, text.encode("utf-8"))
        return EXIT_OK
    assert dot_program is not None
    write_output(args.output, _render_svg(dot_program, text))
    return EXIT_OK


def _render_svg(dot_program: str, text: str) -> bytes:
    import subprocess

    try:
        done = subprocess.run([dot_program, "-Tsvg"], input=text.encode("utf-8"), capture_output=True, check=False)
    except OSError as exc:
        raise CliError(f"cannot run {dot_program}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        reason = _one_line(done.stderr.decode("utf-8", "replace")) if done.stderr.strip() else f"exit {done.returncode}"
        raise CliError(f"`dot -Tsvg` failed: {reason}")
    return done.stdout


@command(
    "cast",
    "write a copy of a program computing in float64 (every float32 var and dtype attr widened)",
    arg("program", metavar="P.pb", help="a serialized ProgramDesc (main or startup)"),
    arg("--float64", action="store_true", required=True, help="the precision to widen to (the only one so far)"),
    arg("-o", "--output", required=True, metavar="OUT.pb", help="the float64 program"),
)
def cast_command(args: argparse.Namespace) -> int:
    from transpiler.ir.precision import as_float64

    write_output(args.output, as_float64(load_program(args.program)).to_bytes())
    return EXIT_OK


# The inputs and options `transpile` and `plan` share (DESIGN.md's CLI contract).
TRANSPILE_ARGS = (
    arg("program", metavar="MAIN", help="the training program (with optimizer ops): a file (.pb, .pdmodel, any name), "
        "or a folder holding main.pb + startup.pb, main.pdmodel + startup.pdmodel, or main/__model__ + startup/__model__"),
    arg("--startup", metavar="S.pb", help="its startup program (default: startup.pb, or startup.pdmodel, beside MAIN)"),
    arg("--pservers", required=True, metavar="EP,EP..",
        help="pserver endpoints, host:port, comma-separated (a list here; `launch --pservers` takes a count)"),
    arg("--trainers", required=True, type=int, metavar="N", help="number of trainers"),
    arg("--trainer-id", type=int, default=0, metavar="I", help="this trainer's id, 0..N-1 (default 0)"),
    arg("--async", dest="async_mode", action="store_true", help="asynchronous training (no barriers)"),
    arg("--runtime-split", action="store_true", help="async only: send/recv split vars at run time"),
    arg("--no-slice", action="store_true", help="keep every var whole (one block each)"),
    arg("--split-method", default="round_robin", metavar="M",
        help="block placement: round_robin (default), hash_name or balanced"),
    arg("--min-block-size", type=int, default=8192, metavar="N", help="smallest block, in elements (default 8192)"),
    arg("--partitioner", default=None, metavar="NAME|module:Class",
        help="how params are cut into row x column partitions: paddle (default: slicing + --split-method), "
             "angel, column, plan (the cost model's search: docs/planner.md), or a Partitioner subclass module:Class "
             "(docs/partitioners.md)"),
    arg("--pserver-memory", metavar="SIZE",
        help="--partitioner plan: each pserver's memory cap, e.g. 8GiB, 512MiB (params, optimizer state, grad "
             "buffers; docs/planner.md)"),
    arg("--pserver-cores", type=int, metavar="N",
        help="--partitioner plan: the CPU cores the pservers share, when fewer than one each (e.g. all pservers "
             "on one 2-core host): the plan then minimises their total time over N as well (docs/planner.md)"),
    arg("--colocate", action="append", default=[], metavar="A,B..",
        help="--partitioner plan: keep these params together (cut alike, partition i of each on one pserver); "
             "repeatable"),
    arg("--id-sample", metavar="[NAME=]FILE",
        help="ids a sparse param or table is looked up with (.npy, or text: integers, a line per sample): its "
             "access frequencies for the cost report and --partitioner plan"),
    arg("--batch-size", type=int, default=128, metavar="N",
        help="samples per trainer step, for the ids looked up per step (default 128; times the ids per sample of "
             "a 2-D --id-sample)"),
    arg("--rates", metavar="RATES.json",
        help="the machine's rates from `pstranspile calibrate` (default: built-in rates, docs/planner.md)"),
    arg("--random-seed", type=int, default=0, metavar="S",
        help="Paddle's program.random_seed, which shuffles unsliced round-robin placement (default 0, "
             "Paddle's default; a saved program does not carry it)"),
    arg("--float64", action="store_true", help="transpile a float64 copy of the programs (see `cast`)"),
    arg("--clip-mode", choices=("trainer", "exact"),
        help="where gradient clips run: exact (the default in sync mode: on the pservers, on the averaged grad, a "
             "global norm summed across them) or trainer (each trainer clips its own grad, Paddle 1.8's way; "
             "the default with --async)"),
)


# A folder given as MAIN: the (main, startup) names looked for in it, in this order.
FOLDER_PROGRAMS = (("main.pb", "startup.pb"), ("main.pdmodel", "startup.pdmodel"),
                   ("main/__model__", "startup/__model__"))


def main_and_startup(main_arg: str, startup_arg: str | None) -> tuple[Program, Program]:
    """Load MAIN first (a missing one is named as such), then its startup program: `--startup`,
    else the one beside MAIN (`startup.pb`; `startup.pdmodel` beside a `.pdmodel`) or in
    MAIN's folder (`FOLDER_PROGRAMS`)."""
    given = Path(main_arg)
    if not given.exists():
        raise CliError(f"MAIN {main_arg}: no such file or folder")
    if given.is_dir():
        found = next(((given / m, given / s) for m, s in FOLDER_PROGRAMS if (given / m).is_file()), None)
        if found is None and (given / "__model__").is_file():
            found = (given / "__model__", None)
        if found is None:
            names = ", ".join(m for m, _ in FOLDER_PROGRAMS)
            raise CliError(f"MAIN {main_arg} is a folder holding none of {names}, __model__")
        main_path, beside = found
    else:
        main_path = given
        beside = given.with_name("startup.pdmodel" if given.suffix == ".pdmodel" else "startup.pb")
    main = load_program(main_path, "MAIN")
    if startup_arg is not None:
        return main, load_program(startup_arg, "--startup")
    if beside is None or not beside.exists():
        where = f"no {beside}" if beside is not None else f"no startup program in {main_arg}"
        raise CliError(f"no --startup given and {where}: pass the startup program with --startup")
    return main, load_program(beside, "startup")


def check_pserver_list(value: str) -> None:
    """`transpile/plan --pservers` takes endpoints: a count gets a "did you mean"."""
    text = value.strip()
    if text.isdigit():
        n = int(text)
        example = ",".join(f"127.0.0.1:{6170 + i}" for i in range(min(max(n, 1), 3))) + (",..." if n > 3 else "")
        raise UsageError(f"--pservers takes the pservers' endpoints here, not a count: did you mean "
                         f"--pservers {example}? (`launch --pservers {text}` is the one that takes a count)")


def _load_inputs(args: argparse.Namespace) -> tuple[Program, Program]:
    main, startup = main_and_startup(args.program, args.startup)
    check_pserver_list(args.pservers)
    if args.float64:
        from transpiler.ir.precision import as_float64

        main, startup = as_float64(main), as_float64(startup)
    return main, startup


def _transpile(args: argparse.Namespace, inputs: tuple[Program, Program] | None = None, trainer_id: int | None = None,
               **extra):
    from transpiler.api import transpile
    from transpiler.config import DistributeTranspilerConfig

    main, startup = inputs if inputs is not None else _load_inputs(args)
    config = DistributeTranspilerConfig()
    config.runtime_split_send_recv = args.runtime_split
    return transpile(
        main,
        startup,
        pservers=args.pservers,
        trainers=args.trainers,
        trainer_id=args.trainer_id if trainer_id is None else trainer_id,
        sync_mode=not args.async_mode,
        slice_var_up=not args.no_slice,
        split_method=args.split_method,
        min_block_size=args.min_block_size,
        random_seed=args.random_seed,
        partitioner=_partitioner(args),
        clip_mode=args.clip_mode,
        config=config,
        **extra,
    )


def _cost_inputs(args: argparse.Namespace):
    """(rates, the id sample or None, its param name or None) of `--rates` / `--id-sample`,
    read once per run."""
    cached = getattr(args, "_cost_inputs", None)
    if cached is not None:
        return cached
    from transpiler.cost import load_rates, read_id_sample

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    sample, name = None, None
    if args.id_sample:
        spec = args.id_sample
        if "=" in spec and not Path(spec).exists():
            name, _, spec = spec.partition("=")
        sample = read_id_sample(spec)
    args._cost_inputs = (load_rates(args.rates), sample, name)
    return args._cost_inputs


def _partitioner(args: argparse.Namespace):
    """`--partitioner` as given, or for `plan` a `PlanPartitioner` with the cap, the
    colocation groups, the rates and the id sample."""
    planned = (args.partitioner or "").strip().lower() == "plan"
    if not planned:
        if args.pserver_memory or args.colocate or args.pserver_cores is not None:
            raise UsageError("--pserver-memory, --pserver-cores and --colocate belong to --partitioner plan")
        return args.partitioner
    from transpiler.cost import parse_bytes
    from transpiler.planner import PlanPartitioner

    rates, sample, name = _cost_inputs(args)
    groups = []
    for text in args.colocate:
        group = [n.strip() for n in text.split(",") if n.strip()]
        if len(group) < 2:
            raise UsageError(f"--colocate {text!r}: name two params or more, comma-separated")
        groups.append(group)
    return PlanPartitioner(memory_cap=parse_bytes(args.pserver_memory) if args.pserver_memory else None,
                           colocate=groups, rates=rates, id_samples={name: sample} if sample is not None else None,
                           batch_size=args.batch_size, cores=args.pserver_cores)


@command(
    "transpile",
    "rewrite a program into trainer and pserver programs (writes DIR/trainer.pb, pserver_*.pb, plan.json)",
    *TRANSPILE_ARGS,
    arg("-o", "--output", required=True, metavar="DIR", help="directory for the programs (created; files replaced)"),
    arg("--format", dest="form", choices=("pb", "paddle", "fluid18"), default="pb",
        help="file names: pb (trainer.pb, the default), paddle (Paddle 2.x's trainer.pdmodel) or fluid18 "
             "(Fluid 1.8's trainer/__model__, a folder per program); the bytes are the same"),
    arg("--paddle-names", dest="form", action="store_const", const="paddle", help="the same as --format paddle"),
    arg("--all-trainers", action="store_true",
        help="write every trainer's programs, trainer_<id>.pb and trainer_<id>_startup.pb, in one run "
             "(instead of --trainer-id's trainer.pb)"),
    arg("--dump-dir", metavar="D", help="also write the text dump of every program after every pass into D"),
    arg("--verify-each-pass", action="store_true", help="run the verifier after every pass (always after the last)"),
    arg("--progress", action="store_true", help="print each pass and its time on stderr"),
    arg("--json", action="store_true", help="print what was written as JSON (schema pstranspile.transpile/1)"),
    quick_exit=True,
)
def transpile_command(args: argparse.Namespace) -> int:
    import time

    from transpiler.output import write_programs

    started = time.perf_counter()

    def progress(name: str, seconds: float) -> None:
        print(f"{PROG}: pass {name}: {seconds:.2f}s", file=sys.stderr)

    if (args.id_sample or args.rates) and (args.partitioner or "").strip().lower() != "plan":
        raise UsageError("--id-sample and --rates feed the cost model: give them to `plan`, or with --partitioner plan")
    if args.all_trainers and args.dump_dir:
        raise UsageError("--dump-dir shows one trainer's passes: give --trainer-id instead of --all-trainers")
    inputs = _load_inputs(args)
    ids = list(range(args.trainers)) if args.all_trainers else [args.trainer_id]
    # As a process's command (`run`) this runs with the cyclic GC off (`quick_exit`);
    # `transpile()` pauses it by itself in any caller.
    result = None
    trainers = {}  # id -> its two programs (the pservers' are the same for every id: kept once)
    for i in ids:
        one = _transpile(args, inputs, trainer_id=i, verify=args.verify_each_pass, dump_dir=args.dump_dir,
                         progress=progress if args.progress and not _OUTPUT["quiet"] else None)
        result = result or one
        trainers[i] = (one.trainer, one.trainer_startup)
    assert result is not None
    try:
        written = write_programs(args.output, result.trainer, result.trainer_startup, result.pservers, result.plan,
                                 form=args.form, trainers=trainers if args.all_trainers else None)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    plan = result.plan
    seconds = time.perf_counter() - started
    if args.json:
        _print_json({
            "schema": TRANSPILE_SCHEMA,
            "output": str(args.output),
            "format": args.form,
            "files": [str(path) for path in written],
            "trainers": args.trainers,
            "trainer_ids": ids,
            "pservers": list(plan.endpoints),
            "params": len(plan.params),
            "blocks": sum(len(p.blocks) for p in plan.params),
            "imbalance": round(plan.imbalance(), 6),
            "seconds": round(seconds, 3),
        })
        return EXIT_OK
    for path in written:
        print(path)
    print(f"{len(plan.params)} params in {sum(len(p.blocks) for p in plan.params)} blocks on "
          f"{len(plan.endpoints)} pservers, imbalance {plan.imbalance():.3f}, {seconds:.2f}s")
    return EXIT_OK


TRANSPILE_SCHEMA = "pstranspile.transpile/1"


@command(
    "plan",
    "print where every block would live: per pserver blocks, elements, bytes, share; per var its blocks",
    *TRANSPILE_ARGS,
    arg("--json", action="store_true",
        help="print plan.json instead, with a `cost` key holding every figure of the cost report"),
    arg("--svg", metavar="FILE",
        help="also draw the plan: each large param's grid of partitions, coloured by pserver, and per pserver "
             "bars of its memory by kind and its estimated time per step"),
)
def plan_command(args: argparse.Namespace) -> int:
    import json

    from transpiler.cost_report import format_costs, id_stats_for, plan_and_cost_svg, plan_cost_data, uniform_stats
    from transpiler.plan import format_plan, plan_svg

    result = _transpile(args)
    plan = result.plan
    rates, sample, name = _cost_inputs(args)
    ids = uniform_stats(plan, args.batch_size)
    if sample is not None:
        ids.update(id_stats_for(plan, sample, None, args.batch_size, name))
    data = plan_cost_data(result, rates, ids)
    if args.svg:
        write_output(args.svg, plan_and_cost_svg(plan_svg(plan), data).encode())
    if args.json:
        out = plan.to_json()
        out["cost"] = data
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
    else:
        _print_lines((format_plan(plan) + format_costs(data)).splitlines())
    return EXIT_OK


@command(
    "calibrate",
    "measure this machine for the cost model (a real pserver's CPU per request, var, optimize block, sparse "
    "row and byte; us per element of each optimizer op) and write the rates as JSON for `plan --rates` "
    "(under a minute)",
    arg("-o", "--output", required=True, metavar="RATES.json", help="where to write the rates"),
)
def calibrate_command(args: argparse.Namespace) -> int:
    import json

    from transpiler.calibrate import calibrate

    def say(text: str) -> None:
        if not _OUTPUT["quiet"]:
            print(f"{PROG}: {text}", file=sys.stderr)

    rates = calibrate(say)
    write_output(args.output, (json.dumps(rates.to_json(), indent=1) + "\n").encode())
    print(f"{args.output}: {rates.bandwidth / 1e6:,.0f} MB/s, {rates.rpc_us:.0f} us per RPC, adam "
          f"{rates.op('adam'):.4f} us per element ({rates.source})")
    return EXIT_OK


@command(
    "serve",
    "run one pserver: its startup program, then its main program, until every trainer completed "
    "(exit 1 if a trainer vanished or failed)",
    arg("--program", required=True, metavar="P.pb", help="the pserver's main program (pserver_<host>_<port>.pb)"),
    arg("--startup", required=True, metavar="S.pb", help="the pserver's startup program"),
    arg("--endpoint", metavar="HOST:PORT", help="listen here (default: the program's endpoint; the port must match)"),
    arg("--timeout", type=float, metavar="S",
        help="give up on a trainer silent this long (default $PSTRANSPILE_RPC_TIMEOUT, else 120)"),
    arg("--seed", type=int, default=0, metavar="N", help="executor seed for the startup's initializers (default 0)"),
    arg("--token-file", metavar="FILE",
        help="the job token every RPC must carry (default $PSTRANSPILE_JOB_TOKEN, else $PSTRANSPILE_JOB_TOKEN_FILE)"),
    arg("--insecure", action="store_true",
        help="without a job token, listen beyond loopback anyway (anyone who reaches the port controls the job)"),
    arg("--tls-cert", metavar="PEM", help="serve TLS with this certificate (default $PSTRANSPILE_TLS_CERT)"),
    arg("--tls-key", metavar="PEM", help="the certificate's private key (default $PSTRANSPILE_TLS_KEY)"),
    arg("--tls-ca", metavar="PEM", help="require client certificates signed by this CA (default $PSTRANSPILE_TLS_CA)"),
    arg("--plan", metavar="PLAN.json",
        help="the job's plan.json: trainers transpiled with another plan are refused (the handshake); "
             "needed by the three options below"),
    arg("--checkpoint-dir", metavar="DIR", help="checkpoint notices write here, and nowhere else (default: refused); "
        "with {pserver} in it, pserver i's own dir ({pserver}=i)"),
    arg("--keep-checkpoints", type=int, default=3, metavar="K", help="keep the newest K complete checkpoints (default 3)"),
    arg("--restore", metavar="DIR", help="start from DIR's newest complete checkpoint (any pserver count took it); "
        "with {pserver} in DIR: from this pserver's own dir only, at the step trainer 0 agrees (the same pserver count)"),
    arg("--init", metavar="DIR", help="warm start from LoDTensor files of whole vars (fetch, save_persistables)"),
    arg("--refuse-nonfinite", action="store_true", default=None,
        help="refuse grads holding a NaN or an Inf (INVALID_ARGUMENT; default $PSTRANSPILE_REFUSE_NONFINITE, else off)"),
)
def serve_command(args: argparse.Namespace) -> int:
    from ops.rpc.auth import ServerAuth, Tls, read_plan
    from ops.rpc.env_choice import EnvChoiceError, check_env_choices
    from ops.rpc.errors import BindError, PserverError
    from ops.rpc.serve import check_endpoint, listen_op_endpoint, serve_program

    try:
        check_env_choices()
    except EnvChoiceError as exc:
        raise UsageError(str(exc)) from None
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    tls_flags = (args.tls_cert, args.tls_key, args.tls_ca)
    tls = Tls(*(Path(p) if p else None for p in tls_flags)) if any(tls_flags) else None
    auth = ServerAuth.from_env(token_file=args.token_file, tls=tls, insecure=args.insecure, warn=warn)
    if auth.tls is not None:
        auth.tls.server_credentials()  # a missing or unreadable file: a usage error now, not after the startup program
    plan_text, fingerprint = read_plan(args.plan) if args.plan else (None, None)
    if args.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if args.restore and args.init:
        raise UsageError("--restore and --init exclude each other")
    if (args.checkpoint_dir or args.restore or args.init) and not args.plan:
        raise UsageError("--checkpoint-dir, --restore and --init need --plan plan.json")
    main, startup = load_program(args.program), load_program(args.startup)
    planned = listen_op_endpoint(main)
    auth.check_listen(check_endpoint(main, args.endpoint) or planned, planned)  # refused before the startup runs
    try:
        serve_program(main, startup, endpoint=args.endpoint, timeout=args.timeout, seed=args.seed, auth=auth,
                      plan_fingerprint=fingerprint, plan_text=plan_text, checkpoint_dir=_path(args.checkpoint_dir),
                      keep=args.keep_checkpoints, restore=_path(args.restore), init=_path(args.init),
                      refuse_nonfinite=args.refuse_nonfinite)
    except BindError:
        raise  # a user error (the port is taken): exit 2
    except PserverError as exc:  # the job failed at run time: exit 1
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_JOB_FAILED
    return EXIT_OK


@command(
    "launch",
    "run M pservers and N trainers of one command, on this machine or on a Ray cluster (--backend ray), "
    "with Paddle's environment (TRAINING_ROLE, PADDLE_*); exit 1 if the job fails",
    arg("--pservers", required=True, metavar="M",
        help="how many pservers (a count here; where they listen: --endpoints or free ports on --host)"),
    arg("--trainers", required=True, type=int, metavar="N", help="how many trainers"),
    arg("--async", dest="async_mode", action="store_true", help="asynchronous training (PSTRANSPILE_SYNC_MODE=0)"),
    arg("--partitioner", metavar="NAME|module:Class",
        help="every process's partitioner (PSTRANSPILE_PARTITIONER): paddle, angel, column, plan or module:Class"),
    arg("--host", default="127.0.0.1", help="where the pservers listen (default 127.0.0.1)"),
    arg("--endpoints", metavar="EP,EP..", help="the pservers' endpoints (default: free ports on --host)"),
    arg("--log-dir", default="logs", metavar="DIR", help="one log per process, DIR/<role>.<i>.log (default ./logs)"),
    arg("--timeout", type=float, default=120.0, metavar="S",
        help="seconds a pserver waits for a silent trainer (PSTRANSPILE_RPC_TIMEOUT; default 120)"),
    arg("--exit-grace", type=float, default=30.0, metavar="S",
        help="how long pservers may run on after every trainer finished (default 30)"),
    arg("--status-every", type=float, default=2.0, metavar="S", help="seconds between live progress lines (default 2)"),
    arg("--checkpoint-dir", metavar="DIR", help="every process gets DIR as its checkpoint dir "
        "(PSTRANSPILE_CHECKPOINT_DIR; on Ray, storage every node shares); {pserver} in DIR: one dir per "
        "pserver, the job manifest where {pserver}=job"),
    arg("--checkpoint-every", type=int, default=0, metavar="N",
        help="trainer 0 asks for a checkpoint every N steps (PSTRANSPILE_CHECKPOINT_EVERY; default: the script's)"),
    arg("--max-restarts", type=int, default=0, metavar="K",
        help="restart a failed job, every process, from the newest checkpoint in --checkpoint-dir, up to K times"),
    arg("--tls-cert", metavar="PEM", help="every process's TLS certificate (PSTRANSPILE_TLS_CERT): pservers serve with it, "
        "trainers present it to a pserver that asks (--tls-ca)"),
    arg("--tls-key", metavar="PEM", help="its private key (PSTRANSPILE_TLS_KEY)"),
    arg("--tls-ca", metavar="PEM", help="the CA both sides verify the other against (PSTRANSPILE_TLS_CA): "
        "pservers then require client certificates"),
    arg("--backend", choices=("local", "ray"), default="local",
        help="where the processes run: children of this command (local, the default) or Ray actors (ray)"),
    arg("--address", metavar="ADDR", help="ray: the cluster to join (its GCS host:port, or auto; "
        "default: start a local Ray instance on 127.0.0.1)"),
    arg("--placement", choices=("spread", "pack"), default="spread",
        help="ray: spread the processes' bundles over nodes (default) or pack them"),
    arg("--cpus-per-process", type=float, default=1.0, metavar="C", help="ray: CPUs in each process's bundle (default 1)"),
    arg("--json", action="store_true", help="print the job's result as JSON on stdout (schema pstranspile.launch/1); "
        "the live status and summary stay on stderr"),
    arg("--tensorboard", metavar="DIR", help="also write the job's metrics as TensorBoard event files into DIR "
        "(needs tensorboardX, the `tensorboard` extra); LOG_DIR/metrics.jsonl is written anyway"),
    arg("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command every process runs"),
)
def launch_command(args: argparse.Namespace) -> int:
    from transpiler.config import split_endpoint_list
    from transpiler.runtime.launch import LaunchConfig, launch
    from transpiler.partition import PSERVER_CORES_ENV
    from transpiler.runtime.role import PARTITIONER_ENV

    args.pservers = pserver_count(args.pservers, args.endpoints)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("launch needs the command to run after `--` (e.g. `-- python3 train.py`)")
    for flag, value in (("--timeout", args.timeout), ("--exit-grace", args.exit_grace),
                        ("--status-every", args.status_every)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value:g}")
    endpoints = split_endpoint_list(args.endpoints) if args.endpoints is not None else None
    if args.backend == "ray" and (endpoints is not None or args.host != "127.0.0.1"):
        raise UsageError("--backend ray places the pservers itself: --endpoints and --host are for the local backend")
    if args.address is not None and args.backend != "ray":
        raise UsageError("--address is for --backend ray")
    if args.max_restarts < 0 or args.checkpoint_every < 0:
        raise UsageError("--max-restarts and --checkpoint-every must be >= 0")
    if (args.max_restarts or args.checkpoint_every) and not args.checkpoint_dir:
        raise UsageError("--max-restarts and --checkpoint-every need --checkpoint-dir")
    if not args.cpus_per_process > 0:
        raise UsageError(f"--cpus-per-process must be positive, got {args.cpus_per_process:g}")
    env = {**_launch_tls_env(args), **({PARTITIONER_ENV: args.partitioner} if args.partitioner else {})}
    cores = os.cpu_count() or 1
    if ((args.partitioner or "").strip().lower() == "plan" and args.backend == "local"
            and PSERVER_CORES_ENV not in os.environ and cores < args.pservers):
        env[PSERVER_CORES_ENV] = str(cores)  # every process on this host: the plan counts the cores they share
    result = launch(
        LaunchConfig(
            command=tuple(command),
            pservers=args.pservers,
            trainers=args.trainers,
            sync_mode=not args.async_mode,
            host=args.host,
            endpoints=endpoints,
            env=env,
            log_dir=Path(args.log_dir),
            rpc_timeout=args.timeout,
            exit_grace=args.exit_grace,
            status_every=float("inf") if _OUTPUT["quiet"] else args.status_every,
            checkpoint_dir=_path(args.checkpoint_dir),
            checkpoint_every=args.checkpoint_every,
            max_restarts=args.max_restarts,
            backend=args.backend,
            address=args.address,
            placement=args.placement,
            cpus_per_process=args.cpus_per_process,
            tensorboard_dir=_path(args.tensorboard),
        )
    )
    if args.json:
        _print_json(launch_json(result, Path(args.log_dir)))
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if result.ok else EXIT_JOB_FAILED


LAUNCH_SCHEMA = "pstranspile.launch/1"


def pserver_count(value: str, endpoints: str | None) -> int:
    """`launch --pservers` takes a count; endpoints there get a "did you mean"."""
    text = value.strip()
    try:
        count = int(text)
    except ValueError:
        if ":" in text:
            n = len([ep for ep in text.split(",") if ep.strip()])
            hint = f"--pservers {n} --endpoints {text}" if endpoints is None else f"--pservers {n}"
            raise UsageError(f"launch --pservers takes a count, not endpoints: did you mean {hint}?") from None
        raise UsageError(f"--pservers must be a count (an integer >= 1), got {value!r}") from None
    if count < 1:
        raise UsageError(f"--pservers must be >= 1, got {count}")
    return count


def launch_json(result: Any, log_dir: Path) -> dict[str, Any]:
    """`launch --json`'s document (schema `pstranspile.launch/1`, docs/cli.md)."""
    from transpiler.runtime.metrics import METRICS_FILE

    metrics = log_dir / METRICS_FILE
    return {
        "schema": LAUNCH_SCHEMA,
        "ok": result.ok,
        "failure": result.failure,
        "interrupted": result.interrupted,
        "backend": result.backend,
        "sync_mode": result.sync_mode,
        "pservers": result.pserver_count,
        "trainers": result.trainer_count,
        "seconds": round(result.seconds, 3),
        "restarts": list(result.restarts),
        "log_dir": str(log_dir),
        "metrics": str(metrics) if metrics.exists() else None,
        "processes": [
            {
                "name": p.name,
                "role": p.role,
                "index": p.index,
                "endpoint": p.endpoint,
                "node": p.node,
                "exit": p.exit_text,
                "returncode": p.returncode,
                "steps": p.progress.step if p.progress else None,
                "loss": p.progress.loss if p.progress else None,
                "steps_per_s": p.progress.steps_per_s if p.progress else None,
                "seconds": round(p.seconds, 3),
                "log": str(p.log),
            }
            for p in result.processes
        ],
    }


def _launch_tls_env(args: argparse.Namespace) -> dict[str, str]:
    """`launch --tls-*` as the environment every process reads (absolute paths: a process's
    working directory may differ); files that cannot work are a usage error now, before any
    process starts."""
    from ops.rpc.auth import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, Tls

    flags = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(flags):
        return {}
    tls = Tls(*(Path(p).resolve() if p else None for p in flags))
    tls.server_credentials()  # reads and pairs them: AuthError, exit 2
    return {key: str(path) for key, path in zip((TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV), (tls.cert, tls.key, tls.ca),
                                                strict=True) if path is not None}


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None


@command(
    "fetch",
    "read whole params out of a job, from its running pservers (--endpoints/--plan) or from a "
    "checkpoint (--checkpoint), and write one Fluid LoDTensor file per var into DIR",
    arg("--plan", metavar="PLAN.json", help="the job's plan.json (with a running job)"),
    arg("--endpoints", metavar="EP,EP..", help="the pservers, when they listen elsewhere than the plan says"),
    arg("--checkpoint", metavar="DIR", help="a checkpoint dir (its newest complete checkpoint) or ckpt-<step> folder"),
    arg("--vars", metavar="NAME,NAME..", help="only these (default: every param and the table; from a checkpoint, "
        "every var it holds)"),
    arg("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for the pservers (default 60)"),
    arg("-o", "--output", required=True, metavar="DIR", help="where to write the files (all or nothing)"),
    arg("--json", action="store_true", help="print what was written as JSON (schema pstranspile.fetch/1)"),
)
def fetch_command(args: argparse.Namespace) -> int:
    import json

    from ops.rpc.client import RpcClient
    from ops.rpc.errors import RpcError
    from ops.rpc.fetch import from_checkpoint, pull, write_vars

    names = [n for n in args.vars.split(",") if n] if args.vars else None
    if bool(args.checkpoint) == bool(args.plan):
        raise UsageError("give --plan (a running job) or --checkpoint (a checkpoint), one of them")
    if args.checkpoint:
        step, arrays = from_checkpoint(Path(args.checkpoint), names)
        where = f"checkpoint step {step}"
        source: dict[str, Any] = {"kind": "checkpoint", "path": args.checkpoint, "step": step}
    else:
        try:
            plan = json.loads(_read_text(args.plan))
        except ValueError as exc:
            raise CliError(f"{args.plan}: not a plan.json ({exc})") from None
        if args.endpoints:
            given = [ep.strip() for ep in args.endpoints.split(",") if ep.strip()]
            if len(given) != len(plan["endpoints"]):
                raise UsageError(f"--endpoints names {len(given)} pservers, the plan {len(plan['endpoints'])}")
            _move_endpoints(plan, dict(zip(plan["endpoints"], given, strict=True)))
        client = RpcClient(0, timeout=args.timeout)
        try:
            arrays = pull(client, plan, names)
        except RpcError as exc:
            raise CliError(str(exc)) from None
        finally:
            client.close()
        where = f"{len(plan['endpoints'])} pserver(s)"
        source = {"kind": "pservers", "plan": args.plan, "endpoints": list(plan["endpoints"])}
    written = write_vars(Path(args.output), arrays)
    total = sum(a.nbytes for a in arrays.values())
    if args.json:
        files = {Path(path).name: str(path) for path in written}
        _print_json({
            "schema": FETCH_SCHEMA,
            "output": str(args.output),
            "source": source,
            "bytes": total,
            "vars": [{"name": name, "dtype": str(array.dtype), "shape": list(array.shape), "bytes": array.nbytes,
                      "file": files.get(name)} for name, array in sorted(arrays.items())],
        })
        return EXIT_OK
    print(f"{args.output}: {len(written)} var(s), {total:,} bytes, from {where}")
    _print_lines(f"  {name}  {array.dtype}{list(array.shape)}" for name, array in sorted(arrays.items()))
    return EXIT_OK


FETCH_SCHEMA = "pstranspile.fetch/1"


def _move_endpoints(plan: dict[str, Any], moved: dict[str, str]) -> None:
    """Rewrite a plan's endpoints (the pservers listen elsewhere than when it was made)."""
    plan["endpoints"] = [moved[ep] for ep in plan["endpoints"]]
    for param in plan.get("params", []):
        for block in param["blocks"]:
            block["endpoint"] = moved[block["endpoint"]]
    if plan.get("table"):
        plan["table"]["endpoints"] = [moved[ep] for ep in plan["table"]["endpoints"]]


@command(
    "merge-table",
    "rebuild one dense table from the shards the pservers saved (checkpoint_notify), or from the piece files "
    "a checkpoint holds of a table cut by a partitioner (with --plan); rows no file holds were never touched "
    "and are written as --fill",
    arg("shards", nargs="+", metavar="SHARD", help="shard files (DIR/<table>_<i>), one per pserver; or every piece "
        "file of a partitioned table (ckpt-<step>/ps<i>/<table>.block<k>; <piece>@POOL files are skipped)"),
    arg("-o", "--output", required=True, metavar="TABLE", help="where to write the table"),
    arg("--format", choices=("lodtensor", "npy"), help="Fluid's LoDTensor file (what load_persistables reads; the "
        "default) or numpy .npy (the default when TABLE ends in .npy)"),
    arg("--height", type=int, metavar="N", help="the table's rows (default: --plan's, else the largest id + 1)"),
    arg("--plan", metavar="PLAN.json", help="the job's plan.json (or a checkpoint's MANIFEST.json): the table's "
        "height, and each piece's rows x columns (needed for pieces)"),
    arg("--fill", type=float, default=0.0, metavar="X", help="value of rows no shard holds (default 0)"),
)
def merge_table_command(args: argparse.Namespace) -> int:
    import json

    from ops.rpc.table_io import (
        TableFileError, is_piece_file, merge_pieces, merge_shards, plan_of, read_shard, write_table,
    )
    from ops.rpc.tensor_file import write_tensor

    if args.height is not None and args.height < 1:
        raise UsageError(f"--height must be >= 1, got {args.height}")
    plan = None
    if args.plan is not None:
        try:
            plan = plan_of(json.loads(Path(args.plan).read_text()), args.plan)
        except (OSError, ValueError) as exc:
            raise CliError(f"{args.plan}: not a plan.json ({getattr(exc, 'strerror', None) or exc})") from None
        except TableFileError as exc:
            raise CliError(str(exc)) from None
    pools = [p for p in args.shards if Path(p).name.endswith("@POOL")]
    files = [p for p in args.shards if p not in pools]
    pieces = [p for p in files if is_piece_file(Path(p))]
    if pools and not pieces:
        raise CliError(f"{pools[0]}: a piece's unused preallocated rows (@POOL), not a table shard or piece")
    try:
        if pieces:
            if len(pieces) != len(files):
                shard = next(p for p in files if p not in pieces)
                raise CliError(f"{shard} is not a piece of a partitioned table like {pieces[0]}: merge one kind at a time")
            if plan is None:
                raise CliError(f"{pieces[0]} is a piece of a table cut by a partitioner: pass --plan PLAN.json (the "
                               "job's plan, or the checkpoint's MANIFEST.json) to say where each piece goes")
            name, merged = merge_pieces([Path(p) for p in files], plan, fill=args.fill)
            height = merged.table.shape[0]
            if args.height is not None and args.height != height:
                raise CliError(f"--height {args.height}, but {name} in {args.plan} has {height} rows")
        else:
            height = args.height
            if height is None and plan is not None:
                planned = plan.get("table")
                if not isinstance(planned, dict) or not planned.get("shape"):
                    raise CliError(f"{args.plan}: the plan has no distributed table sharded id % M (a table cut by a "
                                   "partitioner: pass its piece files)")
                height = int(planned["shape"][0])
            merged = merge_shards([read_shard(Path(p)) for p in files], height=height, fill=args.fill)
    except TableFileError as exc:
        raise CliError(str(exc)) from None
    form = args.format or ("npy" if args.output.endswith(".npy") else "lodtensor")
    try:
        if form == "npy":
            write_table(Path(args.output), merged.table)
        else:
            write_tensor(Path(args.output), merged.table)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    table = merged.table
    rows = table.shape[0]
    source = f"{len(files)} piece(s) of {name}" if pieces else f"{len(files)} shard(s)"
    print(fit_line(f"{args.output}: {rows:,} x {' x '.join(str(d) for d in table.shape[1:]) or '1'} {table.dtype} "
                   f"({form}) from {source}:"))
    for path, n in zip(files, merged.per_shard, strict=True):  # a line per file: short however many
        print(fit_line(f"  {path}: {n:,} rows"))
    if pools:
        print(f"skipped {len(pools)} @POOL file(s) (the pieces' unused preallocated rows)")
    print(f"{merged.from_shards:,} rows from the {'pieces' if pieces else 'shards'}, {rows - merged.from_shards:,} "
          f"never touched (written as {args.fill:g}){'' if height is not None else '; height = the largest id + 1'}")
    return EXIT_OK


@command(
    "report",
    "summarize a run's metrics (RUN_DIR/metrics.jsonl, which launch writes) per trainer and pserver, and draw "
    "loss, throughput, RPC traffic and pserver CPU (PNG or SVG; needs matplotlib, the `plot` extra)",
    arg("run_dir", metavar="RUN_DIR", help="launch's --log-dir (or a metrics .jsonl file)"),
    arg("-o", "--output", metavar="OUT", help="the picture, .png or .svg (default: RUN_DIR/report.png; "
        "without matplotlib only the summary is printed)"),
    arg("--no-plot", action="store_true", help="print the summary only"),
    arg("--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard event files into DIR "
        "(needs tensorboardX, the `tensorboard` extra)"),
    arg("--json", action="store_true", help="print the summary as JSON (schema pstranspile.report/1)"),
)
def report_command(args: argparse.Namespace) -> int:
    from transpiler.runtime.metrics import MetricsFileError, metrics_path, read_metrics
    from transpiler.runtime.report import PLOT_SUFFIXES, PlotUnavailable, draw, summarize, summary_lines

    if args.output and args.no_plot:
        raise UsageError("--output and --no-plot exclude each other")
    if args.output and Path(args.output).suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"cannot tell the picture format of {args.output!r}: name it .png or .svg")
    try:
        source = metrics_path(args.run_dir)
        records = read_metrics(source)
    except MetricsFileError as exc:
        raise CliError(str(exc)) from None
    if not records:
        raise CliError(f"{source}: no records yet (no trainer reported a step)")
    summary = summarize(records)
    if args.tensorboard:
        from transpiler.runtime.metrics import TensorBoard

        board = TensorBoard(args.tensorboard)  # TensorBoardUnavailable: exit 2
        try:
            for record in records:
                board.add(record)
        finally:
            board.close()
    picture = None
    if not args.no_plot:
        target = Path(args.output) if args.output else source.with_name("report.png")
        try:
            picture = draw(records, target, title=f"Training run: {source.parent}")
        except PlotUnavailable as exc:
            if args.output:
                raise CliError(str(exc)) from None
            warn(f"{exc}; printing the summary only")
        except OSError as exc:
            raise CliError(f"cannot write {target}: {exc.strerror or exc}") from None
    if args.json:
        _print_json({**summary, "metrics": str(source), "picture": str(picture) if picture else None})
        return EXIT_OK
    _print_lines(summary_lines(summary))
    if picture is not None:
        print(f"picture: {picture}")
    return EXIT_OK


# The one place subcommands are registered, in the order `--help` lists them.
COMMANDS: tuple[Command, ...] = (
    dump_command, diff_command, graph_command, cast_command, transpile_command, plan_command, calibrate_command,
    serve_command, launch_command, fetch_command, merge_table_command, report_command,
)


# ------------------------------------------------------------------ entry


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    """The argparse tree: one subparser per entry of `COMMANDS` (or of `commands`)."""
    commands = COMMANDS if commands is None else commands
    parser = _Parser(prog=PROG, description="Inspect and transpile Fluid ProgramDesc programs.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in commands:
        child = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for spec in cmd.args:
            child.add_argument(*spec.flags, **spec.options)
        for spec in COMMON_ARGS:
            child.add_argument(*spec.flags, **spec.options)
        child.set_defaults(run=cmd.run, quick_exit=cmd.quick_exit)
    return parser


# Options every command takes (after its name).
COMMON_ARGS = (
    arg("-q", "--quiet", action="store_true",
        help="no warnings about the input programs (e.g. repeated attrs), no progress or live status lines"),
    arg("--full", action="store_true",
        help=f"print long lines whole (default: at most about {MAX_WIDTH} characters, lists cut to "
             "'... and N more', long dump lines continued on indented lines)"),
)


def _complete(parser: argparse.ArgumentParser) -> None:
    """Shell completion through argcomplete (the `completion` extra), only when a shell asks
    for it (argcomplete sets `_ARGCOMPLETE`): the CLI never needs it and never pays for it."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 different (diff) or job failed (serve,
    launch), 2 error, 3 internal error, 130 interrupted)."""
    return _main(argv, exiting=None)


def run() -> NoReturn:
    """The process's entry point (`pstranspile`, `python -m transpiler`): `main`, then exit.

    After a `quick_exit` command (`transpile`) the interpreter's teardown is skipped
    (`os._exit` once the output is flushed): the command's files are written and closed, and
    the teardown would only free, one by one and after a full garbage collection, the
    hundreds of thousands of objects the programs are made of (about 40 ms on ResNet-50).
    Such a command also runs without the cyclic GC, which would find nothing to free."""
    exiting: list[bool] = []
    code = _main(None, exiting=exiting)
    if exiting:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os._exit(code)
    sys.exit(code)


def _main(argv: Sequence[str] | None, *, exiting: list[bool] | None) -> int:
    """`main`; when `exiting` is a list (the process ends after this), a `quick_exit`
    command appends True to it and runs with the GC off."""
    try:
        return _run_command(argv, exiting=exiting)
    finally:
        _OUTPUT.update(quiet=False, full=False)  # a caller's next `main` starts afresh


def _run_command(argv: Sequence[str] | None, *, exiting: list[bool] | None) -> int:
    parser = build_parser()
    _OUTPUT.update(quiet=False, full=False)
    try:
        _complete(parser)
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        _OUTPUT.update(quiet=args.quiet, full=args.full)
        if exiting is not None and args.quick_exit:
            import gc

            gc.disable()  # for good: the process ends after the command
            exiting.append(True)
        return args.run(args)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except VerifyError as exc:
        return _fail(exc.headline)
    except (PsTranspilerError, UsageError, CliError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: say so in one line, keep the traceback for who asks
        if os.environ.get("PSTRANSPILE_TRACEBACK"):
            raise
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {_one_line(str(exc))} "
            "(a bug; PSTRANSPILE_TRACEBACK=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _fail(message: str) -> int:
    print(fit_line(f"{PROG}: error: {_one_line(message)}"), file=sys.stderr)
    return EXIT_ERROR


def _broken_pipe() -> int:
    """`pstranspile dump P.pb | head`: stop quietly, as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    run()
