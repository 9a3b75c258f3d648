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
from recovery_support import BY_NAME, differing, final_state, log_of, reference_run, run_job, trainer_finals

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
def test_isolated_pservers_checkpoint_and_recover_from_a_kill_bit_identical(tmp_path, tmp_path_factory, case, victim):
    fixture = BY_NAME[case]
    reference = reference_run(tmp_path_factory, fixture, STEPS, EVERY, float64=True)
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
    step, want = final_state(reference / "ckpt")
    again, got = final_state(template)  # read here, by a process that sees every dir (the job manifest's locations)
    assert step == again == STEPS and want
    assert not differing(want, got), differing(want, got)
    assert {a.dtype.name for a in want.values() if a.dtype.kind == "f"} == {"float64"}
    assert not differing(trainer_finals(reference), trainer_finals(out))


@needs_unshare
def test_a_restore_by_hand_agrees_the_step_after_trainer_0_died_between_two_commits(tmp_path, tmp_path_factory):
    """Trainer 0 died after pserver 0 kept ckpt-4's manifest copy and before pserver 1 did
    (and before its own job manifest): the pservers alone know ckpt-4 is complete. A job
    started by hand with `--restore` the template agrees ckpt-4 over RPC (pserver 1 then
    keeps the copy too) and ends bit-identical to an uninterrupted run."""
    fixture = BY_NAME["mlp_adam_2ps"]
    reference = reference_run(tmp_path_factory, fixture, STEPS, EVERY, float64=True)
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
    step, want = final_state(reference / "ckpt")
    again, got = final_state(template)
    assert step == again == STEPS and not differing(want, got), differing(want, got)
    assert not differing(trainer_finals(reference), trainer_finals(tmp_path / "resumed"))
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
    from ops.rpc.own_dirs import PartRestorer, agree_restore, agreed_restore, save
    from ops.rpc.tensor_file import encode_tensor
    from ops.scope import Scope
    from ops.tensor import LoDTensor
    from proto import rpc_pb2
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
        learned: list[tuple[int, dict[str, bytes]]] = []
        waiter = threading.Thread(target=lambda: learned.append(agreed_restore(one, [ps.address])))
        waiter.start()
        deadline = time.monotonic() + 10  # trainer 1's wait is in: a second one of trainer 1 is refused at once
        while not restorer._waiting and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.01)
        with pytest.raises(RpcError, match="RESOURCE_EXHAUSTED.*trainer 1 already waits"):
            agree_restore(ps.client(1), [ps.address])
        bad = rpc_pb2.CheckpointMessage(trainer_id=0, dir="ckpt-2", json=(folder / "MANIFEST.json").read_text(),
                                        trainer_state={"../w": b"x"})
        with pytest.raises(RpcError, match="INVALID_ARGUMENT.*not a var's file name"):  # refused, no waiter fails
            zero.checkpoint_call("CheckpointRestore", [ps.address], bad)
        # trainer 0's own state (its own dir's trainer0/) goes with its restore to the waiting trainers
        state = {"bn.w_1": encode_tensor(np.arange(3.0)), "bn%2Fw_2": encode_tensor(np.ones(2))}
        (folder / "trainer0").mkdir()
        for name, data in state.items():
            (folder / "trainer0" / name).write_bytes(data)
        assert agreed_restore(zero, [ps.address], job_dir=tmp_path / "diskjob") == (2, state)
        waiter.join(20)
        assert learned == [(2, state)]
        assert zero.get(ps.address, "w").array.tolist() == [[2.5] * 3] * 2


# ------------------------------------------------------------------ request limits (issue 23)


def test_incomplete_checkpoints_are_capped_so_notices_cannot_fill_the_disk(tmp_path):
    """Parts of steps no other pserver saves (a shared dir) or trainer 0 never commits (a
    dir of its own) are kept only `INCOMPLETE_KEEP` at a time, the last written first;
    the part just written is always kept, and a complete checkpoint prunes older ones."""
    import numpy as np

    from ops.rpc.checkpoint import INCOMPLETE_KEEP, Checkpointer, VarSlice

    layout = {"w.block0": VarSlice("w", (6, 2), (0, 4)), "lr": VarSlice("lr", ())}
    w = np.arange(12, dtype=np.float64).reshape(6, 2)
    for shared in (True, False):
        root = tmp_path / f"shared{shared}"
        saver = Checkpointer(root, "ps0", ("ps0", "ps1"), layout, "{}", keep=2, shared=shared)
        steps = [9, 3, 40, 7, 1 << 40, 5, 11]
        for k, step in enumerate(steps):
            saver.save(_scope(w, 0), f"ckpt-{step}")
            left = sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("ckpt-"))
            assert step in left  # the part just written
            assert left == sorted(steps[max(0, k + 1 - INCOMPLETE_KEEP): k + 1]), (shared, left)
    # a complete checkpoint (the other part in, shared) prunes the incomplete ones older than it
    root = tmp_path / "complete"
    layouts = [layout, {"w.block1": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", ())}]
    savers = [Checkpointer(root, f"ps{i}", ("ps0", "ps1"), layouts[i], "{}", keep=2) for i in range(2)]
    savers[0].save(_scope(w, 0), "ckpt-3")
    savers[0].save(_scope(w, 0), "ckpt-8")
    savers[1].save(_scope(w, 1), "ckpt-5")
    savers[0].save(_scope(w, 0), "ckpt-5")
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-5", "ckpt-8"]
    assert (root / "ckpt-5" / "MANIFEST.json").is_file()


def test_checkpoint_names_longer_than_a_file_name_are_refused_not_an_os_error(tmp_path):
    from ops.rpc.checkpoint import CheckpointPathError, confine, step_of

    assert step_of("ckpt-" + "9" * 60000) is None  # no 60,000-digit int (Python refuses past 4300: a ValueError)
    assert step_of("ckpt-" + "9" * 18) == 10**18 - 1
    for name in ("x" * 256, "a/" * 600, "ckpt-1/" + "é" * 200):
        with pytest.raises(CheckpointPathError, match="longer than a name"):
            confine(tmp_path, name)
    assert confine(tmp_path, "x" * 255) == tmp_path.resolve() / ("x" * 255)


def _own_dir_pserver(tmp_path, **extra):
    import numpy as np

    from ops.rpc.checkpoint import Checkpointer, VarSlice, part_root
    from ops.scope import Scope
    from ops.tensor import LoDTensor
    from rpc_support import running_pserver

    template = tmp_path / "disk{pserver}"
    layout = {"w": VarSlice("w", (2, 3))}
    scope = Scope()
    scope.set_var("w", LoDTensor(np.full((2, 3), 2.5)))
    own = Checkpointer(part_root(template, 0), "ps0", ("ps0",), layout, '{"plan": 1}', shared=False)
    return template, layout, running_pserver(sync_mode=False, fanin=2, scope=scope, checkpointer=own,
                                             known_vars=frozenset({"w"}), **extra)


def _raw(ps, method, message, timeout=10.0):
    import grpc

    from ops.rpc.service import CHANNEL_OPTIONS, METHODS

    with grpc.insecure_channel(ps.address, options=list(CHANNEL_OPTIONS)) as channel:
        m = METHODS[method]
        call = channel.unary_unary(m.path, request_serializer=m.encode_request, response_deserializer=m.decode_response)
        try:
            call(message, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    return "OK", ""


def test_checkpoint_set_requests_are_bounded_named_and_validated(tmp_path):
    """`CheckpointPart`, `CheckpointCommit`: a manifest past the plan's bound is refused
    unparsed; only `ckpt-<step>` names, confined to the dir; a manifest of the wrong form
    (entries not objects, shapes not ints in range) is refused before anything walks it."""
    import json

    from ops.rpc.own_dirs import save
    from proto import rpc_pb2

    template, _, running = _own_dir_pserver(tmp_path)
    with running as ps:
        limit = ps.server._limits.request_limits()["CheckpointCommit"]  # noqa: SLF001
        assert limit == (4 << 20) + 32 * len('{"plan": 1}')
        folder = save(ps.client(0), [ps.address], template, "ckpt-2", '{"plan": 1}', 3)
        good = json.loads((folder / "MANIFEST.json").read_text())
        message = rpc_pb2.CheckpointMessage
        code, details = _raw(ps, "CheckpointCommit", message(trainer_id=0, dir="ckpt-2", json=" " * limit))
        assert code == "RESOURCE_EXHAUSTED" and "a CheckpointCommit request of" in details
        for name in ("../ckpt-2", "ckpt-2/ps0", "latest", "", "ckpt-" + "9" * 3000):
            assert _raw(ps, "CheckpointPart", message(trainer_id=0, dir=name))[0] == "INVALID_ARGUMENT", name
            assert _raw(ps, "CheckpointCommit", message(trainer_id=0, dir=name, json="{}"))[0] == "INVALID_ARGUMENT", name
        assert _raw(ps, "CheckpointNotify", message(trainer_id=0, dir="ckpt-" + "9" * 3000))[0] == "INVALID_ARGUMENT"
        assert _raw(ps, "CheckpointPart", message(trainer_id=0, dir="ckpt-7"))[0] == "FAILED_PRECONDITION"
        bad = [
            [1, 2],
            {**good, "parts": {"ps0": [good["parts"]["ps0"]]}},
            {**good, "parts": {"ps0": {"w": {**good["parts"]["ps0"]["w"], "whole_shape": [10**30, 2]}}}},
            {**good, "parts": {"ps0": {"w": {**good["parts"]["ps0"]["w"], "whole_shape": [2] * 5000}}}},
            {**good, "parts": {"ps0": {"w": {**good["parts"]["ps0"]["w"], "rows": [5, 1]}}}},
            {**good, "parts": {"ps0": {"w": {**good["parts"]["ps0"]["w"], "files": {"w": 7}}}}},
            {**good, "parts": {"ps0": good["parts"]["ps0"], "ps9": {}}},
        ]
        for manifest in bad:
            code, details = _raw(ps, "CheckpointCommit", message(trainer_id=0, dir="ckpt-2", json=json.dumps(manifest)))
            assert code == "FAILED_PRECONDITION", (code, details)
        assert _raw(ps, "CheckpointCommit", message(trainer_id=0, dir="ckpt-2", json=json.dumps(good)))[0] == "OK"
        assert ps.server._failure is None  # noqa: SLF001


def test_a_trainer_has_at_most_two_checkpoint_set_calls_in_flight(tmp_path, monkeypatch):
    import threading

    from ops.rpc.own_dirs import PartRestorer
    from proto import rpc_pb2

    release = threading.Event()
    entered = threading.Semaphore(0)

    def slow_held(self):
        entered.release()
        release.wait(20)
        return {"committed": [], "parts": [], "part": self.part}

    monkeypatch.setattr(PartRestorer, "held", slow_held)
    template, layout, _ = _own_dir_pserver(tmp_path)
    restorer = PartRestorer(template, 0, "ps0", 1, layout, '{"plan": 1}')
    _, _, running = _own_dir_pserver(tmp_path, restorer=restorer)
    with running as ps:
        results: list[str] = []
        threads = [threading.Thread(target=lambda: results.append(_raw(ps, "CheckpointList", rpc_pb2.CheckpointMessage(
            trainer_id=0))[0])) for _ in range(2)]
        for t in threads:
            t.start()
        assert entered.acquire(timeout=10) and entered.acquire(timeout=10)
        code, details = _raw(ps, "CheckpointList", rpc_pb2.CheckpointMessage(trainer_id=0), timeout=5)
        assert code == "RESOURCE_EXHAUSTED" and "checkpoint set" in details
        assert _raw(ps, "CheckpointList", rpc_pb2.CheckpointMessage(trainer_id=1, dir="x" * 2000))[0] == "RESOURCE_EXHAUSTED"
        release.set()
        for t in threads:
            t.join(20)
        assert results == ["OK", "OK"]


def test_a_refused_restore_request_fails_no_waiter_and_a_later_valid_one_is_learned(tmp_path):
    import json
    import threading

    from ops.rpc.own_dirs import PartRestorer, agree_restore, save
    from proto import rpc_pb2

    template, layout, running = _own_dir_pserver(tmp_path)
    with running as ps:
        folder = save(ps.client(0), [ps.address], template, "ckpt-2", '{"plan": 1}', 3)
    good = (folder / "MANIFEST.json").read_text()
    restorer = PartRestorer(template, 0, "ps0", 1, layout, '{"plan": 1}')
    _, _, running = _own_dir_pserver(tmp_path, restorer=restorer)
    with running as ps:
        learned: list[int] = []
        waiter = threading.Thread(target=lambda: learned.append(agree_restore(ps.client(1), [ps.address])))
        waiter.start()
        message = rpc_pb2.CheckpointMessage
        for name, text in (("ckpt-2", "[]"), ("ckpt-2", json.dumps({**json.loads(good), "parts": {"ps0": 3}})),
                           ("../ckpt-2", good), ("ckpt-2", "{" * 100000)):
            assert _raw(ps, "CheckpointRestore", message(trainer_id=0, dir=name, json=text))[0] == "INVALID_ARGUMENT"
        assert restorer.reason is None and restorer.pending
        assert agree_restore(ps.client(0), [ps.address]) == 2
        waiter.join(20)
        assert learned == [2]
