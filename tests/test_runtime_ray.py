"""`launch --backend ray` and `transpiler.runtime.ray.run` on a real 3-node Ray cluster
(`ray.cluster_utils.Cluster`: a head and two workers, 2 CPUs each, every node on 127.0.0.1).

* the digits MLP, 2 pservers x 2 trainers, sync, trains to exactly the accuracy (and the
  losses) of the same job under the local `launch`, with the pservers on different nodes;
* `run(...)` (a train_fn in the trainer actors; bundles packed) equals local training in
  float64, element by element, like the local proof (`test_e2e_sync`);
* a worker node holding a pserver removed mid-run fails the job within seconds, naming the
  pserver, its node and the step, and leaves no actor behind; with `max_restarts` the job
  resumes from its last checkpoint on the nodes left and ends with params bit-identical
  to an uninterrupted run.

The cluster is shared by the module's tests; a test that removes a node adds one back.
"""

from __future__ import annotations

import functools
import io
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray_support
from e2e_support import BATCH, EXAMPLES, ONE_THREAD, SEED, STEPS, differences, save, train_locally
from ray_support import NODE, alive_actors, live_placement_groups, node_of_pid, start_cluster, stop_cluster, wait_for

from transpiler.ir.precision import as_float64
from transpiler.runtime.launch import LaunchConfig, launch
from transpiler.runtime.metrics import read_metrics
from transpiler.runtime.ray import run

sys.path.insert(0, str(EXAMPLES))
RTOL = 1e-5  # float64, element by element (as test_e2e_sync)
LONG_STEPS, EVERY, PAUSE_AT = 30, 4, 10  # the node-loss job: a checkpoint every 4 steps, the node goes at step 10


@pytest.fixture(scope="module")
def cluster():
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def ray_config(tmp: Path, command, **options) -> LaunchConfig:
    options.setdefault("pservers", 2)
    options.setdefault("trainers", 2)
    return LaunchConfig(command=tuple(command), backend="ray", env=ONE_THREAD, log_dir=tmp / "logs", rpc_timeout=60.0,
                        status_every=60.0, stop_grace=2.0, **options)


def launch_logged(config: LaunchConfig, tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    result = launch(config, out=out)
    (tmp / "launch.txt").write_text(out.getvalue())
    return result, out.getvalue()


def test_the_digits_mlp_on_three_nodes_trains_as_under_the_local_launch(cluster, tmp_path):
    command = (sys.executable, str(EXAMPLES / "train_mlp_digits.py"))
    local, _ = launch_logged(LaunchConfig(command=(*command, "--out", str(tmp_path / "local.json")), pservers=2,
                                          trainers=2, env=ONE_THREAD, log_dir=tmp_path / "local" / "logs",
                                          status_every=60.0), tmp_path / "local")
    assert local.ok, local.summary()
    result, text = launch_logged(ray_config(tmp_path, (*command, "--out", str(tmp_path / "ray.json"))), tmp_path)
    assert result.ok, text
    on_ray, locally = (json.loads((tmp_path / name).read_text()) for name in ("ray.json", "local.json"))
    print(f"digits on Ray: accuracy {on_ray['before']:.3f} -> {on_ray['after']:.3f} in {on_ray['steps']} steps")
    assert on_ray["after"] >= 0.9 and on_ray["before"] < 0.5
    assert on_ray == locally  # sync training is deterministic: the same accuracy, the same losses
    nodes = {p.name: p.node for p in result.processes}
    assert nodes["pserver.0"] != nodes["pserver.1"], result.summary()
    assert len(set(nodes.values())) == 3, result.summary()  # spread: every node got a bundle
    assert "on ray, sync" in text and "node" in text.splitlines()[-5]  # the summary names each process's node
    # Both backends write the job's metrics file: the same steps and losses, and every pserver's CPU.
    metrics = {where: read_metrics(logs) for where, logs in (("local", tmp_path / "local" / "logs"),
                                                             ("ray", tmp_path / "logs"))}
    steps = {where: sorted((r["trainer"], r["step"], r["loss"]) for r in rows if r["role"] == "trainer")
             for where, rows in metrics.items()}
    assert steps["ray"] == steps["local"] and len(steps["ray"]) == 2 * on_ray["steps"]
    assert {r["pserver"] for r in metrics["ray"] if r["role"] == "pserver"} == {0, 1}
    assert alive_actors() == []


def test_run_on_ray_equals_local_training_in_float64(cluster, tmp_path):
    import mlp

    main, startup = (as_float64(p) for p in mlp.build())
    main_pb, startup_pb = save(tmp_path, main, startup)
    ray_support.ray.cloudpickle.register_pickle_by_value(ray_support)  # the actors cannot import tests/
    train_fn = functools.partial(ray_support.train_synthetic, steps=STEPS, batch=BATCH, seed=SEED,
                                 save=str(tmp_path / "params"))
    out = io.StringIO()
    result = run(main, startup, train_fn, pservers=2, trainers=2, env=ONE_THREAD, log_dir=tmp_path / "logs",
                 seed=SEED, out=out, status_every=60.0, placement="pack")
    assert result.ok, out.getvalue()
    assert sorted(result.results) == [0, 1]
    # packed (best effort: Ray packs 4 one-CPU bundles onto 2 of these 2-CPU nodes when they are free)
    assert [pg["strategy"] for pg in ray_support.ray.util.placement_group_table().values()].count("PACK") == 1
    local = train_locally(tmp_path, main_pb, startup_pb)
    for name, (elementwise, _) in differences(result.results[0], local).items():
        print(f"run() on Ray vs local (float64): {name}: max rel diff element-wise {elementwise:.2e}")
        assert result.results[0][name].dtype == np.float64 and elementwise <= RTOL, name
        assert np.array_equal(result.results[0][name], result.results[1][name]), name  # both trainers agree
    assert alive_actors() == []


def node_loss_command(tmp: Path, main_pb: Path, startup_pb: Path, out: Path) -> tuple[str, ...]:
    return (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
            "--loss", "mean_0.tmp_0", "--steps", str(LONG_STEPS), "--batch", str(BATCH), "--save", str(out),
            "--pid-dir", str(tmp / "pids"), "--pause-at-step", str(PAUSE_AT), "--pause-file", str(tmp / "pause"))


def remove_a_pservers_node(cluster, tmp: Path) -> tuple[tuple[str, ...], float]:
    """Once trainer 0 paused, remove the worker node of a pserver that is not on the head;
    (the names of the processes that were on it, when). Adds a fresh worker node back for
    later tests. Any of those processes may be the one the job reports lost first: Ray
    tells of their actors' deaths in no set order."""
    assert wait_for(tmp / "pause.reached", 90.0), "trainer 0 never reached the pause"
    for name in ("pserver.0", "pserver.1"):
        node = node_of_pid(cluster, int((tmp / "pids" / name).read_text()))
        if node is not cluster.head_node:
            break
    else:
        raise AssertionError("both pservers are on the head node")
    on_node = tuple(sorted(path.name for path in (tmp / "pids").iterdir()
                           if node_of_pid(cluster, int(path.read_text())) is node))
    removed = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    (tmp / "pause.go").write_text("")
    cluster.add_node(**NODE)
    return on_node, removed


def run_losing_a_node(cluster, tmp: Path, config: LaunchConfig):
    import threading

    box = {}
    thread = threading.Thread(target=lambda: box.update(zip(("result", "text"), launch_logged(config, tmp))))
    thread.start()
    try:
        victims, removed = remove_a_pservers_node(cluster, tmp)
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive()
    return box["result"], box["text"], victims, removed


@pytest.fixture
def mlp_programs(tmp_path):
    import mlp

    return save(tmp_path / "programs", *mlp.build())


def test_losing_a_node_fails_the_job_within_seconds_and_leaves_no_actor(cluster, tmp_path, mlp_programs):
    config = ray_config(tmp_path, node_loss_command(tmp_path, *mlp_programs, tmp_path / "params"))
    result, text, victims, removed = run_losing_a_node(cluster, tmp_path, config)
    waited = time.monotonic() - removed
    print(f"node removed: the job failed after {waited:.1f} s: {result.failure}")
    assert not result.ok
    assert any(result.failure.startswith(f"{name} on node 127.0.0.1/") for name in victims), (victims, result.failure)
    step = re.search(r" was lost at step (\d+): ", result.failure)
    assert step and PAUSE_AT <= int(step.group(1)) < LONG_STEPS, result.failure  # the steps the trainers reported
    assert waited < 20.0, text  # detection within seconds (the stop and cleanup included)
    assert alive_actors() == [] and live_placement_groups() == []


def test_with_max_restarts_a_lost_node_resumes_from_the_checkpoint_bit_identical(cluster, tmp_path, mlp_programs):
    reference = tmp_path / "reference"
    plain = node_loss_command(reference, *mlp_programs, reference / "params")
    (reference / "pause.reached").parent.mkdir(parents=True)
    (reference / "pause.reached").write_text("")  # no pause
    done, text = launch_logged(LaunchConfig(command=plain, pservers=2, trainers=2, env=ONE_THREAD,
                                            log_dir=reference / "logs", status_every=60.0), reference)
    assert done.ok, text

    config = ray_config(tmp_path, node_loss_command(tmp_path, *mlp_programs, tmp_path / "params"), max_restarts=1,
                        checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY)
    result, text, victims, _ = run_losing_a_node(cluster, tmp_path, config)
    assert result.ok, text
    assert len(result.restarts) == 1, result.restarts
    assert any(result.restarts[0].startswith(f"{name} on node") for name in victims), (victims, result.restarts)
    # the newest complete checkpoint when the node went: the pause's (ckpt-8), or a later one
    # when the trainers got further before the node's processes were gone
    resumed = re.search(r"restart 1 of 1, from checkpoint ckpt-(\d+)", text)
    assert resumed and PAUSE_AT // EVERY * EVERY <= int(resumed.group(1)) < LONG_STEPS, text
    for trainer in (0, 1):
        expected, got = (np.load(d / "params" / f"trainer_{trainer}.npz") for d in (reference, tmp_path))
        finals = [k for k in expected.files if k.startswith("final/")]
        assert finals and sorted(finals) == sorted(k for k in got.files if k.startswith("final/"))
        for key in finals:
            assert np.array_equal(expected[key], got[key]), key
    assert alive_actors() == []


def test_cli_launch_backend_ray_starts_a_loopback_ray_instance_of_its_own(tmp_path):
    """No cluster, no --address: `pstranspile launch --backend ray` starts a local Ray
    instance bound to 127.0.0.1 (it sets that up itself), runs the job, and stops Ray."""
    import os
    import subprocess

    from test_runtime_launch import SCRIPT

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ray_support.REPO)
    done = subprocess.run([sys.executable, "-m", "transpiler", "launch", "--backend", "ray", "--pservers", "2",
                           "--trainers", "2", "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(script),
                           str(tmp_path / "out"), "ok"], env=env, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "starting a local Ray instance (127.0.0.1 only" in done.stderr
    summary = done.stderr[done.stderr.index("launch: 2 pserver(s) x 2 trainer(s) on ray, sync"):]
    assert ": ok" in summary.splitlines()[0]
    assert summary.splitlines()[1].startswith("  logs in ")  # the logs' folder once, then the table
    rows = [line.split() for line in summary.splitlines()[3:]]
    assert [row[0] for row in rows] == ["pserver.0", "pserver.1", "trainer.0", "trainer.1"]
    assert all(row[1].startswith("127.0.0.1:") for row in rows[:2]) and all(row[2].startswith("127.0.0.1/") for row in rows)
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "out").iterdir()}
    assert len(records) == 4 and len({r["PSTRANSPILE_JOB_TOKEN"] for r in records.values()}) == 1
    failed = subprocess.run([sys.executable, "-m", "transpiler", "launch", "--backend", "ray", "--pservers", "1",
                             "--trainers", "2", "--log-dir", str(tmp_path / "logs2"), "--", sys.executable, str(script),
                             str(tmp_path / "out"), "fail"], env=env, capture_output=True, text=True, timeout=180,
                            check=False)
    assert failed.returncode == 1 and "FAILED: trainer.1 on node 127.0.0.1/" in failed.stderr, failed.stderr
    assert "exited with code 3 at step 3" in failed.stderr
