"""Per-pserver checkpoint dirs that only their own pserver can read (`ops.rpc.own_dirs`):
a StatefulSet with a volume per pserver.

Every process of the job runs under `tests/isolation_support.py`: its own mount
namespace, with an empty read-only tmpfs over every checkpoint dir of the template but its
own (pserver i: `disk<i>`; trainer 0: `diskjob`, its scratch dir; trainer 1: none). A
read of another process's dir finds nothing, a write fails. Under that, on Paddle-built
fixtures in float64, a job checkpoints, is killed (kill -9), restarts (`launch
--max-restarts`), and a job restored by hand (`--restore` the template: `Session(restore=)`,
the pservers' `serve_program(restore=)`) after trainer 0 died between two pservers'
commits: every final param and optimizer state is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from isolation_support import available, prefix
from recovery_support import BY_NAME, differing, final_state, log_of, run_job, trainer_finals

REPO = Path(__file__).resolve().parents[1]
WHY_NOT = available()
needs_unshare = pytest.mark.skipif(WHY_NOT is not None, reason=f"no mount namespaces here: {WHY_NOT}")
STEPS, EVERY = 6, 2


def isolated(template: Path, pservers: int) -> tuple[str, ...]:
    return prefix(template, pservers)


def logs(out: Path) -> list[Path]:
    return sorted((out / "logs").rglob("*.log"))


def assert_isolated(out: Path, template: Path, processes: int) -> None:
    """Every process of every attempt said, before it started, that it saw only its own dir."""
    seen = [line for log in logs(out) for line in log.read_text().splitlines() if line.startswith("isolation: ")]
    assert len(seen) == processes, seen
    assert all("other dir(s) hidden" in line for line in seen)
    for i in range(2):
        assert any(f"pserver sees only {str(template).replace('{pserver}', str(i))};" in line for line in seen)


@needs_unshare
@pytest.mark.parametrize(("case", "victim"), [("mlp_adam_2ps", "pserver:1"), ("ctr_v1_dist_sgd_2ps", "pserver:0")])
def test_isolated_pservers_checkpoint_and_recover_from_a_kill_bit_identical(tmp_path, case, victim):
    fixture = BY_NAME[case]
    reference = run_job(fixture, tmp_path / "reference", STEPS, EVERY, float64=True)
    assert reference.ok, log_of(reference, tmp_path / "reference")
    template = tmp_path / "disk{pserver}" / "ckpt"
    out = tmp_path / "killed"
    killed = run_job(fixture, out, STEPS, EVERY, "--chaos", f"3:{victim}", "--pid-dir", str(tmp_path / "pids"),
                     float64=True, max_restarts=1, checkpoint_dir=template, wrap=isolated(template, fixture.pservers))
    assert killed.ok and len(killed.restarts) == 1, log_of(killed, out)
    assert "SIGKILL" in killed.restarts[0]
    assert_isolated(out, template, 2 * (fixture.pservers + fixture.trainers))
    for i in range(fixture.pservers):  # the restart restored each pserver from its own part, agreed over RPC
        text = (out / "logs" / "restart-1" / f"pserver.{i}.log").read_text()
        assert "restored" in text and "from ckpt-2 in its own dir" in text and "agreed with trainer 0" in text, text
        own = tmp_path / f"disk{i}" / "ckpt" / "ckpt-6"
        assert (own / f"ps{i}" / "PART.json").is_file() and (own / "MANIFEST.json").is_file()
        assert sorted(p.name for p in own.iterdir()) == ["MANIFEST.json", f"ps{i}"]  # no other part in a pserver's dir
    step, want = final_state(tmp_path / "reference" / "ckpt")
    again, got = final_state(template)  # read here, by a process that sees every dir (the job manifest's locations)
    assert step == again == STEPS and want
    assert not differing(want, got), differing(want, got)
    assert {a.dtype.name for a in want.values() if a.dtype.kind == "f"} == {"float64"}
    assert not differing(trainer_finals(tmp_path / "reference"), trainer_finals(out))


@needs_unshare
def test_a_restore_by_hand_agrees_the_step_after_trainer_0_died_between_two_commits(tmp_path):
    """Trainer 0 died after pserver 0 kept ckpt-4's manifest copy and before pserver 1 did
    (and before its own job manifest): the pservers alone know ckpt-4 is complete. A job
    started by hand with `--restore` the template agrees ckpt-4 over RPC (pserver 1 then
    keeps the copy too) and ends bit-identical to an uninterrupted run."""
    fixture = BY_NAME["mlp_adam_2ps"]
    reference = run_job(fixture, tmp_path / "reference", STEPS, EVERY, float64=True)
    assert reference.ok, log_of(reference, tmp_path / "reference")
    template = tmp_path / "disk{pserver}" / "ckpt"
    wrap = isolated(template, 2)
    first = run_job(fixture, tmp_path / "first", 4, EVERY, float64=True, checkpoint_dir=template, wrap=wrap)
    assert first.ok, log_of(first, tmp_path / "first")
    (tmp_path / "disk1" / "ckpt" / "ckpt-4" / "MANIFEST.json").unlink()  # as trainer 0's death left them
    (tmp_path / "disk1" / "ckpt" / "latest").write_text("ckpt-2\n")
    shutil.rmtree(tmp_path / "diskjob")
    resumed = run_job(fixture, tmp_path / "resumed", STEPS, EVERY, "--restore", str(template), float64=True,
                      checkpoint_dir=template, wrap=wrap)
    assert resumed.ok, log_of(resumed, tmp_path / "resumed")
    assert_isolated(tmp_path / "resumed", template, 4)
    for i in range(2):
        assert "from ckpt-4 in its own dir" in (tmp_path / "resumed" / "logs" / f"pserver.{i}.log").read_text()
    copies = [json.loads((tmp_path / f"disk{i}" / "ckpt" / "ckpt-4" / "MANIFEST.json").read_text()) for i in range(2)]
    assert copies[0] == copies[1] and copies[0]["step"] == 4
    step, want = final_state(tmp_path / "reference" / "ckpt")
    again, got = final_state(template)
    assert step == again == STEPS and not differing(want, got), differing(want, got)
    assert not differing(trainer_finals(tmp_path / "reference"), trainer_finals(tmp_path / "resumed"))
    # The isolation is real: in pserver 0's view its own dir's copy of the manifest names
    # pserver 1's part, which is hidden from it, so a fetch fails; this process, seeing every
    # dir, fetches the same checkpoint.
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ENDPOINTS": "a:1,b:2",
           "PADDLE_CURRENT_ENDPOINT": "a:1"}
    fetch = [sys.executable, "-m", "transpiler", "fetch", "--full", "--checkpoint", str(tmp_path / "disk0" / "ckpt"), "-o"]
    seen_by_ps0 = subprocess.run([*wrap, *fetch, str(tmp_path / "ps0_fetch")], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
    assert seen_by_ps0.returncode == 2 and "isolation: pserver sees only" in seen_by_ps0.stderr, seen_by_ps0.stderr
    assert ": part ps1 is " in seen_by_ps0.stderr, seen_by_ps0.stderr  # neither at its location nor gathered
    whole = subprocess.run([*fetch, str(tmp_path / "fetched")], env=env, capture_output=True, text=True, timeout=120,
                           check=False)
    assert whole.returncode == 0, whole.stderr


# ------------------------------------------------------------------ the agreement, in process


class _Pservers:
    """Stands for the RPC client of trainer 0: each `Checkpoint*` call answered by a
    pserver's `PartRestorer` as its handler does (`OwnDirRpc`), without gRPC."""

    def __init__(self, restorers, scopes, commit) -> None:
        self.trainer_id, self.restorers, self.scopes, self.commit = 0, restorers, scopes, commit

    def checkpoint_call(self, method, endpoints, message):
        from proto import rpc_pb2

        out = []
        for ep in endpoints:
            r = self.restorers[ep]
            if method == "CheckpointList":
                text = json.dumps({**r.held(), "restored": r.step})
            elif method == "CheckpointPart":
                text = r.manifest_text(message.dir)
            else:
                text = json.dumps({"step": r.restore(self.scopes[ep], message.dir, message.json, self.commit[ep])})
            out.append(rpc_pb2.CheckpointMessage(dir=message.dir, json=text))
        return out


def test_the_agreed_step_is_the_newest_complete_anywhere_whose_parts_every_pserver_holds(tmp_path):
    import numpy as np

    from ops.rpc.checkpoint import Checkpointer, CheckpointError, VarSlice, part_root, write_job_manifest
    from ops.rpc.own_dirs import PartRestorer, agree_restore
    from ops.scope import Scope
    from ops.tensor import LoDTensor

    w = np.arange(12, dtype=np.float64).reshape(6, 2)
    template = tmp_path / "disk{pserver}"
    layouts = [{"w.block0": VarSlice("w", (6, 2), (0, 4)), "lr": VarSlice("lr", ())},
               {"w.block1": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", ())}]
    plan = '{"plan": 2}'
    savers = [Checkpointer(part_root(template, i), f"ps{i}", ("ps0", "ps1"), layout, plan, keep=3, shared=False)
              for i, layout in enumerate(layouts)]
    for step in (2, 4):
        for i, saver in enumerate(savers):
            scope = Scope()
            scope.set_var(f"w.block{i}", LoDTensor((w + step)[:4] if i == 0 else (w + step)[4:]))
            scope.set_var("lr", LoDTensor(np.array(0.1 * step)))
            saver.save(scope, f"ckpt-{step}")
        manifest = json.loads((write_job_manifest(template, f"ckpt-{step}", 2, plan, infos={
            f"ps{i}": json.loads((part_root(template, i) / f"ckpt-{step}" / f"ps{i}" / "PART.json").read_text())
            for i in range(2)}) / "MANIFEST.json").read_text())
        for saver in savers[: 2 if step == 2 else 1]:  # trainer 0 died after pserver 0's commit of ckpt-4
            saver.commit(f"ckpt-{step}", manifest)

    def pservers():
        restorers = {f"ep{i}": PartRestorer(template, i, f"ps{i}", 2, layouts[i], plan) for i in range(2)}
        return restorers, _Pservers(restorers, {f"ep{i}": Scope() for i in range(2)},
                                    {f"ep{i}": savers[i].commit for i in range(2)})

    restorers, client = pservers()
    assert restorers["ep1"].held() == {"committed": [2], "parts": [2, 4], "part": "ps1"}
    assert agree_restore(client, ["ep0", "ep1"]) == 4
    assert np.array_equal(client.scopes["ep1"].find_var("w.block1").array, (w + 4)[4:])
    assert client.scopes["ep0"].find_var("lr").array.tobytes() == np.array(0.4).tobytes()
    assert (part_root(template, 1) / "ckpt-4" / "MANIFEST.json").is_file()  # pserver 1 completed it
    # pserver 1 lost its ckpt-4 part and ckpt-2's: no step is complete with every part held
    shutil.rmtree(part_root(template, 1) / "ckpt-4")
    shutil.rmtree(part_root(template, 1) / "ckpt-2")
    _, client = pservers()
    with pytest.raises(CheckpointError, match=r"no checkpoint of this plan is complete .*ps1 at ep1: manifests none"):
        agree_restore(client, ["ep0", "ep1"], if_any=True)
    # nothing complete anywhere (a kill before the first checkpoint completed): a launcher's
    # restart starts from scratch, a restore by hand is an error
    for i in range(2):
        shutil.rmtree(part_root(template, i))
    savers[0].save(_scope(w, 0), "ckpt-2")  # a part, never committed
    _, client = pservers()
    assert agree_restore(client, ["ep0", "ep1"], if_any=True) == 0
    _, client = pservers()
    with pytest.raises(CheckpointError, match="no checkpoint of this plan is complete"):
        agree_restore(client, ["ep0", "ep1"])


def _scope(w, i):
    import numpy as np

    from ops.scope import Scope
    from ops.tensor import LoDTensor

    scope = Scope()
    scope.set_var(f"w.block{i}", LoDTensor(w[:4] if i == 0 else w[4:]))
    scope.set_var("lr", LoDTensor(np.array(0.1)))
    return scope


def test_over_grpc_a_pserver_refuses_var_calls_until_trainer_0_agrees_its_restore(tmp_path):
    """The RPCs themselves: trainer 0 saves through `CheckpointNotify`/`Part`/`Commit` (the
    pserver keeps the manifest's copy); a pserver started to restore refuses a get
    (`FAILED_PRECONDITION`) until trainer 0's `CheckpointRestore`; trainer 1's own call
    waits for it and answers the step."""
    import threading
    import time

    import numpy as np

    from ops.rpc.checkpoint import Checkpointer, VarSlice, part_root
    from ops.rpc.errors import RpcError
    from ops.rpc.own_dirs import PartRestorer, agree_restore, save
    from ops.scope import Scope
    from ops.tensor import LoDTensor
    from rpc_support import running_pserver

    template = tmp_path / "disk{pserver}"
    layout = {"w": VarSlice("w", (2, 3))}
    plan = "{}"
    scope = Scope()
    scope.set_var("w", LoDTensor(np.full((2, 3), 2.5)))
    own = Checkpointer(part_root(template, 0), "ps0", ("ps0",), layout, plan, shared=False)
    with running_pserver(sync_mode=False, scope=scope, checkpointer=own) as ps:
        folder = save(ps.client(0), [ps.address], template, "ckpt-2", plan, 3)
    assert folder == tmp_path / "diskjob" / "ckpt-2"
    assert (tmp_path / "disk0" / "ckpt-2" / "MANIFEST.json").read_text() == (folder / "MANIFEST.json").read_text()
    fresh = Scope()
    fresh.set_var("w", LoDTensor(np.zeros((2, 3))))
    restorer = PartRestorer(template, 0, "ps0", 1, layout, plan)
    with running_pserver(sync_mode=False, fanin=2, scope=fresh, checkpointer=own, restorer=restorer,
                         known_vars=frozenset({"w"})) as ps:
        zero, one = ps.client(0), ps.client(1)
        with pytest.raises(RpcError, match="FAILED_PRECONDITION.*waiting for trainer 0 to agree"):
            zero.get(ps.address, "w")
        learned: list[int] = []
        waiter = threading.Thread(target=lambda: learned.append(agree_restore(one, [ps.address])))
        waiter.start()
        deadline = time.monotonic() + 10  # trainer 1's wait is in: a second one of trainer 1 is refused at once
        while not restorer._waiting and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.01)
        with pytest.raises(RpcError, match="RESOURCE_EXHAUSTED.*trainer 1 already waits"):
            agree_restore(ps.client(1), [ps.address])
        assert agree_restore(zero, [ps.address]) == 2
        waiter.join(20)
        assert learned == [2]
        assert zero.get(ps.address, "w").array.tolist() == [[2.5] * 3] * 2
