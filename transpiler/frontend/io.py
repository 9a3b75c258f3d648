"""Writing a built (main, startup) pair to disk, as the examples and users do."""

from __future__ import annotations

from pathlib import Path

from transpiler.fileio import write_bytes_atomic
from transpiler.ir import Program


def save_programs(out_dir: str | Path, main: Program, startup: Program) -> list[Path]:
    """Write `out_dir/main.pb` and `out_dir/startup.pb` atomically; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, program in (("main.pb", main), ("startup.pb", startup)):
        path = out / name
        write_bytes_atomic(path, program.to_bytes())
        written.append(path)
    return written


def report(paths: list[Path]) -> None:
    for path in paths:
        print(f"wrote {path} ({path.stat().st_size} bytes)")
