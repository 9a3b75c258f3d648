"""Checkpoints (`ops.rpc.checkpoint`): confined to the pserver's dir, atomic as a whole
(a crash at any point leaves the previous checkpoint), the newest K kept, checksums
verified, whole vars assembled from parts and cut for another pserver count."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from rpc_support import running_pserver

from ops.rpc import RpcError
from ops.rpc.checkpoint import (
    CheckpointError,
    Checkpointer,
    CheckpointPathError,
    CheckpointReader,
    VarSlice,
    confine,
    find_latest,
    job_root,
    part_root,
    warm_start,
    write_job_manifest,
)
from ops.rpc.tensor_file import encode_tensor, read_tensor, write_tensor
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows

W = np.arange(12, dtype=np.float32).reshape(6, 2)


def two_parts(root, *, keep=3):
    """pserver 0 holds rows 0-3 of `w` and a replicated `lr`; pserver 1 rows 4-5 and `lr`."""
    layouts = [
        {"w.block0": VarSlice("w", (6, 2), (0, 4)), "lr": VarSlice("lr", (1,))},
        {"w.block1": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", (1,))},
    ]
    savers = [Checkpointer(root, f"ps{i}", ("ps0", "ps1"), layout, '{"plan": 1}', keep) for i, layout in enumerate(layouts)]
    scopes = [Scope(), Scope()]
    return savers, scopes


def fill(scopes, w, lr):
    scopes[0].set_var("w.block0", LoDTensor(w[:4]))
    scopes[1].set_var("w.block1", LoDTensor(w[4:]))
    for scope in scopes:
        scope.set_var("lr", LoDTensor(np.array([lr], np.float32)))


def test_a_checkpoint_is_complete_only_when_every_part_is_in_and_its_manifest_last(tmp_path):
    savers, scopes = two_parts(tmp_path)
    fill(scopes, W, 0.5)
    folder = savers[0].save(scopes[0], "ckpt-2")
    assert not (folder / "MANIFEST.json").exists() and not (tmp_path / "latest").exists()
    assert find_latest(tmp_path, missing_ok=True) is None
    savers[1].save(scopes[1], "ckpt-2")
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert manifest["step"] == 2 and sorted(manifest["parts"]) == ["ps0", "ps1"] and manifest["plan"] == {"plan": 1}
    entry = manifest["parts"]["ps1"]["w.block1"]
    assert entry["origin"] == "w" and entry["rows"] == [4, 6] and entry["shape"] == [2, 2] and len(entry["files"]["w.block1"]) == 64
    assert (tmp_path / "latest").read_text() == "ckpt-2\n"
    reader = CheckpointReader(tmp_path)
    assert reader.step == 2 and np.array_equal(reader.whole("w"), W) and reader.origins() == ["lr", "w"]
    assert np.array_equal(read_tensor(folder / "ps0" / "w.block0"), W[:4])  # Fluid's format, one file per var


def test_restore_cuts_whole_vars_for_another_pserver_count(tmp_path):
    savers, scopes = two_parts(tmp_path)
    fill(scopes, W, 0.5)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-4")
    three = {"w.block0": VarSlice("w", (6, 2), (0, 2)), "w.block1": VarSlice("w", (6, 2), (2, 4)),
             "w.block2": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", (1,))}
    scope = Scope()
    CheckpointReader(tmp_path).restore(scope, three, "ps0", 3)
    assert [scope.find_var(f"w.block{i}").array.tolist() for i in range(3)] == [W[:2].tolist(), W[2:4].tolist(), W[4:].tolist()]
    local = Scope()
    CheckpointReader(tmp_path / "ckpt-4").restore(local, {"w": VarSlice("w", (6, 2)), "lr": VarSlice("lr", (1,))}, "local", 1)
    assert np.array_equal(local.find_var("w").array, W) and local.find_var("lr").array.tolist() == [0.5]
    with pytest.raises(CheckpointError, match="holds no var 'v'"):
        CheckpointReader(tmp_path).restore(Scope(), {"v": VarSlice("v", (1,))}, "local", 1)
    with pytest.raises(CheckpointError, match="shape \\[6, 2\\], this program's is \\[7, 2\\]"):
        CheckpointReader(tmp_path).restore(Scope(), {"w": VarSlice("w", (7, 2))}, "local", 1)


def test_a_0_d_var_saves_restores_and_warm_starts_as_0_d_and_from_1_element_files(tmp_path):
    """Paddle 2.x declares the learning rate `shape []`: its file is 0-d, it restores 0-d
    (onto any pserver count), and a `[1]` file (Fluid 1.8's scalar, or what this writer
    wrote for a 0-d var before) restores and warm starts onto the 0-d var, and back."""
    layouts = [{"w.block0": VarSlice("w", (6, 2), (0, 4)), "lr": VarSlice("lr", ())},
               {"w.block1": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", ())}]
    savers = [Checkpointer(tmp_path / "ckpt", f"ps{i}", ("ps0", "ps1"), layout) for i, layout in enumerate(layouts)]
    for i, saver in enumerate(savers):
        scope = Scope()
        scope.set_var(f"w.block{i}", LoDTensor(W[:4] if i == 0 else W[4:]))
        scope.set_var("lr", LoDTensor(np.array(0.5, np.float32)))
        folder = saver.save(scope, "ckpt-3")
    assert read_tensor(folder / "ps0" / "lr").shape == ()
    assert json.loads((folder / "MANIFEST.json").read_text())["parts"]["ps1"]["lr"]["shape"] == []
    reader = CheckpointReader(tmp_path / "ckpt")
    assert reader.whole("lr").shape == () and reader.whole("lr") == 0.5
    for layout, part, parts in (({"lr": VarSlice("lr", ())}, "ps2", 3), ({"lr": VarSlice("lr", (1,))}, "local", 1)):
        scope = Scope()
        reader.restore(scope, layout, part, parts)
        assert scope.find_var("lr").array.shape == layout["lr"].whole_shape and scope.find_var("lr").array == 0.5
    # the file of a checkpoint written before 0-d files were: [1] bytes, a manifest saying []
    lr_file = folder / "ps0" / "lr"
    lr_file.write_bytes(encode_tensor(np.array([0.5], np.float32)))
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    import hashlib

    manifest["parts"]["ps0"]["lr"]["files"]["lr"] = hashlib.sha256(lr_file.read_bytes()).hexdigest()
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    old = CheckpointReader(tmp_path / "ckpt")
    assert old.whole("lr").shape == () and old.whole("lr") == 0.5
    lr_file.write_bytes(encode_tensor(np.array([0.5, 1.0], np.float32)))  # a real mismatch stays an error
    manifest["parts"]["ps0"]["lr"]["files"]["lr"] = hashlib.sha256(lr_file.read_bytes()).hexdigest()
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"shape \[2\], the manifest says \[\]"):
        CheckpointReader(tmp_path / "ckpt").whole("lr")
    # warm start: a Fluid 1.8 [1] file onto a 0-d var, a Paddle 2.x 0-d file onto a [1] var
    write_tensor(tmp_path / "fluid18" / "lr", np.array([0.125], np.float32))
    write_tensor(tmp_path / "paddle2" / "lr", np.array(0.25, np.float32))
    for folder_name, shape, value in (("fluid18", (), 0.125), ("paddle2", (1,), 0.25)):
        scope = Scope()
        scope.set_var("lr", LoDTensor(np.zeros(shape, np.float32)))
        assert warm_start(scope, {"lr": VarSlice("lr", shape)}, tmp_path / folder_name, 2, 1) == ["lr"]
        assert scope.find_var("lr").array.shape == shape and scope.find_var("lr").array == value
    write_tensor(tmp_path / "bad" / "lr", np.array([1.0, 2.0], np.float32))
    with pytest.raises(CheckpointError, match="has shape \\[2\\]"):
        warm_start(Scope(), {"lr": VarSlice("lr", ())}, tmp_path / "bad", 1, 0)


def test_an_unrestorable_checkpoint_is_an_error_when_it_is_written(tmp_path, monkeypatch):
    """Each part is read back as a restore reads it, and the set's manifest checked before
    it exists: the reported bug (a 0-d var written [1]), a block of the wrong rows, and
    parts that do not cover a var fail the save, and no checkpoint is made complete."""
    import ops.rpc.checkpoint as checkpoint

    savers, scopes = two_parts(tmp_path / "a")
    fill(scopes, W, 0.5)
    scopes[0].set_var("lr", LoDTensor(np.array(0.5, np.float32)))
    savers[0].layout = {**savers[0].layout, "lr": VarSlice("lr", ())}
    real = checkpoint.encode_tensor
    monkeypatch.setattr(checkpoint, "encode_tensor", lambda array: real(np.ascontiguousarray(array)))  # the old writer
    with pytest.raises(CheckpointError, match=r"ckpt-1 part ps0: lr reads back as shape \[1\], PART.json says \[\]"):
        savers[0].save(scopes[0], "ckpt-1")
    assert not (tmp_path / "a" / "ckpt-1" / "ps0").exists()
    assert not [p for p in (tmp_path / "a" / "ckpt-1").iterdir() if p.name.startswith(".ps0.tmp")]  # staging removed
    monkeypatch.setattr(checkpoint, "encode_tensor", real)

    scopes[1].set_var("w.block1", LoDTensor(W[3:]))  # 3 rows where the layout says rows [4, 6)
    with pytest.raises(CheckpointError, match=r"w.block1 has shape \[3, 2\], which is not rows \[4, 6\) of w"):
        savers[1].save(scopes[1], "ckpt-1")

    gap = [Checkpointer(tmp_path / "b", f"ps{i}", ("ps0", "ps1"), layout)
           for i, layout in enumerate(({"w.block0": VarSlice("w", (6, 2), (0, 3))}, {"w.block1": VarSlice("w", (6, 2), (4, 6))}))]
    scope0, scope1 = Scope(), Scope()
    scope0.set_var("w.block0", LoDTensor(W[:3]))
    scope1.set_var("w.block1", LoDTensor(W[4:]))
    gap[0].save(scope0, "ckpt-2")
    with pytest.raises(CheckpointError, match=r"rows \[4, 6\) of w after row 3"):
        gap[1].save(scope1, "ckpt-2")
    assert not (tmp_path / "b" / "ckpt-2" / "MANIFEST.json").exists() and find_latest(tmp_path / "b", missing_ok=True) is None


def test_per_pserver_dirs_a_job_manifest_records_each_part_and_a_gathered_copy_reads(tmp_path):
    """A `{pserver}` template: each part in its pserver's own dir, no manifest there; the
    job manifest (trainer 0's) names where each part is; readers (restore onto another
    pserver count, whole vars) read the parts there, or from a gathered copy."""
    import shutil

    template = tmp_path / "disk{pserver}" / "ckpt"
    assert part_root(template, 1) == tmp_path / "disk1" / "ckpt" and job_root(template) == tmp_path / "diskjob" / "ckpt"
    layouts = [{"w.block0": VarSlice("w", (6, 2), (0, 4)), "lr": VarSlice("lr", ())},
               {"w.block1": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", ())}]
    plan = '{"plan": 2}'
    savers = [Checkpointer(part_root(template, i), f"ps{i}", ("ps0", "ps1"), layout, plan, keep=2, shared=False)
              for i, layout in enumerate(layouts)]
    for step in (2, 4, 6):
        for i, saver in enumerate(savers):
            scope = Scope()
            scope.set_var(f"w.block{i}", LoDTensor((W + step)[:4] if i == 0 else (W + step)[4:]))
            scope.set_var("lr", LoDTensor(np.array(0.5, np.float32)))
            saver.save(scope, f"ckpt-{step}")
        if step < 6:  # trainer 0's job manifest, and its copy sent to each pserver (ops.rpc.own_dirs)
            folder = write_job_manifest(template, f"ckpt-{step}", 2, plan, keep=2)
            for saver in savers:
                saver.commit(f"ckpt-{step}", json.loads((folder / "MANIFEST.json").read_text()))
    for i in range(2):  # the newest 2 committed, and ckpt-6's part (it may complete yet): no manifest copy there
        assert sorted(p.name for p in part_root(template, i).iterdir()) == ["ckpt-2", "ckpt-4", "ckpt-6", "latest"]
        assert not (part_root(template, i) / "ckpt-6" / "MANIFEST.json").exists()
    assert CheckpointReader(part_root(template, 0)).step == 4  # ckpt-6 is not complete until trainer 0 says
    assert CheckpointReader(template).step == 4  # the template reads its job root
    folder = write_job_manifest(template, "ckpt-6", 2, plan, keep=2)
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert manifest["locations"] == {f"ps{i}": str(part_root(template, i) / "ckpt-6" / f"ps{i}") for i in range(2)}
    assert sorted(p.name for p in job_root(template).iterdir()) == ["ckpt-4", "ckpt-6", "latest"]
    for saver in savers:
        saver.commit("ckpt-6", manifest)
        assert sorted(p.name for p in saver.root.iterdir()) == ["ckpt-4", "ckpt-6", "latest"]
    damaged = json.loads(json.dumps(manifest))
    damaged["parts"]["ps0"]["lr"]["files"]["lr"] = "0" * 64
    with pytest.raises(CheckpointError, match="does not describe the part on disk"):
        savers[0].commit("ckpt-6", damaged)
    with pytest.raises(CheckpointError, match="another plan"):  # ps1's vars are not this pserver's
        savers[0].commit("ckpt-6", {**manifest, "parts": {**manifest["parts"], "ps0": manifest["parts"]["ps1"]}})
    reader = CheckpointReader(template)
    assert reader.step == 6 and np.array_equal(reader.whole("w"), W + 6) and reader.whole("lr").shape == ()
    three = {"w.block2": VarSlice("w", (6, 2), (4, 6)), "lr": VarSlice("lr", ())}
    scope = Scope()
    reader.restore(scope, three, "ps2", 3)  # resharded from parts in two dirs
    assert np.array_equal(scope.find_var("w.block2").array, (W + 6)[4:])
    # a gathered copy: the parts copied beside the job manifest, the pservers' dirs gone
    gathered = tmp_path / "gathered" / "ckpt-6"
    shutil.copytree(folder, gathered)
    for i in range(2):
        shutil.copytree(part_root(template, i) / "ckpt-6" / f"ps{i}", gathered / f"ps{i}")
    shutil.rmtree(tmp_path / "disk1")
    assert np.array_equal(CheckpointReader(gathered).whole("w"), W + 6)
    with pytest.raises(CheckpointError, match="part ps1 is neither at"):
        CheckpointReader(template).whole("w")
    with pytest.raises(CheckpointError, match="part ps1 does not read"):
        write_job_manifest(template, "ckpt-6", 2, plan)
    with pytest.raises(CheckpointError, match="of step 4 or another plan"):
        write_job_manifest(template, "ckpt-4", 1, '{"plan": 3}')


def test_a_kill_between_a_manifest_and_latest_loses_nothing(tmp_path):
    """A pserver killed after it wrote ckpt-4's manifest but before `latest`: readers find
    ckpt-4 all the same, and a restarted job that asks for ckpt-4 again (it restored an
    older one) points `latest` at it rather than leaving `latest` behind."""
    savers, scopes = two_parts(tmp_path)
    for step in (2, 4):
        fill(scopes, W + step, 0.5)
        for saver, scope in zip(savers, scopes, strict=True):
            saver.save(scope, f"ckpt-{step}")
    (tmp_path / "latest").write_text("ckpt-2\n")  # as the kill left it
    assert find_latest(tmp_path).name == "ckpt-4" and CheckpointReader(tmp_path).step == 4
    savers[0].save(scopes[0], "ckpt-4")  # complete already: not rewritten, but pointed at
    assert (tmp_path / "latest").read_text() == "ckpt-4\n"
    savers[0].save(scopes[0], "ckpt-2")  # an older complete one never moves `latest` back
    assert (tmp_path / "latest").read_text() == "ckpt-4\n"


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    savers, scopes = two_parts(tmp_path)
    fill(scopes, W, 0.5)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-2")
    fill(scopes, W * 10, 0.25)
    savers[0].save(scopes[0], "ckpt-4")  # pserver 1 "dies" before its part of step 4

    import ops.rpc.checkpoint as module

    real = module.write_atomic
    calls = []

    def dies_on_the_second_file(path, write, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, write, **kw)

    monkeypatch.setattr(module, "write_atomic", dies_on_the_second_file)
    with pytest.raises(OSError):
        savers[1].save(scopes[1], "ckpt-4")
    monkeypatch.undo()
    (tmp_path / "ckpt-4" / "torn").write_bytes(b"\x00" * 7)  # whatever a kill -9 leaves
    assert [p.name for p in (tmp_path / "ckpt-4").iterdir() if p.name.startswith(".")] == []  # staging removed
    reader = CheckpointReader(tmp_path)
    assert reader.step == 2 and np.array_equal(reader.whole("w"), W)  # the previous one, whole
    assert (tmp_path / "latest").read_text() == "ckpt-2\n"
    os.unlink(tmp_path / "latest")  # even without the pointer: the newest *complete* one
    assert CheckpointReader(tmp_path).step == 2


def test_the_newest_k_complete_checkpoints_are_kept(tmp_path):
    savers, scopes = two_parts(tmp_path, keep=2)
    fill(scopes, W, 0.5)
    for step in (2, 4, 6, 8):
        for saver, scope in zip(savers, scopes, strict=True):
            saver.save(scope, f"ckpt-{step}")
    savers[0].save(scopes[0], "ckpt-10")  # incomplete: kept, and the two complete ones before it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-10", "ckpt-6", "ckpt-8", "latest"]
    assert CheckpointReader(tmp_path).step == 8
    with pytest.raises(CheckpointError, match="keep at least 1"):
        Checkpointer(tmp_path, "ps0", ("ps0",), {}, keep=0)


def test_a_damaged_file_is_refused_by_its_checksum(tmp_path):
    savers, scopes = two_parts(tmp_path)
    fill(scopes, W, 0.5)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-2")
    path = tmp_path / "ckpt-2" / "ps1" / "w.block1"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 does not match"):
        CheckpointReader(tmp_path).whole("w")


def test_a_distributed_table_restores_exactly_or_resharded(tmp_path):
    def table(ids, fill_value):
        value = np.full((6, 2), -1.0, np.float32)  # capacity 6: the pool after the rows
        value[: len(ids)] = np.asarray(ids, np.float32)[:, None] * fill_value
        return SelectedRows(ids, value, height=5)

    layout = {"emb": VarSlice("emb", (10, 2), table=True)}
    scopes = [Scope(), Scope()]
    scopes[0].set_var("emb", table([4, 0, 8], 1.0))
    scopes[1].set_var("emb", table([3], 1.0))
    for i, scope in enumerate(scopes):
        Checkpointer(tmp_path, f"ps{i}", ("ps0", "ps1"), {"emb": layout["emb"]}).save(scope, "ckpt-1")
    reader = CheckpointReader(tmp_path)
    same = Scope()
    same.set_var("emb", SelectedRows.empty(5, (2,)))
    reader.restore(same, layout, "ps0", 2)
    restored = same.find_var("emb")
    assert restored.rows.tolist() == [4, 0, 8] and restored.value.shape == (6, 2) and restored.value[3:].min() == -1
    assert restored.lookup_index([8], grow=False).tolist() == [2]
    resharded = Scope()
    resharded.set_var("emb", SelectedRows(np.zeros(0, np.int64), np.full((4, 2), 9.0, np.float32), height=4))
    reader.restore(resharded, layout, "ps0", 3)  # 3 pservers: ids % 3 == 0
    moved = resharded.find_var("emb")
    assert moved.rows.tolist() == [0, 3] and moved.value[:2, 0].tolist() == [0.0, 3.0] and moved.value[2:].min() == 9.0
    dense = reader.whole("emb")
    assert dense.shape == (10, 2) and dense[:, 0].tolist() == [0, 0, 0, 3, 4, 0, 0, 0, 8, 0]


@pytest.mark.parametrize("name", ["../evil", "/abs/path", "ckpt-1/../../x", "a//b", ".", "", "a\\b", "x y"])
def test_a_name_outside_the_dir_is_refused(tmp_path, name):
    with pytest.raises(CheckpointPathError):
        confine(tmp_path, name)


def test_the_pserver_refuses_escaping_requests_and_writes_nothing(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "ckpt-9").symlink_to(outside)
    scope = Scope()
    scope.set_var("w", LoDTensor(np.ones(2, np.float32)))
    checkpointer = Checkpointer(root, "ps0", ("ps0",), {"w": VarSlice("w", (2,))})
    with running_pserver(sync_mode=False, scope=scope, checkpointer=checkpointer) as ps:
        client = ps.client(0)
        for name, code in ((str(outside), "INVALID_ARGUMENT"), ("../outside", "INVALID_ARGUMENT"),
                           ("ckpt-9", "PERMISSION_DENIED"), ("emb_0", "INVALID_ARGUMENT")):
            with pytest.raises(RpcError, match=code):
                client.checkpoint_notify([ps.address], name)
        with pytest.raises(RpcError, match="PERMISSION_DENIED"):
            client.checkpoint_notify([ps.address], "ckpt-9", lookup_table="w")
        client.checkpoint_notify([ps.address], "ckpt-1")  # still serving, and a good name works
    assert list(outside.iterdir()) == [] and sorted(p.name for p in root.iterdir()) == ["ckpt-1", "ckpt-9", "latest"]
    with running_pserver(sync_mode=False, scope=scope) as ps:
        with pytest.raises(RpcError, match="FAILED_PRECONDITION.*without a checkpoint dir"):
            ps.client(0).checkpoint_notify([ps.address], "ckpt-1")


def test_a_complete_checkpoint_is_never_rewritten(tmp_path):
    savers, scopes = two_parts(tmp_path)
    fill(scopes, W, 0.5)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-2")
    fill(scopes, W * 3, 0.25)
    savers[0].save(scopes[0], "ckpt-2")  # a restored job at step 2 asking again
    assert np.array_equal(CheckpointReader(tmp_path).whole("w"), W)


def test_a_manifest_naming_files_outside_its_folder_is_refused(tmp_path):
    savers, scopes = two_parts(tmp_path)
    fill(scopes, W, 0.5)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-2")
    path = tmp_path / "ckpt-2" / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["parts"]["../.."] = manifest["parts"].pop("ps1")
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        CheckpointReader(tmp_path)


def test_what_a_kill_9_mid_save_leaves_is_ignored_then_pruned(tmp_path):
    """A SIGKILLed pserver runs no cleanup: its staging folder stays, half written. The
    previous checkpoint is still the one restored; the restarted job's save of that step
    completes beside the leftover, and pruning removes it with its checkpoint."""
    savers, scopes = two_parts(tmp_path, keep=1)
    fill(scopes, W, 0.5)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-2")
    savers[0].save(scopes[0], "ckpt-4")
    dead = tmp_path / "ckpt-4" / ".ps1.tmp-dead"
    dead.mkdir()
    (dead / "w.block1").write_bytes(b"\x00" * 9)  # torn, and no PART.json
    assert CheckpointReader(tmp_path).step == 2
    fill(scopes, W * 2, 0.25)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-4")
    assert CheckpointReader(tmp_path).step == 4 and np.array_equal(CheckpointReader(tmp_path).whole("w"), W * 2)
    for saver, scope in zip(savers, scopes, strict=True):
        saver.save(scope, "ckpt-6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-6", "latest"]  # keep=1: the leftover went with ckpt-4
