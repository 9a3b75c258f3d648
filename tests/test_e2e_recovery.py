"""The recovery proof: a sync job killed with SIGKILL (a pserver or a trainer, at a
random step) and restarted from its last complete checkpoint ends with parameters
bit-identical to an uninterrupted run of the same steps.

The MLP (Adam, params sliced over the pservers), 2 pservers x 2 trainers, 12 steps,
a checkpoint every 2 steps (`examples/train_program.py --checkpoint-every 2`). Two
cycles: a pserver, then a trainer, is the victim, at a step K drawn (seeded, so a
failure repeats); trainer 0 SIGKILLs it after K steps, before step K+1 (`--kill-at-step`,
0-based), `launch` stops the rest of the job, and the job restarts with `--restore` (from
scratch when no checkpoint was complete yet): the first cycle onto 3 pservers (the
checkpoint is cut by the new plan), the second onto 2. `pytest -s` prints each. The
Paddle-built fixtures' kill/restore proofs (tables, every optimizer, float32 and float64,
`launch --max-restarts`) are `tests/test_recovery_matrix.py`'s.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from e2e_support import EXAMPLES, ONE_THREAD, launch_ok, save

from ops.rpc.checkpoint import find_latest, read_manifest
from ops.rpc.fetch import write_vars
from ops.rpc.tensor_file import read_tensor
from transpiler.runtime.launch import LaunchConfig, launch

STEPS, EVERY, BATCH = 12, 2, 16
CYCLES = 2  # a pserver killed and the job restored onto 3 pservers; a trainer killed, restored onto 2
sys.path.insert(0, str(EXAMPLES))


def command(main_pb, startup_pb, out, *extra, steps=STEPS):
    return (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
            "--loss", "mean_0.tmp_0", "--steps", str(steps), "--batch", str(BATCH), "--save", str(out), *extra)


def finals(folder):
    saved = np.load(folder / "trainer_0.npz")
    return {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}


def test_a_job_killed_at_random_steps_and_restored_ends_bit_identical(tmp_path):
    import mlp

    main_pb, startup_pb = save(tmp_path, *mlp.build())
    launch_ok(tmp_path / "reference", command(main_pb, startup_pb, tmp_path / "reference" / "params",
                                              "--pull-to", str(tmp_path / "pulled")),
              pservers=2, trainers=2, sync_mode=True, timeout=60.0)
    reference = finals(tmp_path / "reference" / "params")
    for name, value in reference.items():  # Session.pull: the same params, as Fluid LoDTensor files
        assert np.array_equal(read_tensor(tmp_path / "pulled" / name), value), name

    rng = np.random.default_rng(14)
    started = time.monotonic()
    for cycles in range(CYCLES):
        run = tmp_path / f"cycle{cycles}"
        victim = f"{('pserver', 'trainer')[cycles % 2]}:{int(rng.integers(2))}"  # the roles alternate
        step = int(rng.integers(1, STEPS))
        checkpoints = ("--checkpoint-dir", str(run / "ckpt"), "--checkpoint-every", str(EVERY))
        config = LaunchConfig(
            command=command(main_pb, startup_pb, run / "killed", *checkpoints, "--kill-at-step", str(step),
                            "--kill", victim, "--pid-dir", str(run / "pids")),
            pservers=2, trainers=2, env=ONE_THREAD, log_dir=run / "logs-killed", rpc_timeout=60.0,
            status_every=60.0, stop_grace=2.0)
        run.mkdir(parents=True)
        with open(run / "killed.txt", "w") as out:
            killed = launch(config, out=out)
        assert not killed.ok and any(p.returncode == -9 for p in killed.processes), killed.summary()
        latest = find_latest(run / "ckpt", missing_ok=True)
        resumed = int(read_manifest(latest)["step"]) if latest is not None else 0
        assert resumed == step // EVERY * EVERY, (step, resumed)  # `step` steps ran: the last checkpoint of those
        pservers = 3 if cycles % 2 == 0 else 2
        restore = ("--restore", str(run / "ckpt")) if latest is not None else ()
        launch_ok(run / "restored", command(main_pb, startup_pb, run / "restored" / "params", *checkpoints, *restore),
                  pservers=pservers, trainers=2, sync_mode=True, timeout=60.0)
        final = finals(run / "restored" / "params")
        assert final.keys() == reference.keys()
        for name, value in reference.items():
            assert final[name].dtype == value.dtype and np.array_equal(final[name], value), (
                f"cycle {cycles}: {victim} killed before step {step}, restored at {resumed} onto {pservers} "
                f"pservers: {name} differs by {np.abs(final[name] - value).max():.3g}")
        print(f"cycle {cycles}: kill -9 {victim} before step {step}; restored from step {resumed} onto "
              f"{pservers} pservers; {len(reference)} params bit-identical")
    print(f"{CYCLES} cycles in {time.monotonic() - started:.1f} s, every one bit-identical")


def test_a_warm_start_begins_from_the_given_values_cut_by_the_plan(tmp_path):
    """`--warm-start DIR` (LoDTensor files of whole vars): the pservers start from them
    (vars without a file keep their initialisers), and the trainers receive them."""
    import mlp

    main_pb, startup_pb = save(tmp_path, *mlp.build())
    rng = np.random.default_rng(3)
    given = {"h1.w": rng.standard_normal((784, 256)).astype(np.float32), "out.b": np.arange(10, dtype=np.float32)}
    write_vars(tmp_path / "given", given)
    launch_ok(tmp_path / "job", command(main_pb, startup_pb, tmp_path / "params", "--warm-start", str(tmp_path / "given")),
              pservers=3, trainers=2, sync_mode=True, timeout=60.0)
    saved = np.load(tmp_path / "params" / "trainer_0.npz")
    for name, value in given.items():
        assert np.array_equal(saved[f"init/{name}"], value), name
    assert np.abs(saved["init/h2.w"]).max() > 0  # initialised as usual


def test_a_distributed_table_job_killed_and_restored_ends_bit_identical_table_included(tmp_path):
    """The CTR program (a 1000 x 16 distributed table, auto-grown on the pservers), 2
    pservers x 1 trainer: pserver 1 is killed before step 5, the job restarts from step 4,
    and the dense params and every row of the table (pulled whole at the end through a
    checkpoint, `Session.pull`) equal an uninterrupted run's. One trainer: with two, the
    order in which their prefetches first touch an id decides which preallocated row it
    gets, so even two uninterrupted runs differ in the table's untrained rows."""
    import train_ctr

    main_pb, startup_pb = save(tmp_path, *train_ctr.build_ctr("distributed", 1000))

    def job(name, *extra, ok=True):
        args = command(main_pb, startup_pb, tmp_path / name / "params", "--checkpoint-dir", str(tmp_path / name / "ckpt"),
                       *extra, steps=8)
        if ok:
            return launch_ok(tmp_path / name, args, pservers=2, trainers=1, sync_mode=True, timeout=60.0)
        config = LaunchConfig(command=args, pservers=2, trainers=1, env=ONE_THREAD, log_dir=tmp_path / name / "logs",
                              rpc_timeout=60.0, status_every=60.0, stop_grace=2.0)
        with open(tmp_path / f"{name}.txt", "w") as out:
            return launch(config, out=out)

    job("reference", "--pull-to", str(tmp_path / "reference" / "pulled"))
    killed = job("run", "--checkpoint-every", "2", "--kill-at-step", "5", "--kill", "pserver:1",
                 "--pid-dir", str(tmp_path / "pids"), ok=False)
    assert not killed.ok and read_manifest(find_latest(tmp_path / "run" / "ckpt"))["step"] == 4
    job("run", "--checkpoint-every", "2", "--restore", str(tmp_path / "run" / "ckpt"),
        "--pull-to", str(tmp_path / "run" / "pulled"))
    reference, restored = finals(tmp_path / "reference" / "params"), finals(tmp_path / "run" / "params")
    assert reference.keys() == restored.keys() and reference
    for name, value in reference.items():
        assert np.array_equal(restored[name], value), name
    table, again = read_tensor(tmp_path / "reference" / "pulled" / "emb"), read_tensor(tmp_path / "run" / "pulled" / "emb")
    assert table.shape == (1000, 16) and np.abs(table).sum() > 0 and np.array_equal(table, again)
