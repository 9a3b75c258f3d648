"""Prefetch through real gRPC servers: the distributed table's prefetch blocks (rows
created on first touch from the table's pool, only the requested rows sent back,
concurrent requests), a `remote_prefetch` table's blocks read by name, the `prefetch`
and `distributed_lookup_table` kernels, a sync pserver holding prefetches while it
optimizes, and the table grads a sync pserver waits for."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from rpc_support import running_pserver
from sparse_table_support import ROWS, serving_ctr

from ops.executor import ExecutionError, Executor
from ops.testing import run_op
from ops.rpc import RpcError
from ops.rpc.listen_and_serv import trainer_sent_vars
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.api import transpile
from transpiler.ir import DType, Program, VarKind

IN0, IN1 = "prefetch_compress_in_tmp_0", "prefetch_compress_in_tmp_1"


def test_a_prefetch_returns_only_the_requested_rows_creating_them_on_first_touch():
    with serving_ctr() as ps:
        ep0 = ps.endpoints[0]
        table = ps.scopes[ep0].find_var("emb")
        pool = np.array(ps.startup_value(ep0, "emb").value)  # what the initializer filled, row by row
        assert isinstance(table, SelectedRows) and table.rows.size == 0 and table.capacity == ROWS // 2
        client = ps.client()
        rows = client.prefetch_block(ep0, IN0, [8, 2, 8, 4]).array
        assert rows.shape == (4, 16) and np.array_equal(rows[0], rows[2])
        assert table.rows.tolist() == [8, 2, 4]  # first-touch order, each id once
        np.testing.assert_array_equal(rows, pool[[0, 1, 0, 2]])
        calls, sent, received = client.stats.snapshot()["PrefetchVariable"]
        assert calls == 1 and 4 * 64 <= received < 4 * 64 + 256 and sent < 4 * 8 + 256  # the rows asked for, no more

        again = client.prefetch_block(ep0, IN0, [4, 10]).array
        np.testing.assert_array_equal(again, pool[[2, 3]])  # 4 kept its row; 10 took the next one
        assert table.rows.tolist() == [8, 2, 4, 10]
        assert ps.scopes[ep0].find_var("prefetch_compress_out_tmp_0") is None  # the answer never lands in the shared scope


def test_concurrent_prefetches_agree_on_every_row():
    with serving_ctr() as ps:
        ep1 = ps.endpoints[1]
        rng = np.random.default_rng(3)
        asks = [rng.choice(np.arange(1, ROWS, 2), size=60) for _ in range(16)]
        clients = [ps.client(0) for _ in range(4)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda k: clients[k % 4].prefetch_block(ep1, IN1, asks[k]).array, range(16)))
        seen: dict[int, np.ndarray] = {}
        for ids, rows in zip(asks, answers, strict=True):
            for i, row in zip(ids.tolist(), rows, strict=True):
                assert np.array_equal(seen.setdefault(i, row), row), f"id {i} got two different rows"
        table = ps.scopes[ep1].find_var("emb")
        assert sorted(table.rows.tolist()) == sorted(seen) and len(set(table.rows.tolist())) == table.rows.size


def test_a_remote_prefetch_table_s_blocks_are_read_by_name():
    with serving_ctr("local-table", rows=2000) as ps:  # 2000 x 16 is cut in two blocks of 1000 rows
        plan = ps.result.plan.param("emb")
        (b0, b1), (ep0, ep1) = plan.blocks, plan.endpoints
        assert (b0.name, b0.rows, b1.name) == ("emb.block0", 1000, "emb.block1") and ep0 != ep1
        client = ps.client()
        block0 = ps.scopes[ep0].find_var("emb.block0").array
        np.testing.assert_array_equal(client.prefetch(ep0, "emb.block0", [7, 0, 7]).array, block0[[7, 0, 7]])
        with pytest.raises(RpcError, match=r"OUT_OF_RANGE.*prefetch id 1000 is outside the 1000 rows of emb.block0"):
            client.prefetch(ep0, "emb.block0", [1000])
        with pytest.raises(RpcError, match="NOT_FOUND.*has no table 'emb.block1'"):
            client.prefetch(ep0, "emb.block1", [0])  # that block lives on the other pserver
        with pytest.raises(RpcError, match=f"NOT_FOUND.*pserver {ep1} has no prefetch block for '{IN0}'"):
            client.prefetch_block(ep1, IN0, [0])


def test_the_prefetch_kernel_answers_each_shard_and_skips_empty_ones():
    with serving_ctr() as ps:
        client = ps.client()
        program = Program.empty()
        block = program.global_block()
        outs = ["rows_0", "rows_1"]
        for name in (IN0, IN1):
            block.create_var(name, VarKind.LOD_TENSOR, DType.INT64, (-1, 1))
        for name in outs:
            block.create_var(name, VarKind.LOD_TENSOR, DType.FP32, (-1, 16))
        block.add_op("prefetch", {"X": [IN0, IN1]}, {"Out": outs}, {"epmap": ps.endpoints})
        feed = {IN0: np.array([[0], [6]], np.int64), IN1: np.zeros((0, 1), np.int64)}  # nothing for pserver 1
        out = Executor(env={"rpc": client}).run(program, feed=feed, fetch_list=outs, scope=Scope())
        assert out[0].shape == (2, 16) and out[1].shape == (0, 16) and out[1].dtype == np.float32
        assert ps.scopes[ps.endpoints[1]].find_var("emb").rows.size == 0
        assert client.stats.snapshot()["PrefetchVariable"][0] == 1
        np.testing.assert_array_equal(out[0], client.prefetch_block(ps.endpoints[0], IN0, [0, 6]).array)


def test_distributed_lookup_table_scatters_rows_back_with_lod_and_padding():
    scope = Scope()
    blocks = [np.arange(i * 30, i * 30 + 30, dtype=np.float32).reshape(10, 3) for i in range(2)]
    scope.set_var("w.block0", LoDTensor(blocks[0]))
    scope.set_var("w.block1", LoDTensor(blocks[1]))
    whole = np.concatenate(blocks)
    with running_pserver(sync_mode=False, scope=scope) as ps:
        client = ps.client(0)
        exe = Executor(env={"rpc": client})
        attrs = {"table_names": ["w.block0", "w.block1"], "height_sections": [10, 10],
                 "endpoints": [ps.address, ps.address], "padding_idx": 3}
        seq = LoDTensor.from_lengths(np.array([[12], [3], [12], [0]], np.int64), [[3, 1]])
        flat = np.array([[19], [5]], np.int64)
        out = run_op("distributed_lookup_table", {"Ids": [seq, flat], "W": np.zeros((20, 3), np.float32)},
                     {"Outputs": 2}, attrs, executor=exe, raw=True)["Outputs"]
        np.testing.assert_array_equal(out[0].array, [whole[12], np.zeros(3), whole[12], whole[0]])
        assert out[0].lod_lists() == [[0, 3, 4]]
        np.testing.assert_array_equal(out[1].array, whole[[19, 5]])
        assert client.stats.snapshot()["PrefetchVariable"][0] == 2  # one request per block, ids deduplicated
        v2 = run_op("distributed_lookup_table", {"Ids": [np.array([[1, 11]], np.int64)], "W": whole},
                    {"Outputs": 1}, {**attrs, "lookup_table_version": "lookup_table_v2"}, executor=exe)["Outputs"]
        assert v2[0].shape == (1, 2, 3) and np.array_equal(v2[0][0], whole[[1, 11]])
        with pytest.raises(ExecutionError, match=r"id 20 is out of the table's range \[0, 20\)"):
            run_op("distributed_lookup_table", {"Ids": [np.array([[20]], np.int64)], "W": whole},
                   {"Outputs": 1}, attrs, executor=exe)


def test_a_sync_pserver_holds_prefetches_while_it_optimizes():
    scope = Scope()
    scope.set_var("t", LoDTensor(np.zeros((4, 2), np.float32)))
    entered, release = threading.Event(), threading.Event()

    def optimize(idx: int) -> None:
        entered.set()
        assert release.wait(20)
        scope.set_var("t", LoDTensor(np.ones((4, 2), np.float32)))

    with running_pserver(sync_mode=True, scope=scope, received=("g",), optimize_blocks=(1,),
                         grad_to_block={"g": 1}, run_block=optimize) as ps:
        client = ps.client(0)
        assert client.prefetch(ps.address, "t", [1]).array.tolist() == [[0, 0]]  # GET phase: served
        client.fetch_barrier([ps.address])
        client.send(ps.address, "g", np.zeros(2, np.float32))
        client.send_barrier([ps.address])
        assert entered.wait(20)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.prefetch, ps.address, "t", [1])
            state, give_up = ps.server._trainers[0], time.monotonic() + 20  # a guard against hanging, not a timing
            while not state.inflight and time.monotonic() < give_up:  # until the request is in the server
                time.sleep(0.01)
            assert state.inflight and not future.done()
            release.set()
            assert future.result(20).array.tolist() == [[1, 1]]  # the round's update, never the old rows
        client.complete([ps.address])
        ps.join()
    assert not ps.errors


def test_a_sync_pserver_waits_for_the_table_grads_x_does_not_list():
    with serving_ctr(trainers=2, sync_mode=True) as ps:
        main = ps.result.pservers[ps.endpoints[0]][0]
        listen = main.global_block().ops[0]
        mapping = dict(entry.rsplit(":", 1) for entry in listen.attr("grad_to_block_id"))
        sent = trainer_sent_vars(main, {k: int(v) for k, v in mapping.items()}, tuple(listen.input("X")))
        assert sent == ("emb@GRAD.trainer_0.pserver_0", "emb@GRAD.trainer_1.pserver_0")
    main, startup = __import__("train_ctr").build_ctr("distributed", ROWS)
    one = transpile(main, startup, pservers="127.0.0.1:1,127.0.0.1:2", trainers=1)
    pserver = one.pservers["127.0.0.1:2"][0]
    listen = pserver.global_block().ops[0]
    mapping = {k: int(v) for k, v in (e.rsplit(":", 1) for e in listen.attr("grad_to_block_id"))}
    assert trainer_sent_vars(pserver, mapping, tuple(listen.input("X"))) == ("emb@GRAD.pserver_1",)


def test_a_missing_table_grad_fails_the_sync_round_naming_it():
    with serving_ctr(trainers=1, sync_mode=True) as ps:
        ep0 = ps.endpoints[0]
        client = ps.client()
        client.fetch_barrier([ep0])
        listen = ps.result.pservers[ep0][0].global_block().ops[0]
        block = ps.result.pservers[ep0][0].global_block()
        for name in listen.input("X"):  # every dense grad, but not the table's
            var = block.var(name)
            client.send(ep0, name, np.zeros(var.shape, var.dtype.to_numpy()))
        assert block.var("emb@GRAD.pserver_0").kind == VarKind.SELECTED_ROWS
        assert block.var("emb@GRAD.pserver_0").dtype == DType.FP32
        client.send_barrier([ep0])
        with pytest.raises(RpcError, match="never arrived: emb@GRAD.pserver_0"):
            client.fetch_barrier([ep0])
