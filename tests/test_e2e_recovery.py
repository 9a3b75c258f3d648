"""The recovery proof: a sync job killed with SIGKILL (a pserver or a trainer, at a
random step) and restarted from its last complete checkpoint ends with parameters
bit-identical to an uninterrupted run of the same steps.

The MLP (Adam, params sliced over the pservers), 2 pservers x 2 trainers, 12 steps,
a checkpoint every 2 steps (`examples/train_program.py --checkpoint-every 2`). Each
cycle draws (seeded, so a failure repeats) the victim and the step K; trainer 0 SIGKILLs
it after K steps, before step K+1 (`--kill-at-step`, 0-based), `launch` stops the rest of the job, and the
job restarts with `--restore` (from scratch when no checkpoint was complete yet). Every
other cycle restarts onto 3 pservers: the checkpoint is cut by the new plan. Cycles
repeat within a time budget (at least two, at most six); `pytest -s` prints each.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from e2e_support import EXAMPLES, ONE_THREAD, launch_ok, save

from ops.rpc.checkpoint import find_latest, read_manifest
from transpiler.runtime.launch import LaunchConfig, launch

STEPS, EVERY, BATCH = 12, 2, 16
BUDGET, MIN_CYCLES, MAX_CYCLES = 25.0, 2, 6  # seconds of cycles; the bounds of the loop
sys.path.insert(0, str(EXAMPLES))


def command(main_pb, startup_pb, out, *extra):
    return (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
            "--loss", "mean_0.tmp_0", "--steps", str(STEPS), "--batch", str(BATCH), "--save", str(out), *extra)


def finals(folder):
    saved = np.load(folder / "trainer_0.npz")
    return {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}


def test_a_job_killed_at_random_steps_and_restored_ends_bit_identical(tmp_path):
    import mlp

    main_pb, startup_pb = save(tmp_path, *mlp.build())
    launch_ok(tmp_path / "reference", command(main_pb, startup_pb, tmp_path / "reference" / "params"),
              pservers=2, trainers=2, sync_mode=True, timeout=60.0)
    reference = finals(tmp_path / "reference" / "params")

    rng = np.random.default_rng(14)
    started, cycles, kills = time.monotonic(), 0, []
    while cycles < MAX_CYCLES and (cycles < MIN_CYCLES or time.monotonic() - started < BUDGET):
        run = tmp_path / f"cycle{cycles}"
        victim = ["pserver:0", "pserver:1", "trainer:0", "trainer:1"][int(rng.integers(4))]
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
        pservers = 3 if cycles % 2 else 2
        restore = ("--restore", str(run / "ckpt")) if latest is not None else ()
        launch_ok(run / "restored", command(main_pb, startup_pb, run / "restored" / "params", *checkpoints, *restore),
                  pservers=pservers, trainers=2, sync_mode=True, timeout=60.0)
        final = finals(run / "restored" / "params")
        assert final.keys() == reference.keys()
        for name, value in reference.items():
            assert final[name].dtype == value.dtype and np.array_equal(final[name], value), (
                f"cycle {cycles}: {victim} killed before step {step}, restored at {resumed} onto {pservers} "
                f"pservers: {name} differs by {np.abs(final[name] - value).max():.3g}")
        kills.append((victim, step, resumed, pservers))
        print(f"cycle {cycles}: kill -9 {victim} before step {step}; restored from step {resumed} onto "
              f"{pservers} pservers; {len(reference)} params bit-identical")
        cycles += 1
    print(f"{cycles} cycles in {time.monotonic() - started:.1f} s, every one bit-identical")
