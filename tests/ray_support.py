"""Helpers the Ray tests share (no tests here): a 3-node Ray cluster on 127.0.0.1, the
node a process runs on, and a `train_fn` for `transpiler.runtime.ray.run`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from conftest import TESTS

REPO = TESTS.parent
EXAMPLES = REPO / "examples"
# Every address Ray binds and advertises is 127.0.0.1 (Ray reads this when imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The workers import this checkout, and `train_program` for the train_fn below.
os.environ["PYTHONPATH"] = os.pathsep.join(
    dict.fromkeys([str(REPO), str(EXAMPLES), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]))
sys.path.insert(0, str(EXAMPLES))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

# The GCS checks its nodes twice a second and gives up on one after 3 misses: a removed
# node is declared dead within ~2 s (Ray's default is ~15 s).
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
NODE = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024 * 1024}


def start_cluster() -> Cluster:
    """A head and two workers, 2 CPUs each, every one on 127.0.0.1; this process connected."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "_system_config": FAST_HEALTH,
                                                            "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="warning")
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()


def node_of_pid(cluster: Cluster, pid: int):
    """The cluster node whose raylet is an ancestor of process `pid` (its actor's worker)."""
    raylets = {node.all_processes["raylet"][0].process.pid: node for node in [cluster.head_node, *cluster.worker_nodes]}
    for _ in range(10):
        if pid in raylets:
            return raylets[pid]
        pid = _parent(pid)
        if pid <= 1:
            break
    raise AssertionError("the process runs under no raylet of the cluster")


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def alive_actors() -> list[str]:
    """The ids of the cluster's actors that are not dead."""
    return [actor_id for actor_id, actor in ray._private.state.actors().items() if actor["State"] != "DEAD"]


def live_placement_groups() -> list[str]:
    """The ids of the cluster's placement groups that were not removed."""
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


def wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def train_synthetic(session, role, *, steps: int, batch: int, seed: int, save: str) -> dict[str, np.ndarray]:
    """A `run` train_fn: `train_program.py`'s synthetic batches, this trainer's share of each;
    saves the params it started from and ended with as `train_program.py --save` does
    (`SAVE/trainer_<i>.npz`), and returns the final ones."""
    import train_program

    initial = train_program.held_params(session)
    for step in range(session.steps, steps):
        session.run(train_program.shard(train_program.synthetic_batch(session.main, batch, seed, step), role),
                    loss="mean_0.tmp_0")
    final = train_program.held_params(session)
    Path(save).mkdir(parents=True, exist_ok=True)
    arrays = {f"init/{k}": v for k, v in initial.items()} | {f"final/{k}": v for k, v in final.items()}
    np.savez(Path(save) / f"trainer_{role.trainer_id}.npz", **arrays)
    return final
