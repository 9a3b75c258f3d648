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
    Recoverable("gpt_adam_3ps_sync", 2, "Paddle 2.6, GPT decoder: dropout, layer_norm, matmul_v2, Adam"),
    Recoverable("mlp_clip_global_sgd_3ps", 2, "Paddle 2.6, global-norm clip: the pservers' norm exchange"),
    Recoverable("resnet_small_momentum_3ps_sync", 2, "Paddle 2.6, small ResNet: conv2d, batch norm (trainer 0's moving stats)"),
    Recoverable("mlp_lamb_3ps", 2, "Paddle 2.6, LAMB on sliced params (exact norms)"),
    Recoverable("cond_sgd_2ps", 2, "Paddle 2.6, paddle.static.nn.cond"),
    Recoverable("lstm_sgd_2ps", 2, "Paddle 2.6, paddle.nn.LSTM: the rnn op, coalesced weights"),
    Recoverable("bert_small_adam_3ps_sync", 2, "Paddle 2.6, small BERT encoder: dropout, gelu, layer_norm, Adam"),
)
BY_NAME = {r.case: r for r in RECOVERABLE}


def command(fixture: Recoverable, out: Path, steps: int, *extra: str, float64: bool = False) -> tuple[str, ...]:
    return (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(fixture.folder / "main.pb"),
            "--startup", str(fixture.folder / "startup.pb"), "--loss", fixture.loss, "--steps", str(steps),
            "--batch", "8", "--save", str(out / "params"), *(("--float64",) if float64 else ()), *extra)


def run_job(fixture: Recoverable, out: Path, steps: int, every: int, *extra: str, float64: bool = False,
            max_restarts: int = 0, checkpoint_dir: Path | str | None = None, pservers: int | None = None,
            sync_mode: bool = True, wrap: tuple[str, ...] = ()) -> LaunchResult:
    """One `launch` of the fixture with checkpoints every `every` steps into `out/ckpt`
    (or `checkpoint_dir`), restarting up to `max_restarts` times; the output in
    `out/launch.txt`. `wrap`: a command prefix every process runs under (isolation)."""
    out.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(command=(*wrap, *command(fixture, out, steps, *extra, float64=float64)),
                          pservers=pservers or fixture.pservers, sync_mode=sync_mode,
                          trainers=fixture.trainers, env=ONE_THREAD, log_dir=out / "logs", rpc_timeout=60.0,
                          status_every=60.0, stop_grace=2.0, exit_grace=30.0,
                          checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else out / "ckpt",
                          checkpoint_every=every, max_restarts=max_restarts)
    with open(out / "launch.txt", "w") as text:
        return launch(config, out=text)


_REFERENCES: dict[tuple[str, int, int, bool], Path] = {}


def reference_run(tmp_path_factory, fixture: Recoverable, steps: int, every: int, *, float64: bool = False) -> Path:
    """The folder of an uninterrupted `run_job` of the fixture (its `ckpt/` and `params/`),
    run once per test session (per xdist worker) and shared by every test that compares
    with it: a job is deterministic, so the same arguments give the same bits. Read it,
    never write into it."""
    key = (fixture.case, steps, every, float64)
    if key not in _REFERENCES:
        out = tmp_path_factory.mktemp(f"reference-{fixture.case}-{steps}-{every}-{'f64' if float64 else 'f32'}")
        result = run_job(fixture, out, steps, every, float64=float64)
        assert result.ok, log_of(result, out)
        _REFERENCES[key] = out
    return _REFERENCES[key]


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


# ------------------------------------------------------------------ chaos


@dataclass(frozen=True)
class ChaosRun:
    """One seeded chaos run: the fixture, the kills (`--chaos` specs) and what happened."""

    fixture: str
    kills: tuple[str, ...]
    ok: bool = False
    restarts: tuple[str, ...] = ()  # the checkpoints the restarts started from ("" for the start)
    identical: bool = False
    differing: tuple[str, ...] = ()

    def line(self) -> str:
        mid = landed_mid_checkpoint(self.kills, self.restarts)
        landed = f" ({sum(mid)} of {len(mid)} checkpoint kill(s) before the checkpoint completed)" if mid else ""
        verdict = "bit-identical" if self.identical else f"DIFFERENT: {', '.join(self.differing)}" if self.ok else "FAILED"
        return (f"{self.fixture}: kill -9 {' then '.join(self.kills)}; restarts from "
                f"{', '.join(r or 'the start' for r in self.restarts) or '-'}{landed}: {verdict}")


CHAOS_FIXTURES = ("mlp_adam_2ps", "ctr_v1_dist_sgd_2ps", "fluid18_lr_exp_decay_2ps", "ctr_v1_sparse_sgd_2ps",
                  "seed_fc3_sgd_3ps", "fluid18_ctr_dist_sgd_2ps")


def draw_kills(rng: np.random.Generator, fixture: Recoverable, steps: int, every: int) -> tuple[str, ...]:
    """Two kills in one job at distinct steps: one of a pserver and one of a trainer (which
    of each, which first, drawn); one of the two during a checkpoint's write (0-30 ms after
    trainer 0 starts asking for the checkpoint of a checkpoint step), the other before a
    step (1..steps-1)."""
    whos = [f"pserver:{int(rng.integers(fixture.pservers))}", f"trainer:{int(rng.integers(fixture.trainers))}"]
    rng.shuffle(whos)
    during = int(rng.integers(2))  # which of the two kills lands in a checkpoint
    while True:
        steps_drawn = [int(rng.choice(range(every, steps + 1, every))) if i == during else int(rng.integers(1, steps))
                       for i in range(2)]
        if steps_drawn[0] != steps_drawn[1]:
            break
    kills = [f"{step}:{who}:ckpt:{int(rng.integers(0, 31))}" if i == during else f"{step}:{who}"
             for i, (step, who) in enumerate(zip(steps_drawn, whos, strict=True))]
    return tuple(sorted(kills, key=lambda k: int(k.split(":")[0])))


def landed_mid_checkpoint(kills: tuple[str, ...], origins: tuple[str, ...]) -> list[bool]:
    """Per kill during a checkpoint: True when the job restarted from an older checkpoint
    (the kill landed before that checkpoint was complete), False when it was complete.
    Unknown (left out) when two kills landed in one attempt (one restart for both)."""
    if len(origins) != len(kills):
        return []
    return [origin != f"ckpt-{kill.split(':')[0]}" for kill, origin in zip(kills, origins, strict=True)
            if ":ckpt:" in kill]


def restart_origins(out: Path) -> tuple[str, ...]:
    """The checkpoint each restart started from, by `launch`'s output."""
    origins = []
    for line in (out / "launch.txt").read_text().splitlines():
        if line.startswith("launch: restart ") and ", from " in line:
            where = line.split(", from ", 1)[1]
            origins.append(where.split()[1] if where.startswith("checkpoint ") else "")
    return tuple(origins)
