"""`pstranspile report RUN_DIR`: a run's metrics file (`transpiler.runtime.metrics`) as a
summary per trainer and pserver, and a picture: loss and throughput per trainer, the RPC
traffic, and the pservers' CPU.

    summary = summarize(read_metrics("logs"))
    print("\n".join(summary_lines(summary)))
    draw(read_metrics("logs"), "logs/report.png")      # needs matplotlib (the `plot` extra)

Throughput is the trainer's steps per second over a sliding window of its own clock
(`elapsed`; records without it: the launcher's `time`), not the average since its start
that its progress lines carry.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

REPORT_SCHEMA = "pstranspile.report/1"
PLOT_SUFFIXES = (".png", ".svg")
MIN_INTERVAL = 0.2  # seconds: shorter intervals between a pserver's reports are merged into the next


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def _series(records: list[dict[str, Any]]) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    trainers: dict[int, list[dict]] = defaultdict(list)
    pservers: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record.get("role") == "pserver":
            pservers[int(record.get("pserver", 0))].append(record)
        else:
            trainers[int(record.get("trainer", 0))].append(record)
    return dict(sorted(trainers.items())), dict(sorted(pservers.items()))


def clock(rows: list[dict[str, Any]]) -> str:
    """The key to time a trainer's records by: its own `elapsed`, when every record has it."""
    return "elapsed" if rows and all(r.get("elapsed") is not None for r in rows) else "time"


def windowed_rate(rows: list[dict[str, Any]], window: float, key: str = "time") -> list[tuple[float, float]]:
    """(`key`, steps/s over the last `window` seconds) per record, from its `key` and `step`
    (O(n): two pointers); a restart (the step going back) starts the window anew."""
    out: list[tuple[float, float]] = []
    start = 0
    for i, row in enumerate(rows):
        if i and row["step"] < rows[i - 1]["step"]:
            start = i  # a restart from a checkpoint
        while start < i and row[key] - rows[start + 1][key] >= window:
            start += 1
        first = rows[start]
        span = row[key] - first[key]
        if span > 0:
            out.append((row[key], (row["step"] - first["step"]) / span))
    return out


def rate_window(trainers: dict[int, list[dict[str, Any]]]) -> float:
    """The throughput window: a fifteenth of the longest trainer's training time (first to
    last report), at least 0.2 s."""
    spans = [rows[-1][clock(rows)] - rows[0][clock(rows)] for rows in trainers.values() if rows]
    return max(0.2, max(spans, default=0.0) / 15)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's numbers (schema `pstranspile.report/1`)."""
    trainers, pservers = _series(records)
    out: dict[str, Any] = {"schema": REPORT_SCHEMA, "records": len(records),
                           "attempts": 1 + max((int(r.get("attempt", 0)) for r in records), default=0),
                           "seconds": max((float(r["time"]) for r in records), default=0.0),
                           "trainers": [], "pservers": []}
    for trainer, rows in trainers.items():
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        last = rows[-1]
        span = last[clock(rows)] - rows[0][clock(rows)]
        steps = last["step"] - rows[0]["step"]
        out["trainers"].append({
            "trainer": trainer,
            "role": last.get("role", "trainer"),
            "steps": last["step"],
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "min_loss": min(losses) if losses else None,
            "steps_per_s": round(steps / span, 3) if span > 0 and steps > 0 else last.get("steps_per_s"),
            "bytes_sent": last.get("bytes_sent"),
            "bytes_received": last.get("bytes_received"),
        })
    for pserver, rows in pservers.items():
        last = rows[-1]
        out["pservers"].append({
            "pserver": pserver,
            "cpu_seconds": last.get("cpu_seconds"),
            "wall_seconds": last.get("wall_seconds"),
            "cpu": last.get("cpu"),
        })
    return out


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as text: one line per trainer and per pserver."""
    def num(value: Any, form: str = ".4g") -> str:
        return "-" if value is None else format(value, form)

    lines = [f"{summary['records']} records, {len(summary['trainers'])} trainer(s), {len(summary['pservers'])} "
             f"pserver(s), {summary['seconds']:.1f} s" + (f", {summary['attempts']} attempts" if summary["attempts"] > 1
                                                         else "")]
    rows = [("trainer", "steps", "loss first", "loss last", "loss min", "steps/s", "sent", "received")]
    for t in summary["trainers"]:
        rows.append((str(t["trainer"]) if t["role"] != "local" else "local", str(t["steps"]), num(t["first_loss"]),
                     num(t["last_loss"]), num(t["min_loss"]), num(t["steps_per_s"], ".3g"), _bytes(t["bytes_sent"]),
                     _bytes(t["bytes_received"])))
    if summary["pservers"]:
        rows.append(("pserver", "cpu s", "wall s", "cores busy", "", "", "", ""))
        for p in summary["pservers"]:
            rows.append((str(p["pserver"]), num(p["cpu_seconds"], ".2f"), num(p["wall_seconds"], ".2f"),
                         num(p["cpu"], ".2f"), "", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return lines


def draw(records: list[dict[str, Any]], path: str | os.PathLike, *, title: str = "") -> Path:
    """Draw the run into `path` (.png or .svg): loss by step and steps/s over time per
    trainer, RPC megabytes by step, pserver CPU (cores busy) over time. Times are each
    process's own clock (a launcher may read lines in batches, Ray's every poll)."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"cannot tell the picture format of {path}: name it .png or .svg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("drawing needs matplotlib: pip install 'ps-transpiler[plot]'") from None
    trainers, pservers = _series(records)
    window = rate_window(trainers)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=110)
    (ax_loss, ax_rate), (ax_bytes, ax_cpu) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    own_clock = True  # every trainer's throughput on its own clock
    for i, (trainer, rows) in enumerate(trainers.items()):
        color = colors[i % len(colors)]
        label = "local" if rows[-1].get("role") == "local" else f"trainer {trainer}"
        points = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
        if points:
            ax_loss.plot(*zip(*points, strict=True), color=color, label=label, linewidth=1.4)
        key = clock(rows)
        own_clock = own_clock and key == "elapsed"
        rate = windowed_rate(rows, window, key)
        if rate:
            ax_rate.plot(*zip(*rate, strict=True), color=color, label=label, linewidth=1.4)
        sent = [(r["step"], r["bytes_sent"] / 1e6) for r in rows if r.get("bytes_sent") is not None]
        received = [(r["step"], r["bytes_received"] / 1e6) for r in rows if r.get("bytes_received") is not None]
        if sent:
            ax_bytes.plot(*zip(*sent, strict=True), color=color, label=f"{label} sent", linewidth=1.4)
        if received:
            ax_bytes.plot(*zip(*received, strict=True), color=color, linestyle="--", label=f"{label} received",
                          linewidth=1.4)
    for i, (pserver, rows) in enumerate(pservers.items()):
        busy = []  # cores busy over each interval between two reports (the first: since serving began)
        before: dict[str, Any] = {"wall_seconds": 0.0, "cpu_seconds": 0.0, "attempt": rows[0].get("attempt")}
        for after in rows:
            if after.get("attempt") != before.get("attempt"):  # a restarted pserver starts its clock anew
                before = {"wall_seconds": 0.0, "cpu_seconds": 0.0, "attempt": after.get("attempt")}
            wall = after["wall_seconds"] - before["wall_seconds"]
            if wall >= MIN_INTERVAL:  # a last report just after a periodic one: too short to mean anything
                busy.append((after["wall_seconds"], (after["cpu_seconds"] - before["cpu_seconds"]) / wall))
                before = after
        if busy:
            ax_cpu.plot(*zip(*busy, strict=True), color=colors[(i + 3) % len(colors)], label=f"pserver {pserver}",
                        linewidth=1.4, marker="o", markersize=2.5)
    panels = (
        (ax_loss, "Loss", "step", "loss"),
        (ax_rate, f"Throughput ({window:.2g} s window)",
         "seconds of training (each trainer's clock)" if own_clock else "seconds since launch", "steps/s"),
        (ax_bytes, "RPC traffic (cumulative)", "step", "MB"),
        (ax_cpu, "Pserver CPU", "seconds of serving (each pserver's clock)", "cores busy"),
    )
    for ax, name, xlabel, ylabel in panels:
        ax.set_title(name, fontsize=11, loc="left")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax_rate.set_ylim(bottom=0)
    ax_cpu.set_ylim(bottom=0)
    fig.suptitle(title or "Training run", fontsize=13)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
