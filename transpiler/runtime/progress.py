"""The progress lines trainers and pservers print and `pstranspile launch` reads:

    [progress] trainer=0 step=40 loss=0.512345 steps/s=31.2 elapsed=1.282 sent=182340 recv=180112
    [progress] pserver=1 cpu_s=12.4 wall_s=20.1

One line per report on stdout, `key=value` fields; readable in a log and parsable. A
trainer's line carries its step, loss, steps/s, the seconds since it started training (its
own clock: the launcher may read lines in batches) and the RPC bytes it sent and received so
far; a pserver's (`Session.serve`, every few seconds) the CPU seconds its process used and
the seconds it has served. `launch` turns both into the job's metrics file
(`transpiler.runtime.metrics`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "[progress]"
_LINE = re.compile(r"^\[progress\]((?:\s+[\w/]+=\S+)+)\s*$")


@dataclass(frozen=True)
class Progress:
    who: str  # "0" for trainer 0, "local" for local training
    step: int
    loss: float | None = None
    steps_per_s: float | None = None
    bytes_sent: int | None = None  # RPC bytes so far (a trainer's; None when local)
    bytes_received: int | None = None
    elapsed: float | None = None  # seconds since the trainer started training, on its own clock


@dataclass(frozen=True)
class Usage:
    """A pserver's use of its machine so far."""

    pserver: int
    cpu_seconds: float
    wall_seconds: float


def format_progress(progress: Progress) -> str:
    fields = [f"trainer={progress.who}", f"step={progress.step}"]
    if progress.loss is not None:
        fields.append(f"loss={progress.loss:.6g}")
    if progress.steps_per_s is not None:
        fields.append(f"steps/s={progress.steps_per_s:.3g}")
    if progress.elapsed is not None:
        fields.append(f"elapsed={progress.elapsed:.3f}")
    if progress.bytes_sent is not None:
        fields.append(f"sent={progress.bytes_sent}")
    if progress.bytes_received is not None:
        fields.append(f"recv={progress.bytes_received}")
    return f"{PREFIX} {' '.join(fields)}"


def format_usage(usage: Usage) -> str:
    return f"{PREFIX} pserver={usage.pserver} cpu_s={usage.cpu_seconds:.3f} wall_s={usage.wall_seconds:.3f}"


def _fields(line: str) -> dict[str, str] | None:
    match = _LINE.match(line.strip())
    if not match:
        return None
    return dict(item.split("=", 1) for item in match.group(1).split())


def parse_progress(line: str) -> Progress | None:
    """The trainer's report a line carries, or None for any other line."""
    fields = _fields(line)
    if fields is None or "pserver" in fields:
        return None
    try:
        return Progress(
            who=fields.get("trainer", "?"),
            step=int(fields["step"]),
            loss=float(fields["loss"]) if "loss" in fields else None,
            steps_per_s=float(fields["steps/s"]) if "steps/s" in fields else None,
            bytes_sent=int(fields["sent"]) if "sent" in fields else None,
            bytes_received=int(fields["recv"]) if "recv" in fields else None,
            elapsed=float(fields["elapsed"]) if "elapsed" in fields else None,
        )
    except (KeyError, ValueError):
        return None


def parse_usage(line: str) -> Usage | None:
    """The pserver's report a line carries, or None for any other line."""
    fields = _fields(line)
    if fields is None or "pserver" not in fields:
        return None
    try:
        return Usage(int(fields["pserver"]), float(fields["cpu_s"]), float(fields["wall_s"]))
    except (KeyError, ValueError):
        return None


def parse_report(line: str) -> Progress | Usage | None:
    """Either report a line carries, or None."""
    return parse_progress(line) or parse_usage(line)
