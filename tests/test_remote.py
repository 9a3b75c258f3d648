"""`RemoteExecutor`: the seed-001 loop with `Executor` replaced trains on 2 pservers x 2
trainers and ends with the params of local training on the same global batches (float64,
element by element), on both backends; fetched values per step (averaged, per trainer);
trainers reading their own data; a lost process and a failing step name the process."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest
from e2e_support import EXAMPLES

from conftest import PADDLE_PROGRAMS

from ops.executor import Executor
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.errors import PsTranspilerError
from transpiler.ir import Program
from transpiler.ir.precision import as_float64
from transpiler.remote import JobDesc, RemoteExecutor, RemoteJobError

sys.path.insert(0, str(EXAMPLES))
import seed_fc3  # noqa: E402

STEPS, BATCH, LOSS = 5, 8, "mean_0.tmp_0"
RTOL, ATOL = 1e-12, 1e-15  # float64: the runs differ only in summation order (measured: 2.1e-16 of a param's scale)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def programs():
    """The seed's net in float64, as it travels to the job: through its bytes (a float attr,
    e.g. the learning rate's fill_constant value, is a float32 on the wire; the program built
    in memory holds the Python float, which would differ from it by 1.5e-8 relatively)."""
    main, startup = seed_fc3.build()
    return (Program.from_bytes(as_float64(main).to_bytes()), Program.from_bytes(as_float64(startup).to_bytes()))


def batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {"x": rng.normal(size=(BATCH, 1000)) * 0.03, "y": rng.normal(size=(BATCH, 1))}


def shard_reader(trainer_id: int, trainers: int, step: int) -> dict[str, np.ndarray]:
    """A trainer's own data: its share of global batch `step` (importable, so it pickles)."""
    return {k: v[BATCH * trainer_id // trainers: BATCH * (trainer_id + 1) // trainers] for k, v in batch(step).items()}


def train_locally(main, startup, init: dict[str, np.ndarray]) -> tuple[list[float], dict[str, np.ndarray]]:
    scope, exe = Scope(), Executor(seed=0)
    exe.run(startup, scope=scope)
    for name, value in init.items():
        scope.set_var(name, LoDTensor(np.array(value)))
    losses = [float(exe.run(main, feed=batch(s), fetch_list=[LOSS], scope=scope)[0].reshape(-1)[0]) for s in range(STEPS)]
    return losses, {name: np.array(scope.find_var(name).array) for name in init}


def remote_training(tmp, backend: str, job: JobDesc, *, use_reader: bool = False, inspect=None):
    main, startup = programs()
    losses, per_trainer = [], []
    with RemoteExecutor(job, backend=backend, log_dir=tmp / "logs", env=ONE_THREAD,
                        reader=shard_reader if use_reader else None) as exe:
        exe.run(startup)  # the seed's loop runs the startup program first: recorded, not run here
        exe.start(main)
        init = exe.pull()
        for step in range(STEPS):
            if step % 2:
                values = exe.run(main, feed=None if use_reader else batch(step), fetch_list=[LOSS], per_trainer=True)
                per_trainer.append([float(v[0].reshape(-1)[0]) for v in values])
                losses.append(float(np.mean(per_trainer[-1])))
            else:
                (loss,) = exe.run(main, feed=None if use_reader else batch(step), fetch_list=[LOSS])
                losses.append(float(loss.reshape(-1)[0]))
        if inspect is not None:
            inspect(exe)
        final = exe.pull()
        result = exe.close()
    assert result is not None and result.ok, result and result.summary()
    local_losses, local_final = train_locally(main, startup, init)
    return init, losses, per_trainer, final, local_losses, local_final


def check_equal(losses, final, local_losses, local_final):
    np.testing.assert_allclose(losses, local_losses, rtol=RTOL, atol=ATOL)
    assert sorted(final) == ["fc1.b", "fc1.w", "fc2.b", "fc2.w"]
    for name, value in local_final.items():
        np.testing.assert_allclose(final[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_remote_training_equals_local_and_fetches_every_step(tmp_path):
    init, losses, per_trainer, final, local_losses, local_final = remote_training(tmp_path, "local", JobDesc("t", 2, 2))
    check_equal(losses, final, local_losses, local_final)
    assert len(losses) == STEPS and len(per_trainer) == STEPS // 2
    assert all(len(pair) == 2 and pair[0] != pair[1] for pair in per_trainer)  # each trainer's own share's loss
    assert any(not np.allclose(final[n], init[n]) for n in init)  # it trained


def test_trainers_read_their_own_data(tmp_path):
    _, losses, _, final, local_losses, local_final = remote_training(tmp_path, "local", JobDesc("t", 2, 1),
                                                                      use_reader=True)
    check_equal(losses, final, local_losses, local_final)


def test_a_lost_trainer_is_named(tmp_path):
    main, startup = programs()
    exe = RemoteExecutor(JobDesc("lost", 2, 1), startup_program=startup, log_dir=tmp_path / "logs", env=ONE_THREAD)
    try:
        exe.run(main, feed=batch(0), fetch_list=[LOSS])
        os.kill(exe.pids["trainer 1"], signal.SIGKILL)
        with pytest.raises(RemoteJobError, match=r"step 2: the job failed: trainer\.1 exited with signal SIGKILL"):
            exe.run(main, feed=batch(1), fetch_list=[LOSS])
        with pytest.raises(RemoteJobError, match="failed earlier"):
            exe.run(main, feed=batch(2))
    finally:
        exe.close()


def test_a_failing_step_is_reported_with_its_trainer(tmp_path):
    main, startup = programs()
    with RemoteExecutor(JobDesc("bad", 2, 1), startup_program=startup, log_dir=tmp_path / "logs", env=ONE_THREAD) as exe:
        bad = {"x": np.zeros((8, 999)), "y": np.zeros((8, 1))}
        with pytest.raises(RemoteJobError, match=r"step 1: trainer 0 raised \w+Error: .*"):
            exe.run(main, feed=bad, fetch_list=[LOSS])


def test_a_paddle_built_program_adam_sliced_equals_local(tmp_path):
    """The Paddle-built `mlp_adam_2ps` fixture (784 → 256 → 128 → 10, softmax cross-entropy,
    Adam; params sliced over 2 pservers), float64, through the RemoteExecutor."""
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    main = Program.from_bytes(as_float64(Program.load(folder / "main.pb")).to_bytes())
    startup = Program.from_bytes(as_float64(Program.load(folder / "startup.pb")).to_bytes())
    rng = np.random.default_rng(7)
    batches = [{"img": rng.normal(size=(8, 784)) * 0.1, "label": rng.integers(0, 10, size=(8, 1))} for _ in range(3)]
    with RemoteExecutor(JobDesc("fixture", 2, 2), startup_program=startup, log_dir=tmp_path / "logs",
                        env=ONE_THREAD, min_block_size=1024) as exe:
        exe.start(main)
        init = exe.pull()
        remote = [float(exe.run(main, feed=b, fetch_list=[LOSS])[0].reshape(-1)[0]) for b in batches]
        final = exe.pull()
    scope, local = Scope(), Executor(seed=0)
    local.run(startup, scope=scope)
    for name, value in init.items():
        scope.set_var(name, LoDTensor(np.array(value)))
    expected = [float(local.run(main, feed=b, fetch_list=[LOSS], scope=scope)[0].reshape(-1)[0]) for b in batches]
    np.testing.assert_allclose(remote, expected, rtol=RTOL, atol=ATOL)
    assert len(init) == 6
    for name in init:
        assert not np.array_equal(final[name], init[name]), name
        np.testing.assert_allclose(final[name], scope.find_var(name).array, rtol=1e-10, atol=1e-13, err_msg=name)


def test_checkpoints_and_restore(tmp_path):
    main, startup = programs()
    ckpt = tmp_path / "ckpt"
    with RemoteExecutor(JobDesc("ckpt", 2, 2), startup_program=startup, log_dir=tmp_path / "a", env=ONE_THREAD,
                        checkpoint_dir=ckpt, checkpoint_every=2) as exe:
        for step in range(4):
            exe.run(main, feed=batch(step))
        trained = exe.pull()
    assert {"ckpt-2", "ckpt-4"} <= {p.name for p in ckpt.iterdir()}
    with RemoteExecutor(JobDesc("ckpt", 2, 1), startup_program=startup, log_dir=tmp_path / "b", env=ONE_THREAD,
                        restore=ckpt) as exe:  # onto another pserver count
        exe.start(main)
        assert exe.steps == 4
        restored = exe.pull()
    for name, value in trained.items():
        np.testing.assert_array_equal(restored[name], value)


def test_bad_arguments_fail_before_a_job_starts(tmp_path):
    main, _ = programs()
    with pytest.raises(PsTranspilerError, match="num_trainer must be an integer >= 1"):
        RemoteExecutor(JobDesc("x", 0, 1))
    with pytest.raises(PsTranspilerError, match="mem_per_trainer"):
        RemoteExecutor(JobDesc("x", 1, 1, mem_per_trainer=-5))
    with pytest.raises(PsTranspilerError, match="unknown backend"):
        RemoteExecutor(JobDesc(), backend="k8s")
    exe = RemoteExecutor(JobDesc("x", 3, 1), log_dir=tmp_path)
    with pytest.raises(PsTranspilerError, match="8 rows, which do not split evenly over 3 trainers"):
        exe.shard(batch(0))
    with pytest.raises(PsTranspilerError, match="needs a reader"):
        exe.run(main, feed=None)
    assert exe.program is None and exe.close() is None  # nothing started


def test_job_desc_resources():
    job = JobDesc("j", 2, 3, 2.0, 1.0, 2**30, 0.5, 2**29)
    assert job.resources(False) == {"CPU": 2.0, "GPU": 1.0, "memory": float(2**30)}
    assert job.resources(True) == {"CPU": 0.5, "memory": float(2**29)}


def test_ray_backend_equals_local_with_job_desc_resources(tmp_path):
    pytest.importorskip("ray")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray instance on 127.0.0.1 only
    seen = {}

    def inspect(exe):
        import ray

        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        seen["bundles"] = [dict(b) for g in groups for b in g["bundles"].values()]

    job = JobDesc("ray", 2, 2, cpu_per_trainer=0.5, mem_per_trainer=50 * 2**20, cpu_per_pserver=0.25)
    _, losses, _, final, local_losses, local_final = remote_training(tmp_path, "ray", job, inspect=inspect)
    check_equal(losses, final, local_losses, local_final)
    trainer, pserver = {"CPU": 0.5, "memory": 50.0 * 2**20}, {"CPU": 0.25}
    assert sorted(seen["bundles"], key=str) == sorted([pserver] * 2 + [trainer] * 2, key=str)


@pytest.mark.parametrize("victim", ["trainer 1", "pserver"])
def test_a_killed_process_restarts_from_a_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, victim):
    """`max_restarts` as `launch` has it: a process killed (SIGKILL) after step 3 of 6, with a
    checkpoint every 2 steps: `launch` restarts every process from ckpt-2, the driver resends
    step 3's batch and retries step 4, and the loop ends with the losses and params (float64,
    element by element) of local training on the same global batches."""
    main, startup = programs()
    steps, losses = 6, []
    with RemoteExecutor(JobDesc("restart", 2, 2), startup_program=startup, log_dir=tmp_path / "logs", env=ONE_THREAD,
                        checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, max_restarts=1) as exe:
        exe.start(main)
        init = exe.pull()
        for step in range(steps):
            if step == 3:
                (pid,) = [pid for who, pid in exe.pids.items() if who.startswith(victim)][:1]
                os.kill(pid, signal.SIGKILL)
            losses.append(float(exe.run(main, feed=batch(step), fetch_list=[LOSS])[0].reshape(-1)[0]))
        assert exe.steps == steps and len(exe.restarts) == 1, exe.restarts
        final = exe.pull()
        result = exe.close()
    assert result.ok and len(result.restarts) == 1 and "SIGKILL" in result.restarts[0], result.summary()
    assert "restart 1 of 1, from checkpoint ckpt-2" in (tmp_path / "logs" / "launch.txt").read_text()
    scope, local = Scope(), Executor(seed=0)
    local.run(startup, scope=scope)
    for name, value in init.items():
        scope.set_var(name, LoDTensor(np.array(value)))
    expected = [float(local.run(main, feed=batch(s), fetch_list=[LOSS], scope=scope)[0].reshape(-1)[0])
                for s in range(steps)]
    np.testing.assert_allclose(losses, expected, rtol=RTOL, atol=ATOL)
    for name in init:
        np.testing.assert_allclose(final[name], scope.find_var(name).array, rtol=RTOL, atol=ATOL, err_msg=name)


def test_restart_options_are_checked(tmp_path):
    with pytest.raises(PsTranspilerError, match="max_restarts resumes from a checkpoint"):
        RemoteExecutor(JobDesc(), max_restarts=1, log_dir=tmp_path)
    with pytest.raises(PsTranspilerError, match="max_restarts resumes from a checkpoint"):
        RemoteExecutor(JobDesc(), max_restarts=1, checkpoint_dir=tmp_path / "c", log_dir=tmp_path)
    with pytest.raises(PsTranspilerError, match="max_restarts must be an integer >= 0"):
        RemoteExecutor(JobDesc(), max_restarts=-1, log_dir=tmp_path)


def test_a_step_that_fails_again_after_its_restart_ends_the_job(tmp_path):
    """A step that raises is restarted like a lost process (launch cannot tell them
    apart); raising again with no restart left fails the call and `launch` restarts no more."""
    main, startup = programs()
    exe = RemoteExecutor(JobDesc("bad", 2, 1), startup_program=startup, log_dir=tmp_path / "logs", env=ONE_THREAD,
                         checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, max_restarts=1)
    try:
        exe.run(main, feed=batch(0))
        bad = {"x": np.zeros((8, 999)), "y": np.zeros((8, 1))}
        with pytest.raises(RemoteJobError, match=r"step 2: trainer \d raised \w+Error: .*"):
            exe.run(main, feed=bad, fetch_list=[LOSS])
        assert len(exe.restarts) == 1 and "raised" in exe.restarts[0]
    finally:
        result = exe.close()
    assert result is not None and not result.ok and len(result.restarts) == 1
    assert not (tmp_path / "logs" / "restart-2").exists()
