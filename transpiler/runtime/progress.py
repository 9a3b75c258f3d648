"""The progress line trainers print and `pstranspile launch` reads:

    [progress] trainer=0 step=40 loss=0.512345 steps/s=31.2

One line per report on stdout, `key=value` fields; readable in a log and parsable.
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


def format_progress(progress: Progress) -> str:
    fields = [f"trainer={progress.who}", f"step={progress.step}"]
    if progress.loss is not None:
        fields.append(f"loss={progress.loss:.6g}")
    if progress.steps_per_s is not None:
        fields.append(f"steps/s={progress.steps_per_s:.3g}")
    return f"{PREFIX} {' '.join(fields)}"


def parse_progress(line: str) -> Progress | None:
    """The report a line carries, or None for any other line."""
    match = _LINE.match(line.strip())
    if not match:
        return None
    fields = dict(item.split("=", 1) for item in match.group(1).split())
    try:
        return Progress(
            who=fields.get("trainer", "?"),
            step=int(fields["step"]),
            loss=float(fields["loss"]) if "loss" in fields else None,
            steps_per_s=float(fields["steps/s"]) if "steps/s" in fields else None,
        )
    except (KeyError, ValueError):
        return None
