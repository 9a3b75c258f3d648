"""Helpers the recovery tests share (no tests here): train a Paddle-built fixture under
`pstranspile launch` (restarts, checkpoints, scheduled kills), and read every var of a
job's final checkpoint (params, optimizer accumulators, learning rate, table) to compare
two runs bit for bit.

`RECOVERABLE` is the parametrization point of the save -> kill -> restore matrix and
the chaos test: every fixture our runtime trains today, with how to run it. A fixture
whose kernels land later (ResNet-50, BERT) is one more entry here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conftest import PADDLE_PROGRAMS
from e2e_support import EXAMPLES, ONE_THREAD
from ops.rpc.checkpoint import CheckpointReader, find_latest
from transpiler.runtime.launch import LaunchConfig, LaunchResult, launch


@dataclass(frozen=True)
class Recoverable:
    """A fixture the recovery tests train: its case folder, the trainers to run it with
    (one where a distributed table's row placement depends on the order the trainers'
    prefetches arrive), and what it exercises."""

    case: str
    trainers: int
    what: str

    @property
    def folder(self) -> Path:
        return PADDLE_PROGRAMS / self.case

    @property
    def pservers(self) -> int:
        return len(json.loads((self.folder / "case.json").read_text())["pservers"].split(","))

    @property
    def loss(self) -> str:
        return json.loads((self.folder / "case.json").read_text()).get("loss", "mean_0.tmp_0")


RECOVERABLE = (
    Recoverable("mlp_adam_2ps", 2, "Paddle 2.6, Adam, params sliced, 0-d learning rate"),
    Recoverable("seed_fc3_sgd_3ps", 2, "Paddle 2.6, SGD, 3 pservers"),
    Recoverable("ctr_v1_sparse_sgd_2ps", 2, "Paddle 2.6, sparse embedding (SelectedRows grads), SGD"),
    Recoverable("ctr_v1_dist_sgd_2ps", 1, "Paddle 2.6, distributed lookup table, SGD"),
    Recoverable("fluid18_basic_sgd_2ps", 2, "Fluid 1.8, SGD"),
    Recoverable("fluid18_ctr_dist_sgd_2ps", 1, "Fluid 1.8, distributed lookup table, SGD"),
    Recoverable("fluid18_lr_exp_decay_2ps", 2, "Fluid 1.8, exponential lr decay on the pservers"),
    Recoverable("fluid18_lr_piecewise_2ps", 2, "Fluid 1.8, piecewise lr decay on the pservers"),
)
BY_NAME = {r.case: r for r in RECOVERABLE}


def command(fixture: Recoverable, out: Path, steps: int, *extra: str, float64: bool = False) -> tuple[str, ...]:
    return (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(fixture.folder / "main.pb"),
            "--startup", str(fixture.folder / "startup.pb"), "--loss", fixture.loss, "--steps", str(steps),
            "--batch", "8", "--save", str(out / "params"), *(("--float64",) if float64 else ()), *extra)


def run_job(fixture: Recoverable, out: Path, steps: int, every: int, *extra: str, float64: bool = False,
            max_restarts: int = 0, checkpoint_dir: Path | str | None = None, pservers: int | None = None) -> LaunchResult:
    """One `launch` of the fixture with checkpoints every `every` steps into `out/ckpt`
    (or `checkpoint_dir`), restarting up to `max_restarts` times; the output in
    `out/launch.txt`."""
    out.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(command=command(fixture, out, steps, *extra, float64=float64),
                          pservers=pservers or fixture.pservers,
                          trainers=fixture.trainers, env=ONE_THREAD, log_dir=out / "logs", rpc_timeout=60.0,
                          status_every=60.0, stop_grace=2.0, exit_grace=30.0,
                          checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else out / "ckpt",
                          checkpoint_every=every, max_restarts=max_restarts)
    with open(out / "launch.txt", "w") as text:
        return launch(config, out=text)


def final_state(checkpoint_dir: Path) -> tuple[int, dict[str, np.ndarray]]:
    """(step, every whole var) of the newest complete checkpoint: params, optimizer
    accumulators, learning rates and counters, the distributed table (dense by id)."""
    reader = CheckpointReader(find_latest(checkpoint_dir))
    return reader.step, {name: reader.whole(name) for name in reader.origins()}


def trainer_finals(out: Path) -> dict[str, np.ndarray]:
    saved = np.load(out / "params" / "trainer_0.npz")
    return {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}


def differing(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> list[str]:
    """The vars that are not bit-identical (dtype, shape and every bit)."""
    bad = sorted(set(reference) ^ set(other))
    for name in sorted(set(reference) & set(other)):
        a, b = reference[name], other[name]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            bad.append(name)
    return bad


def log_of(result: LaunchResult, out: Path) -> str:
    return (out / "launch.txt").read_text() + "\n".join(
        f"--- {p.log}\n" + "\n".join(p.tail) for p in result.processes)
