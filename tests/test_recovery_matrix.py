"""Save -> kill -9 -> restore over every Paddle-built fixture our runtime trains
(`recovery_support.RECOVERABLE`: dense, sparse, distributed table; SGD and Adam; lr decay
on the pservers; Paddle 2.6 programs with 0-d vars and Fluid 1.8 ones), float32 and
float64: a job killed mid-run and restarted by `launch --max-restarts` from its last
checkpoint ends with every param AND every optimizer accumulator, learning rate, decay
counter and table row bit-identical to an uninterrupted run of the same steps (both
runs' final checkpoints compared var by var, and trainer 0's params).

Each case kills one process (a pserver, or trainer 1, in turn over the cases) before
step 3 of 6 (checkpoints every 2 steps): the restart restores step 2 and trains 4 more.
"""

from __future__ import annotations

import numpy as np
import pytest
from recovery_support import BY_NAME, RECOVERABLE, differing, final_state, log_of, reference_run, run_job, trainer_finals

STEPS, EVERY, KILL_AT = 6, 2, 3
# float64 everywhere (the chaos test's dtype); float32 on the Paddle 2.6 programs (0-d
# learning rate, Adam's accumulators, both table kinds) and one Fluid 1.8 program.
FLOAT32 = ("mlp_adam_2ps", "ctr_v1_sparse_sgd_2ps", "ctr_v1_dist_sgd_2ps", "fluid18_lr_exp_decay_2ps", "gpt_adam_3ps_sync")
CASES = [(r.case, True) for r in RECOVERABLE] + [(name, False) for name in FLOAT32]


def victim(case: str) -> str:
    """A pserver (the last) or trainer 1, alternating over the fixtures; trainer 0 when the
    fixture runs with one trainer (it is the one that kills: it kills itself)."""
    fixture = BY_NAME[case]
    if [r.case for r in RECOVERABLE].index(case) % 2 == 0:
        return f"pserver:{fixture.pservers - 1}"
    return "trainer:1" if fixture.trainers > 1 else "trainer:0"


@pytest.mark.parametrize(("case", "float64"), CASES, ids=[f"{c}-{'f64' if f else 'f32'}" for c, f in CASES])
def test_a_killed_job_restored_from_its_checkpoint_is_bit_identical(tmp_path, tmp_path_factory, case, float64):
    fixture = BY_NAME[case]
    reference = reference_run(tmp_path_factory, fixture, STEPS, EVERY, float64=float64)
    who = victim(case)
    killed = run_job(fixture, tmp_path / "killed", STEPS, EVERY, "--chaos", f"{KILL_AT}:{who}",
                     "--pid-dir", str(tmp_path / "pids"), float64=float64, max_restarts=1)
    assert killed.ok and len(killed.restarts) == 1, log_of(killed, tmp_path / "killed")
    # Trainer 0 kills before its step 3; a killed trainer 1 may already have sent its step-3 grads and
    # barrier (sync: the round then completes without it, and ckpt-4 with it), so ckpt-4 is a valid origin.
    origins = ("from checkpoint ckpt-2",) + (("from checkpoint ckpt-4",) if who == "trainer:1" else ())
    text = (tmp_path / "killed" / "launch.txt").read_text()
    assert "SIGKILL" in killed.restarts[0] and any(origin in text for origin in origins), text
    step, want = final_state(reference / "ckpt")
    again, got = final_state(tmp_path / "killed" / "ckpt")
    assert step == again == STEPS and want
    assert not differing(want, got), f"{case}: kill -9 {who} before step {KILL_AT}: {differing(want, got)} differ"
    assert {a.dtype.name for a in want.values() if a.dtype.kind == "f"} == {"float64" if float64 else "float32"}
    params = trainer_finals(reference)
    assert params and not differing(params, trainer_finals(tmp_path / "killed"))


def test_per_pserver_dirs_recover_reshard_and_fetch_bit_identical(tmp_path, tmp_path_factory):
    """`--checkpoint-dir 'disk{pserver}/ckpt'`: each pserver writes its part to its own
    dir, trainer 0 the job manifest to `diskjob/ckpt`. A kill -9 and a restart from
    there, a restore of an earlier checkpoint onto 3 pservers (reshard from parts in two
    dirs), and `pstranspile fetch` of the template all give the uninterrupted run's state."""
    from transpiler.cli import main as cli_main
    from ops.rpc.tensor_file import read_tensor

    fixture = BY_NAME["mlp_adam_2ps"]
    _, want = final_state(reference_run(tmp_path_factory, fixture, STEPS, EVERY, float64=True) / "ckpt")
    template = tmp_path / "disk{pserver}" / "ckpt"
    killed = run_job(fixture, tmp_path / "killed", STEPS, EVERY, "--chaos", f"{KILL_AT}:pserver:0",
                     "--pid-dir", str(tmp_path / "pids"), float64=True, max_restarts=1, checkpoint_dir=template)
    assert killed.ok and len(killed.restarts) == 1, log_of(killed, tmp_path / "killed")
    for i in range(2):
        assert (tmp_path / f"disk{i}" / "ckpt" / "ckpt-6" / f"ps{i}" / "PART.json").is_file()
    assert not differing(want, final_state(template)[1])
    resharded = run_job(fixture, tmp_path / "resharded", STEPS, EVERY, "--restore",
                        str(tmp_path / "diskjob" / "ckpt" / "ckpt-4"), float64=True, pservers=3,
                        checkpoint_dir=tmp_path / "three{pserver}")
    assert resharded.ok, log_of(resharded, tmp_path / "resharded")
    step, got = final_state(tmp_path / "three{pserver}")
    assert step == STEPS and not differing(want, got)
    assert cli_main(["fetch", "--checkpoint", str(template), "-o", str(tmp_path / "fetched")]) == 0
    assert {p.name for p in (tmp_path / "fetched").iterdir()} == set(want)
    for name, value in want.items():
        fetched = read_tensor(tmp_path / "fetched" / name)
        assert fetched.shape == value.shape and fetched.tobytes() == value.tobytes(), name


def test_per_pserver_dirs_restore_trainer_0s_moving_stats_bit_identical(tmp_path, tmp_path_factory):
    """A `{pserver}` template restores trainer 0's own state (batch norm's moving mean and
    variance, which no pserver holds) as a shared dir does: trainer 0 reads it from its own
    job dir at the agreed step and relays it through the pservers to the other trainers.
    The small ResNet killed (trainer 1) and restored ends with trainer 0's moving stats,
    params and every pserver var bit-identical to an uninterrupted run; trainer 1 restarts
    from trainer 0's stats of the restored checkpoint."""
    from ops.rpc.tensor_file import read_tensor

    fixture = BY_NAME["resnet_small_momentum_3ps_sync"]
    reference = reference_run(tmp_path_factory, fixture, STEPS, EVERY, float64=True)
    template = tmp_path / "disk{pserver}" / "ckpt"
    killed = run_job(fixture, tmp_path / "killed", STEPS, EVERY, "--chaos", f"{KILL_AT}:trainer:1",
                     "--pid-dir", str(tmp_path / "pids"), float64=True, max_restarts=1, checkpoint_dir=template)
    assert killed.ok and len(killed.restarts) == 1, log_of(killed, tmp_path / "killed")
    params = trainer_finals(reference)
    _, want = final_state(reference / "ckpt")
    moving = sorted(set(params) - set(want))  # the params no pserver holds: the batch norms' moving stats
    assert len(moving) >= 2 and all(n.startswith("batch_norm") for n in moving), moving
    got = trainer_finals(tmp_path / "killed")
    assert not differing(params, got), differing(params, got)
    startup = np.load(reference / "params" / "trainer_0.npz")
    assert all(params[n].tobytes() != startup[f"init/{n}"].tobytes() for n in moving)  # the stats moved
    assert not differing(want, final_state(template)[1])
    restored = next(line.split(", from checkpoint ", 1)[1].split()[0] for line in
                    (tmp_path / "killed" / "launch.txt").read_text().splitlines() if ", from checkpoint " in line)
    relayed = np.load(tmp_path / "killed" / "params" / "trainer_1.npz")
    state = tmp_path / "diskjob" / "ckpt" / restored / "trainer0"
    for name in moving:
        assert relayed[f"init/{name}"].tobytes() == read_tensor(state / name).tobytes(), name


def test_an_async_checkpoint_records_each_pservers_updates_and_restores(tmp_path):
    """Async mode: no step is common to the pservers; each part is its pserver's state
    between whole updates, and the manifest records how many grads each had applied."""
    import json

    from ops.rpc.checkpoint import find_latest

    fixture = BY_NAME["mlp_adam_2ps"]
    job = run_job(fixture, tmp_path / "async", STEPS, EVERY, sync_mode=False)
    assert job.ok, log_of(job, tmp_path / "async")
    folder = find_latest(tmp_path / "async" / "ckpt")
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert manifest["step"] == STEPS and sorted(manifest["states"]) == ["ps0", "ps1"]
    for part, state in manifest["states"].items():
        assert state["mode"] == "async" and 0 < state["updates"], (part, state)
    earlier = json.loads((folder.parent / f"ckpt-{STEPS - EVERY}" / "MANIFEST.json").read_text())
    assert all(earlier["states"][p]["updates"] <= manifest["states"][p]["updates"] for p in ("ps0", "ps1"))
    resumed = run_job(fixture, tmp_path / "resumed", STEPS + EVERY, EVERY, "--restore", str(tmp_path / "async" / "ckpt"),
                      sync_mode=False)
    assert resumed.ok, log_of(resumed, tmp_path / "resumed")
    step, state = final_state(tmp_path / "resumed" / "ckpt")
    assert step == STEPS + EVERY and set(state) == set(final_state(tmp_path / "async" / "ckpt")[1])


def test_a_sync_trainer_pulls_the_distributed_table_through_per_pserver_dirs(tmp_path):
    """`Session.pull` of a table in sync mode goes through a checkpoint of the trainer's
    step: with a `{pserver}` template, trainer 0 writes its job manifest and reads the
    parts from the pservers' own dirs."""
    from ops.rpc.tensor_file import read_tensor

    fixture = BY_NAME["ctr_v1_dist_sgd_2ps"]
    template = tmp_path / "disk{pserver}"
    job = run_job(fixture, tmp_path / "job", 4, EVERY, "--pull-to", str(tmp_path / "pulled"), checkpoint_dir=template)
    assert job.ok, log_of(job, tmp_path / "job")
    step, state = final_state(template)
    table = read_tensor(tmp_path / "pulled" / "emb")
    assert step == 4 and table.shape == state["emb"].shape and np.abs(table).sum() > 0
    assert table.tobytes() == state["emb"].tobytes()
    job = (tmp_path / "diskjob" / "ckpt-4" / "MANIFEST.json").read_text()
    for i in range(2):  # each pserver keeps a copy of the job manifest beside its part (sent over RPC)
        assert (tmp_path / f"disk{i}" / "ckpt-4" / "MANIFEST.json").read_text() == job
