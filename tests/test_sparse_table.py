"""The pserver's sparse table: the id index (against a dict), growth while readers hold
rows, merging duplicate rows, the update block touching only the rows sent, the `save`
kernel (format, atomic), the checkpoint notice through gRPC, and merging shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sparse_table_support import ROWS, serving_ctr

from ops.executor import ExecutionError, Executor
from ops.testing import run_op
from ops.rpc import RpcError
from ops.rpc.table_io import (
    SHARD_FORMAT,
    Shard,
    TableFileError,
    merge_shards,
    read_shard,
    write_shard,
)
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows, _RowIndex
from transpiler.naming import LOOKUP_TABLE_PATH

IN0 = "prefetch_compress_in_tmp_0"


# ------------------------------------------------------------------ the index


@pytest.mark.parametrize("ids", ["rows", "hashed"])
def test_the_table_index_agrees_with_a_dict(ids, monkeypatch):
    """Row-number ids use the direct index; hashed ids (huge, negative) the sorted runs,
    whose small run is folded into the big one many times here."""
    monkeypatch.setattr(_RowIndex, "MIN_RECENT", 64)
    rng = np.random.default_rng(0)
    table = SelectedRows([], np.zeros((40_000, 1), np.float32), 10_000)
    reference: dict[int, int] = {}
    for _ in range(200):
        batch = rng.integers(-5_000, 30_000, int(rng.integers(1, 400)))
        if ids == "hashed":
            batch = batch * 1_000_003 + (1 << 50) * (batch % 3)
        slots = table.lookup_index(batch, grow=True)
        for i, slot in zip(batch.tolist(), slots.tolist(), strict=True):
            assert reference.setdefault(i, len(reference)) == slot
    assert table.rows.tolist() == sorted(reference, key=reference.get)  # first-touch order
    probe = np.array([*reference, 123_456_789_012, -77], np.int64)
    expected = [*reference.values(), -1, -1]
    assert table.lookup_index(probe, grow=False).tolist() == expected
    table._index = None  # rebuilt from `rows` alone, it answers the same
    assert table.lookup_index(probe, grow=False).tolist() == expected


def test_a_reader_s_rows_stay_a_consistent_prefix_while_the_table_grows():
    table = SelectedRows([], np.zeros((5000, 1), np.float32), 5000)
    table.lookup_index(np.arange(10), grow=True)
    held = table.rows
    for start in range(10, 5000, 97):
        table.lookup_index(np.arange(start, min(start + 97, 5000)), grow=True)
    assert held.tolist() == list(range(10)) and table.rows.tolist() == list(range(5000))


def test_merged_sums_duplicates_in_order_and_sorts_rows():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 50, 400)
    value = rng.standard_normal((400, 3)).astype(np.float32)
    merged = SelectedRows(rows, value, 50).merged()
    uniq, inverse = np.unique(rows, return_inverse=True)
    expected = np.zeros((uniq.size, 3), np.float32)
    np.add.at(expected, inverse, value)
    assert merged.rows.tolist() == uniq.tolist() and np.array_equal(merged.value, expected)  # bit for bit
    distinct = SelectedRows([5, 1, 3], np.arange(3, dtype=np.float32).reshape(3, 1), 6).merged()
    assert distinct.rows.tolist() == [1, 3, 5] and distinct.value.ravel().tolist() == [1, 2, 0]


# ------------------------------------------------------------------ updates


def test_the_table_block_updates_only_the_rows_the_trainers_sent():
    """The pserver's table block (sum of the trainers' shard grads, scale 1/2, sgd) run on
    its own scope: sent rows move by -lr * the mean grad, every other row keeps its bits,
    and a grad row for an id never seen takes the next pool row first."""
    with serving_ctr(trainers=2, sync_mode=True) as ps:
        endpoint = ps.endpoints[0]
        main, startup = ps.result.pservers[endpoint]
    scope = Scope()
    exe = Executor(seed=0)
    exe.run(startup, scope=scope)
    table = scope.find_var("emb")
    table.lookup_index([0, 2, 4, 6, 8], grow=True)
    before = table.value.copy()
    g0 = SelectedRows([2, 6, 2], np.ones((3, 16), np.float32), ROWS)
    g1 = SelectedRows([6, 10], np.full((2, 16), 3.0, np.float32), ROWS)
    scope.set_var("emb@GRAD.trainer_0.pserver_0", g0)
    scope.set_var("emb@GRAD.trainer_1.pserver_0", g1)
    listen = main.global_block().ops[0]
    block = dict(e.rsplit(":", 1) for e in listen.attr("grad_to_block_id"))["emb@GRAD"]
    exe.run(main, scope=scope, block_id=int(block))
    lr = float(scope.find_var("learning_rate_0").array.reshape(-1)[0])
    assert table.rows.tolist() == [0, 2, 4, 6, 8, 10]
    after = table.value
    for slot, mean in ((1, 1.0), (3, 2.0), (5, 1.5)):  # ids 2 (1+1)/2, 6 (1+3)/2, 10 (new: 3/2)
        np.testing.assert_allclose(after[slot], before[slot] - np.float32(lr * mean), rtol=1e-6)
    untouched = np.ones(len(after), bool)
    untouched[[1, 3, 5]] = False
    assert np.array_equal(after[untouched], before[untouched])


# ------------------------------------------------------------------ save


def test_save_writes_a_shard_atomically(tmp_path, monkeypatch):
    table = SelectedRows([], np.arange(20, dtype=np.float32).reshape(10, 2), 10)
    table.lookup_index([7, 3], grow=True)
    scope = Scope()
    scope.set_var(LOOKUP_TABLE_PATH, str(tmp_path / "ckpt" / "emb_0"))
    run_op("save", {"X": table}, (), {"file_path": "none"}, scope=scope)
    shard = read_shard(tmp_path / "ckpt" / "emb_0")
    assert shard.rows.tolist() == [7, 3] and shard.value.tolist() == [[0, 1], [2, 3]] and shard.height == 10
    with np.load(tmp_path / "ckpt" / "emb_0") as raw:
        assert sorted(raw.files) == ["format", "height", "rows", "value"] and str(raw["format"]) == SHARD_FORMAT

    original = (tmp_path / "ckpt" / "emb_0").read_bytes()

    def disk_full(out, **arrays):
        out.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    table.lookup_index([5], grow=True)
    with pytest.raises(ExecutionError, match="No space left on device"):
        run_op("save", {"X": table}, (), {"file_path": "none"}, scope=scope)
    assert (tmp_path / "ckpt" / "emb_0").read_bytes() == original  # the old shard is intact
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["emb_0"]  # and no temp file is left


def test_save_tensors_overwrite_and_missing_paths(tmp_path):
    run_op("save", {"X": np.eye(2, dtype=np.float32)}, (), {"file_path": str(tmp_path / "w.npy")})
    assert np.load(tmp_path / "w.npy").tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ExecutionError, match="exists and overwrite is false"):
        run_op("save", {"X": np.eye(2, dtype=np.float32)}, (), {"file_path": str(tmp_path / "w.npy"), "overwrite": False})
    with pytest.raises(ExecutionError, match="no path is bound to kLookupTablePath"):
        run_op("save", {"X": np.eye(2, dtype=np.float32)}, (), {"file_path": "none"})


def test_a_checkpoint_notice_saves_each_pserver_s_shard_and_the_merge_restores_the_table(tmp_path):
    with serving_ctr(checkpoint_dir=tmp_path / "ckpt") as ps:
        client = ps.client()
        rng = np.random.default_rng(2)
        ids = np.unique(rng.integers(0, ROWS, 300))
        for endpoint, name, shard in zip(ps.endpoints, (IN0, "prefetch_compress_in_tmp_1"), (0, 1), strict=True):
            mine = ids[ids % 2 == shard]
            client.prefetch_block(endpoint, name, mine)
        targets = [(ep, f"emb_{i}") for i, ep in enumerate(ps.endpoints)]
        client.checkpoint_notify_each(targets, "emb")
        tables = [ps.scopes[ep].find_var("emb") for ep in ps.endpoints]
        # a save path that is not DIR/<table>_<n> is refused before the save block runs
        with pytest.raises(RpcError, match=r"INVALID_ARGUMENT.*saved at DIR/<table>_<pserver>.*not 'emb_0/x'"):
            client.checkpoint_notify_each([(ps.endpoints[0], "emb_0/x")], "emb")
        known = ids[ids % 2 == 0][:1]
        assert client.prefetch_block(ps.endpoints[0], IN0, known).array.shape == (1, 16)  # still serving
    shards = [read_shard(tmp_path / "ckpt" / f"emb_{i}") for i in range(2)]
    for shard, table in zip(shards, tables, strict=True):
        assert shard.rows.tolist() == table.rows.tolist() and np.array_equal(shard.value, table.active_value())
    merged = merge_shards(shards, height=ROWS)
    assert merged.from_shards == ids.size and merged.per_shard == (int((ids % 2 == 0).sum()), int((ids % 2).sum()))
    for table in tables:
        np.testing.assert_array_equal(merged.table[table.rows], table.active_value())
    untouched = np.setdiff1d(np.arange(ROWS), ids)
    assert not merged.table[untouched].any()


def test_merge_refuses_shards_that_do_not_make_one_table(tmp_path):
    def shard(name: str, rows, width: int = 2, dtype=np.float32) -> Shard:
        write_shard(tmp_path / name, np.asarray(rows), np.ones((len(rows), width), dtype), 5)
        return read_shard(tmp_path / name)

    a, b = shard("a", [0, 2]), shard("b", [2, 5])
    with pytest.raises(TableFileError, match=r"id 2 is in two shards: .*a and .*b"):
        merge_shards([a, b])
    with pytest.raises(TableFileError, match="do not match"):
        merge_shards([a, shard("c", [1], width=3)])
    with pytest.raises(TableFileError, match="id 5 does not fit a table of height 4"):
        merge_shards([shard("d", [5])], height=4)
    with pytest.raises(TableFileError, match="no shards"):
        merge_shards([])
    assert merge_shards([a], fill=-1.0).table.tolist() == [[1, 1], [-1, -1], [1, 1]]
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with pytest.raises(TableFileError, match="not a table shard"):
        read_shard(tmp_path / "plain.npy")
    (tmp_path / "junk").write_bytes(b"hello")
    with pytest.raises(TableFileError, match="not a numpy .npz archive"):
        read_shard(tmp_path / "junk")
    with pytest.raises(TableFileError, match="cannot read .*: No such file"):
        read_shard(Path(tmp_path / "absent"))


def test_lookup_sparse_table_kernel_reads_the_rows_a_prefetch_created():
    """The prefetch block's kernel and a later lookup agree: same ids, same rows."""
    table = SelectedRows([], np.arange(12, dtype=np.float32).reshape(6, 2), 6)
    first = run_op("lookup_sparse_table", {"W": table, "Ids": np.array([[4], [1]], np.int64)})["Out"]
    again = run_op("lookup_sparse_table", {"W": table, "Ids": np.array([[1], [4], [9]], np.int64)})["Out"]
    assert first.tolist() == [[0, 1], [2, 3]] and again.tolist() == [[2, 3], [0, 1], [4, 5]]
    assert isinstance(table, SelectedRows) and table.rows.tolist() == [4, 1, 9]
    assert LoDTensor(first).shape == (2, 2)
