"""A job's metrics file: JSON lines, one per report of a trainer or a pserver.

`launch` (every backend) writes `LOG_DIR/metrics.jsonl` from the progress lines its
processes print (`transpiler.runtime.progress`); a `Session` given `metrics=PATH` (or
`PSTRANSPILE_METRICS=PATH` in its environment) appends its own reports there, for a job
run by hand or by another scheduler. `pstranspile report RUN_DIR` reads it.

A trainer's record (`loss`, `steps_per_s`, the bytes: null when unknown; `role` is
`local` for local training):

    {"time": 3.21, "attempt": 0, "role": "trainer", "trainer": 1, "step": 40, "loss": 0.51,
     "steps_per_s": 31.2, "elapsed": 1.282, "bytes_sent": 182340, "bytes_received": 180112}

(`elapsed`: seconds since that trainer started training, on its own clock; `time` is when
the launcher read the line, which on Ray comes in batches)

a pserver's (its process's CPU seconds and the seconds it has served, so far; `cpu` is
their ratio, the cores it kept busy on average):

    {"time": 4.02, "attempt": 0, "role": "pserver", "pserver": 0, "cpu_seconds": 1.73,
     "wall_seconds": 3.9, "cpu": 0.444}

`time` is seconds since the job (or the session) started; `attempt` counts restarts
(`launch --max-restarts`).

With a `tensorboard` dir (`launch --tensorboard DIR`, `report --tensorboard DIR`) the
records also go to TensorBoard event files there, through tensorboardX (the `tensorboard`
extra): scalars `trainer_<i>/loss`, `trainer_<i>/steps_per_s`, `trainer_<i>/mb_sent`,
`trainer_<i>/mb_received` by step, and `pserver_<i>/cpu` (cores busy since serving began)
by report.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from transpiler.errors import PsTranspilerError
from transpiler.runtime.progress import Progress, Usage

METRICS_FILE = "metrics.jsonl"
METRICS_ENV = "PSTRANSPILE_METRICS"
SCHEMA_KEYS = {
    "trainer": ("time", "attempt", "role", "trainer", "step", "loss", "steps_per_s", "elapsed", "bytes_sent",
                "bytes_received"),
    "pserver": ("time", "attempt", "role", "pserver", "cpu_seconds", "wall_seconds", "cpu"),
}


def trainer_record(progress: Progress, trainer: int, *, elapsed: float, attempt: int = 0, role: str = "trainer"
                   ) -> dict[str, Any]:
    return {
        "time": round(elapsed, 3),
        "attempt": attempt,
        "role": role,
        "trainer": trainer,
        "step": progress.step,
        "loss": progress.loss,
        "steps_per_s": progress.steps_per_s,
        "elapsed": progress.elapsed,
        "bytes_sent": progress.bytes_sent,
        "bytes_received": progress.bytes_received,
    }


def pserver_record(usage: Usage, *, elapsed: float, attempt: int = 0) -> dict[str, Any]:
    return {
        "time": round(elapsed, 3),
        "attempt": attempt,
        "role": "pserver",
        "pserver": usage.pserver,
        "cpu_seconds": round(usage.cpu_seconds, 3),
        "wall_seconds": round(usage.wall_seconds, 3),
        "cpu": round(usage.cpu_seconds / usage.wall_seconds, 3) if usage.wall_seconds > 0 else None,
    }


class TensorBoardUnavailable(PsTranspilerError):
    """tensorboardX is not installed."""


class TensorBoard:
    """Metrics records as TensorBoard scalars in event files under `log_dir`."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise TensorBoardUnavailable(
                "TensorBoard event files need tensorboardX: pip install 'ps-transpiler[tensorboard]'") from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=2)
        self._pserver_reports: dict[int, int] = {}

    def add(self, record: dict[str, Any]) -> None:
        if record.get("role") == "pserver":
            index = int(record["pserver"])
            count = self._pserver_reports[index] = self._pserver_reports.get(index, 0) + 1
            if record.get("cpu") is not None:
                self._writer.add_scalar(f"pserver_{index}/cpu", record["cpu"], count)
            return
        prefix, step = f"trainer_{record['trainer']}", int(record["step"])
        for key, name, scale in (("loss", "loss", 1.0), ("steps_per_s", "steps_per_s", 1.0),
                                 ("bytes_sent", "mb_sent", 1e-6), ("bytes_received", "mb_received", 1e-6)):
            if record.get(key) is not None:
                self._writer.add_scalar(f"{prefix}/{name}", record[key] * scale, step)

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Appends records to a metrics file, one line each, flushed at once (thread-safe);
    `fresh=True` starts the file anew; with `tensorboard`, each record is also a scalar
    in TensorBoard event files there."""

    def __init__(self, path: str | os.PathLike, *, fresh: bool = False,
                 tensorboard: str | os.PathLike | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._board = TensorBoard(tensorboard) if tensorboard is not None else None
        self._file = open(self.path, "w" if fresh else "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self.started = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(", ", ": ")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()
                if self._board is not None:
                    self._board.add(record)

    def report(self, report: Progress | Usage, *, trainer: int | None = None, attempt: int = 0,
               elapsed: float | None = None, role: str = "trainer") -> None:
        """Write the record of one parsed report (`trainer`: the reporting trainer's id)."""
        elapsed = time.monotonic() - self.started if elapsed is None else elapsed
        if isinstance(report, Usage):
            self.write(pserver_record(report, elapsed=elapsed, attempt=attempt))
        else:
            self.write(trainer_record(report, trainer if trainer is not None else 0, elapsed=elapsed,
                                      attempt=attempt, role=role))

    def close(self) -> None:
        with self._lock:
            self._file.close()
            if self._board is not None:
                self._board.close()
                self._board = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsFileError(ValueError):
    """A metrics file that cannot be read (missing, or a line that is not a record)."""


def metrics_path(run: str | os.PathLike) -> Path:
    """The metrics file of a run: `run` itself (a file), or `run/metrics.jsonl`."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise MetricsFileError(f"{path}: no metrics file (launch writes LOG_DIR/{METRICS_FILE}; a Session "
                               f"writes one given metrics=PATH or {METRICS_ENV})")
    return path


def read_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a run's metrics file, in order (blank lines skipped)."""
    path = metrics_path(run)
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                if number > 1 and not line.endswith("\n"):
                    break  # the last line of a job still writing, or killed mid-line
                raise MetricsFileError(f"{path}:{number}: not a JSON record ({exc})") from None
            if not isinstance(record, dict) or record.get("role") not in ("trainer", "local", "pserver"):
                raise MetricsFileError(f"{path}:{number}: not a metrics record")
            records.append(record)
    return records
