"""The cost model (transpiler/cost.py): predicted memory equals what the pserver programs
declare, on every Paddle-built fixture and real model and under the other partitioners;
traffic, RPC and compute figures on hand-worked cases; id statistics."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from conftest import PADDLE_CASES, PADDLE_PROGRAMS, REAL_MODEL_CASES, load_case_json
from transpiler.api import transpile
from transpiler.cost import (
    DEFAULT_OP_US, MEMORY_KINDS, SUM_ON_ARRIVAL, Cost, IdStats, Job, Rates, block_cost, declared_memory, load_rates,
    parse_bytes, plan_costs, sums_on_arrival,
    PREFETCH_BANDWIDTH, SYNC_SPARSE_BANDWIDTH, read_id_sample, var_bytes,
)
from transpiler.errors import TranspileError
from transpiler.ir import Program
from transpiler.ir.types import DType


def _transpile(case: str, **overrides):
    folder = PADDLE_PROGRAMS / case
    spec, _ = load_case_json(folder)
    kwargs = dict(pservers=spec["pservers"], trainers=spec["trainers"], trainer_id=spec["trainer_id"],
                  sync_mode=spec["sync_mode"], slice_var_up=spec["slice_var_up"], split_method=spec["split_method"],
                  min_block_size=spec["min_block_size"], clip_mode="trainer")
    kwargs.update(overrides)
    return transpile(Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"), **kwargs)


def _check_exact(result) -> None:
    predicted = {row.endpoint: row for row in plan_costs(result.plan)}
    for endpoint, (main, _) in result.pservers.items():
        declared = declared_memory(result.plan, endpoint, main)
        total = sum(var_bytes(v) for v in main.global_block().vars.values())
        assert declared.total == total, endpoint  # every declared var is counted once
        for kind in MEMORY_KINDS[:-1]:
            assert predicted[endpoint].cost.memory[kind] == declared.memory[kind], (endpoint, kind)
        # `other` is what the model does not predict: the learning rate (a 0-d var), decay
        # counters, norms, a clip's temporaries; never a param, grad or accumulator
        blocks = {b.name for p in result.plan.params for b in p.blocks}
        assert not any(k == "other" and n in blocks for n, k in declared.kinds.items()), endpoint


@pytest.mark.parametrize("case", PADDLE_CASES + REAL_MODEL_CASES)
def test_predicted_memory_equals_declared_vars(case):
    _check_exact(_transpile(case))


@pytest.mark.parametrize("case,overrides", [
    ("mlp_adam_2ps", dict(partitioner="angel", trainers=3)),
    ("mlp_adam_2ps", dict(partitioner="column", sync_mode=False)),
    ("ctr_v1_dist_sgd_2ps", dict(trainers=1)),
    ("ctr_v1_dist_sgd_2ps", dict(trainers=3, sync_mode=False)),
    ("ctr_v1_sparse_sgd_2ps", dict(partitioner="column", trainers=3)),
    ("gpt_adam_3ps_sync", dict(partitioner="angel", pservers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4")),
])
def test_predicted_memory_equals_declared_vars_other_partitioners(case, overrides):
    _check_exact(_transpile(case, **overrides))


def test_float64_memory_doubles():
    from transpiler.ir.precision import as_float64

    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    main, startup = as_float64(Program.load(folder / "main.pb")), as_float64(Program.load(folder / "startup.pb"))
    result = transpile(main, startup, pservers="127.0.0.1:1,127.0.0.1:2", trainers=2)
    _check_exact(result)
    ours = plan_costs(result.plan)
    theirs = plan_costs(_transpile("mlp_adam_2ps").plan)
    assert [r.cost.memory_bytes for r in ours] == [2 * r.cost.memory_bytes for r in theirs]


def test_issue_mlp_adam_figure():
    """The issue's example: `plan` said 468 KB for a pserver that declares 2.81 MB."""
    result = _transpile("mlp_adam_2ps")
    main = result.pservers["127.0.0.1:6170"][0]
    declared = declared_memory(result.plan, "127.0.0.1:6170", main)
    assert declared.memory["params"] == 468008
    assert declared.total == sum(var_bytes(v) for v in main.global_block().vars.values())
    assert 2.7e6 < declared.total < 2.9e6


def test_dense_block_traffic_and_compute():
    rates = Rates(bandwidth=1e9, rpc_us=100.0, op_us={"sum": 0.001, "scale": 0.002, "sgd": 0.003, "adam": 0.01},
                  var_us=10.0, block_us=7.0, big_var_us=0.0)
    cost = block_cost("adam", DType.FP32, 0, 100, 10, Job(trainers=4), rates)
    n = 1000
    assert cost.memory == {"params": 4 * n, "optimizer_state": 4 * (2 * n + 2), "grad_buffers": 4 * 4 * n,
                           "merged_grads": 4 * n, "table": 0, "other": 0}
    assert cost.bytes_in == cost.bytes_out == 4 * 4 * n
    assert cost.rpcs == 0 and cost.vars == 8  # in the send and fetch batches, a grad in and a param out a trainer
    assert cost.compute_us == pytest.approx(3 * n * 0.001 + n * 0.002 + n * 0.01 + 7.0)  # one block run a step
    assert cost.time_us(rates) == pytest.approx(cost.compute_us + 2 * 16000 / 1e9 * 1e6 + 80)
    one = block_cost("sgd", DType.FP64, 0, 10, 1, Job(trainers=1), rates)
    assert one.memory["grad_buffers"] == 0 and one.memory["params"] == 80
    async_cost = block_cost("sgd", DType.FP32, 0, 100, 10, Job(trainers=3, sync_mode=False), rates)
    assert async_cost.memory["grad_buffers"] == 0
    assert async_cost.compute_us == pytest.approx(3 * n * 0.003 + 3 * 7.0)  # the block runs per trainer's grad


def test_a_big_dense_grad_is_summed_on_arrival_a_small_one_by_the_sum_op():
    """A sync pserver with 2+ trainers sums a dense grad of `arrival_sum.MIN_BYTES` (256 kB)
    or more as its copies arrive (`sum_on_arrival` per element added), a smaller one by the
    optimize block's `sum` op; one trainer sums nothing, an async pserver neither: hand-worked
    figures on both sides of the threshold, float32 and float64."""
    from ops.rpc.arrival_sum import MIN_BYTES

    rates = Rates(bandwidth=1e9, rpc_us=0.0, var_us=0.0, block_us=5.0,
                  op_us={"sum": 0.004, SUM_ON_ARRIVAL: 0.001, f"{SUM_ON_ARRIVAL}@fp64": 0.003, "sum@fp64": 0.009,
                         "scale": 0.0, "scale@fp64": 0.0, "sgd": 0.0, "sgd@fp64": 0.0})
    big = MIN_BYTES // 4  # float32 elements: exactly at the threshold
    at = block_cost("sgd", DType.FP32, 0, big // 64, 64, Job(trainers=3), rates)
    assert at.compute_us == pytest.approx(2 * big * 0.001 + 5.0)  # two copies added on arrival, no `sum`
    below = block_cost("sgd", DType.FP32, 0, big // 64 - 1, 64, Job(trainers=3), rates)
    assert below.compute_us == pytest.approx(2 * (big - 64) * 0.004 + 5.0)  # the `sum` op
    wide = block_cost("sgd", DType.FP64, 0, big // 128, 64, Job(trainers=2), rates)  # MIN_BYTES in float64
    assert wide.compute_us == pytest.approx(big // 2 * 0.003 + 5.0)
    narrow = block_cost("sgd", DType.FP64, 0, big // 128 - 1, 64, Job(trainers=2), rates)
    assert narrow.compute_us == pytest.approx((big // 2 - 64) * 0.009 + 5.0)
    assert block_cost("sgd", DType.FP32, 0, big, 1, Job(trainers=1), rates).compute_us == pytest.approx(5.0)
    assert block_cost("sgd", DType.FP32, 0, big, 1, Job(trainers=2, sync_mode=False), rates).compute_us == \
        pytest.approx(2 * 5.0)
    # the memory is what the programs declare, summed on arrival or not: a buffer per trainer
    assert at.memory["grad_buffers"] == 3 * MIN_BYTES and below.memory["grad_buffers"] == 3 * (MIN_BYTES - 256)
    assert sums_on_arrival(MIN_BYTES, Job(2)) and not sums_on_arrival(MIN_BYTES - 1, Job(2))
    assert not sums_on_arrival(MIN_BYTES, Job(1)) and not sums_on_arrival(MIN_BYTES, Job(2, sync_mode=False))


@pytest.mark.parametrize("case", ["mlp", "mlp-fp64", "edge"])
def test_the_model_sums_on_arrival_exactly_the_grads_a_real_pserver_does(monkeypatch, case):
    """The Paddle-built MLP (2 trainers, 2 pservers, float32 and float64) and two fc layers
    on one pserver whose weights are one row under and exactly 256 kB (`edge`): each real
    pserver, started with the default settings, skips the `sum` ops of the grads the model
    prices as summed on arrival (`server.skip_ops`) and keeps the others' (their sizes
    compared, pserver by pserver)."""
    import threading

    from ops.rpc import bulk
    from ops.rpc.serve import serve_program
    from ops.rpc.service import NONFINITE_ENV
    from transpiler.api import as_float64
    from transpiler.runtime.launch import free_endpoints

    monkeypatch.delenv(bulk.BULK_ENV, raising=False)
    monkeypatch.delenv(NONFINITE_ENV, raising=False)
    if case == "edge":
        from transpiler.calibrate import dense_programs

        main, startup = dense_programs(2, 256, 255)  # weights [255, 256] and [256, 256] float32
        eps = free_endpoints(1)
    else:
        folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
        main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
        if case == "mlp-fp64":
            main, startup = as_float64(main), as_float64(startup)
        eps = free_endpoints(2)
    result = transpile(main, startup, pservers=eps, trainers=2)
    job = Job(2)
    seen = 0
    for endpoint in eps:
        model = {True: [], False: []}
        for param in result.plan.params:
            for block, where in zip(param.blocks, param.endpoints, strict=True):
                if where == endpoint:
                    size = block.rows * (block.cols or math.prod(param.shape[1:])) * param.dtype.itemsize
                    model[sums_on_arrival(size, job)].append(size)
        program, program_startup = result.pservers[endpoint]
        started, done = threading.Event(), threading.Event()
        found = {}

        def ready(server, found=found, started=started, done=done):
            found["skip"] = set(server.skip_ops)
            started.set()
            done.wait(30)
            server.stop()

        thread = threading.Thread(target=serve_program, args=(program, program_startup),
                                  kwargs=dict(endpoint=endpoint, ready=ready, log=None, timeout=30.0), daemon=True)
        thread.start()
        assert started.wait(60)
        done.set()
        thread.join(30)
        runtime = {True: [], False: []}
        for block in program.blocks:
            for i, op in enumerate(block.ops):
                if op.type == "sum" and i == 0:
                    out = block.var(op.outputs["Out"][0]) if block.has_var(op.outputs["Out"][0]) else \
                        program.global_block().var(op.outputs["Out"][0])
                    runtime[(block.idx, i) in found["skip"]].append(var_bytes(out))
        assert sorted(runtime[True]) == sorted(model[True]) and sorted(runtime[False]) == sorted(model[False])
        seen += len(model[True])
    assert seen == (1 if case == "edge" else 2)  # the 256 kB weight; a block of `h1.w` on each pserver


def test_a_rate_table_without_the_arrival_add_prices_it_as_the_sum_op():
    """`Rates` built in Python with an op table that lacks `sum_on_arrival` price the adds
    at the `sum` op's rate (float64: twice that, as an op without an `@fp64` rate); the defaults and a
    rates file carry their own."""
    rates = Rates(op_us={"sum": 0.002, "sum@fp64": 0.005})
    assert rates.op(SUM_ON_ARRIVAL) == 0.002 and rates.op(SUM_ON_ARRIVAL, DType.FP64) == pytest.approx(0.004)
    assert Rates().op(SUM_ON_ARRIVAL) == DEFAULT_OP_US[SUM_ON_ARRIVAL]
    assert Rates().op(SUM_ON_ARRIVAL, DType.FP64) == DEFAULT_OP_US[f"{SUM_ON_ARRIVAL}@fp64"]


def test_sparse_costs_count_grad_rows_per_lookup_and_whole_copies():
    """A lookup's grad carries a row per lookup (ids repeat); `adagrad` on a SelectedRows
    grad copies its whole param and moment on an async pserver (`SPARSE_COPIES`), not on a
    sync one; `sgd` does not; a column cut
    pays the per-row cost on every range."""
    rates = Rates(bandwidth=1e9, rpc_us=0.0, op_us={"sum": 0.0, "scale": 0.0, "sgd": 0.0, "adagrad": 0.0},
                  row_us=0.0, var_us=0.0, block_us=0.0, id_us=0.5, copy_us=0.001, merge_us=0.0, update_row_us=0.0)
    stats = IdStats.from_sample(np.array([0] * 90 + list(range(1, 11))), height=100, ids_per_step=50)
    sgd = block_cost("sgd", DType.FP32, 0, 100, 8, Job(trainers=2), rates, sparse=True, ids=stats)
    assert sgd.lookups == pytest.approx(100.0) and sgd.rows < 20
    assert sgd.bytes_in == pytest.approx(100 * (8 * 4 + 8))  # 50 rows per trainer, duplicates included
    assert sgd.compute_us == pytest.approx(100 * 0.5)
    ada = block_cost("adagrad", DType.FP32, 0, 100, 8, Job(trainers=2), rates, sparse=True, ids=stats)
    assert ada.compute_us == pytest.approx(100 * 0.5)  # a sync pserver updates the rows in place
    ada = block_cost("adagrad", DType.FP32, 0, 100, 8, Job(trainers=2, sync_mode=False), rates, sparse=True, ids=stats)
    assert ada.compute_us == pytest.approx(100 * 0.5 + 2 * 2 * 800 * 0.001)  # async: param + moment copied per grad
    halves = [block_cost("sgd", DType.FP32, 0, 100, 4, Job(trainers=2), rates, sparse=True, ids=stats)
              for _ in range(2)]
    assert sum(h.compute_us for h in halves) == pytest.approx(2 * sgd.compute_us)  # every id on both ranges


def test_a_trainer_that_merges_its_sparse_grad_sends_a_row_per_distinct_id():
    """`merged` (the trainer sums several lookups' grads, a MergeAdd, before sending): each
    trainer's grad carries a row per distinct id of its step, so its bytes, merge and
    per-row work follow the distinct rows, not the lookups; the lookups, the rows fetched
    and updated are the same either way."""
    rates = Rates(bandwidth=1e9, sync_sparse_bandwidth=1e8, rpc_us=0.0, row_us=0.25, var_us=0.0, block_us=0.0,
                  id_us=0.5, copy_us=0.0, merge_us=0.01, update_row_us=0.0,
                  op_us={"sum": 0.0, "scale": 0.0, "sgd": 0.0, "adagrad": 0.0})
    stats = IdStats.from_sample(np.array([0] * 90 + list(range(1, 11))), height=100, ids_per_step=50)
    _, one = stats.rows(0, 100, 1)  # distinct ids of one trainer's 50
    assert one < 10  # row 0 is 90% of the lookups
    each = block_cost("adagrad", DType.FP32, 0, 100, 8, Job(2), rates, sparse=True, prefetch=True, ids=stats)
    merged = block_cost("adagrad", DType.FP32, 0, 100, 8, Job(2), rates, sparse=True, prefetch=True, ids=stats,
                        merged=True)
    assert (merged.lookups, merged.rows, merged.bytes_out) == (each.lookups, each.rows, each.bytes_out)
    assert each.bytes_in == pytest.approx(100 * (8 * 4 + 8) + 2 * one * 8)  # + the ids prefetched
    assert merged.bytes_in == pytest.approx(2 * one * (8 * 4 + 8) + 2 * one * 8)
    assert each.compute_us == pytest.approx(100 * (0.25 + 8 * 0.01 + 0.5))
    assert merged.compute_us == pytest.approx(2 * one * (0.25 + 8 * 0.01 + 0.5))
    saved = (100 - 2 * one) * ((8 * 4 + 8) / 1e8 * 1e6 + 0.25 + 8 * 0.01 + 0.5)
    assert each.time_us(rates) - merged.time_us(rates) == pytest.approx(saved)
    uniform = IdStats.uniform_rows(100_000, 50)  # ids that barely repeat: the same cost
    a = block_cost("sgd", DType.FP32, 0, 100_000, 8, Job(2), rates, sparse=True, ids=uniform)
    b = block_cost("sgd", DType.FP32, 0, 100_000, 8, Job(2), rates, sparse=True, ids=uniform, merged=True)
    assert b.time_us(rates) == pytest.approx(a.time_us(rates), rel=1e-3)


def test_the_plan_says_whether_the_trainer_merges_a_sparse_grad():
    """A table looked up several times (the CTR net's three slots: their grads summed, a
    MergeAdd) sends merged rows; a single lookup's grad is sent as it is, a row per lookup
    (`ParamPlan.merged_grad`, which `plan_costs` prices)."""
    import sys

    from pass_support import tiny

    sys.path.insert(0, str(PADDLE_PROGRAMS.parents[2] / "examples"))
    try:
        import train_ctr
    finally:
        sys.path.pop(0)

    main, startup = train_ctr.build_ctr("local-table", 1000, 8)
    ctr = transpile(main, startup, pservers=["127.0.0.1:1", "127.0.0.1:2"], trainers=2)
    assert [(p.param, p.merged_grad) for p in ctr.plan.params if p.sparse] == [("emb", True)]
    main, startup = tiny(embedding="sparse")
    single = transpile(main, startup, pservers=["127.0.0.1:1", "127.0.0.1:2"], trainers=2)
    assert [(p.param, p.merged_grad) for p in single.plan.params if p.sparse] == [("emb", False)]
    stats = {"emb": IdStats.from_sample(np.array([0] * 90 + list(range(1, 11))), height=1000, ids_per_step=50)}
    merged = plan_costs(ctr.plan, Rates(), stats)
    for param in ctr.plan.params:
        param.merged_grad = False
    each = plan_costs(ctr.plan, Rates(), stats)
    assert sum(r.cost.bytes_in for r in merged) < sum(r.cost.bytes_in for r in each)


def test_a_sparse_update_costs_update_row_us_per_distinct_row_it_writes():
    """`update_row_us` is paid once per distinct row a sparse update writes: on a sync
    pserver the rows distinct across the trainers, on an async one each trainer's rows per
    run; not by an optimizer that updates every row (plain Adam), and by the distributed
    table's `sgd` per row merged."""
    from transpiler.cost import table_shard_cost
    from transpiler.plan import TablePlan

    zero = Rates(bandwidth=1e12, sparse_bandwidth=1e12, rpc_us=0.0, row_us=0.0, var_us=0.0, block_us=0.0, id_us=0.0,
                 merge_us=0.0, copy_us=0.0, fault_us=0.0, update_row_us=0.0,
                 op_us={"sum": 0.0, "scale": 0.0, "sgd": 0.0, "adagrad": 0.0, "adam": 0.0})
    rows = dataclasses.replace(zero, update_row_us=0.5)
    stats = IdStats.from_sample(np.array([0] * 90 + list(range(1, 11))), height=100, ids_per_step=50)
    _, distinct_all = stats.rows(0, 100, 2)
    _, distinct_one = stats.rows(0, 100, 1)
    assert distinct_one < distinct_all < 2 * distinct_one  # the hot id is shared by both trainers
    for optimizer in ("sgd", "adagrad"):
        sync = block_cost(optimizer, DType.FP32, 0, 100, 8, Job(2), rows, sparse=True, ids=stats)
        assert sync.compute_us == pytest.approx(0.5 * distinct_all)
        asyn = block_cost(optimizer, DType.FP32, 0, 100, 8, Job(2, False), rows, sparse=True, ids=stats)
        assert asyn.compute_us == pytest.approx(0.5 * 2 * distinct_one)
        assert block_cost(optimizer, DType.FP32, 0, 100, 8, Job(2), zero, sparse=True, ids=stats).compute_us == 0.0
    dense_adam = block_cost("adam", DType.FP32, 0, 100, 8, Job(2), rows, sparse=True, ids=stats,
                            optimizer_attrs={"lazy_mode": False})
    assert dense_adam.compute_us == 0.0  # every row updated: the per-element rates alone
    table = TablePlan("emb", "", (100, 8), DType.FP32, ("a", "b"))
    merged = sum(stats.residue_rows(shard, 2, 2)[1] for shard in range(2))
    shards = sum(table_shard_cost(table, shard, Job(2), rows, stats).compute_us for shard in range(2))
    assert shards == pytest.approx(0.5 * merged)


def test_calibration_rates_round_trip_and_refuse_negative(tmp_path):
    rates = Rates(block_us=12.0, id_us=0.25, copy_us=0.002, source="x")
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(rates.to_json()))
    back = load_rates(path)
    assert (back.block_us, back.id_us, back.copy_us) == (12.0, 0.25, 0.002)
    older = {k: v for k, v in rates.to_json().items() if k != "update_row_us"}  # a file from before the term
    path.write_text(json.dumps(older))
    assert load_rates(path).update_row_us == Rates().update_row_us
    path.write_text(json.dumps(dataclasses.replace(rates, update_row_us=0.7).to_json()))
    assert load_rates(path).update_row_us == 0.7
    bad = rates.to_json() | {"id_us": -1.0}
    path.write_text(json.dumps(bad))
    with pytest.raises(TranspileError, match="rates must be positive"):
        load_rates(path)


def test_sparse_block_rows_follow_the_id_distribution():
    rates = Rates()
    ids = np.array([0] * 90 + list(range(1, 11)))  # row 0 is 90% of the lookups
    stats = IdStats.from_sample(ids, height=100, ids_per_step=50)
    hot = block_cost("sgd", DType.FP32, 0, 50, 8, Job(trainers=2), rates, sparse=True, prefetch=True, ids=stats)
    cold = block_cost("sgd", DType.FP32, 50, 50, 8, Job(trainers=2), rates, sparse=True, prefetch=True, ids=stats)
    assert hot.lookups == pytest.approx(100.0)  # 2 trainers x 50 ids, all in rows [0, 50)
    assert cold.lookups == 0 and cold.bytes_in == 0 and cold.bytes_out == 0
    distinct = 1 + sum(1 - (1 - 0.01) ** 50 for _ in range(10))
    assert hot.rows == pytest.approx(2 * distinct)
    assert hot.bytes_out == pytest.approx(2 * distinct * 8 * 4)
    assert hot.rpcs == cold.rpcs == 2  # a prefetch call per trainer


def test_pserver_rpcs_are_one_send_fetch_batch_per_trainer_in_sync_mode_two_in_async():
    """A sync trainer sends each pserver ONE `SendFetchBatch` a step (its grads, the send
    barrier, the params it fetches, the fetch barrier: `RpcClient.send_barrier(defer=True)`);
    an async one a `SendBatch` and a `FetchBatch` (`cost.batch_rpcs`). Priced at `rpc_us`
    each: three trainers, 3 RPCs a pserver in sync mode, 6 in async mode."""
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    for sync, calls in ((True, 3), (False, 6)):
        result = transpile(Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"),
                           pservers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", trainers=3, slice_var_up=False,
                           sync_mode=sync)
        rows = plan_costs(result.plan)
        for row in rows:
            assert row.cost.rpcs == (calls if row.partitions else 0)
            assert row.cost.vars == 6 * len(row.partitions)
        rates = Rates(rpc_us=1000.0, bulk_rpc_us=1000.0)  # a call is a call, on gRPC or the bulk channel
        priced = plan_costs(result.plan, rates)
        free = plan_costs(result.plan, dataclasses.replace(rates, rpc_us=0.0, bulk_rpc_us=0.0))
        for row, base in zip(priced, free, strict=True):
            assert row.time_us - base.time_us == pytest.approx(1000.0 * (calls if row.partitions else 0))


def test_id_stats_uniform_and_residues():
    uniform = IdStats.uniform_rows(1000, 100)
    lookups, rows = uniform.rows(0, 500)
    assert lookups == pytest.approx(50)
    assert rows == pytest.approx(500 * (1 - (1 - 1e-3) ** 100))
    sample = IdStats.from_sample(np.arange(12) % 4, height=12, ids_per_step=8)
    assert sample.residue_rows(0, 2)[0] == pytest.approx(4)
    assert sample.residue_rows(1, 4)[1] == pytest.approx(1 - 0.75 ** 8)
    with pytest.raises(TranspileError, match="outside the table's 12 rows"):
        IdStats.from_sample(np.array([3, 12]), height=12, ids_per_step=1)


def test_read_id_sample(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([[1, 2], [3, 4]], dtype=np.int64))
    assert read_id_sample(tmp_path / "ids.npy").shape == (2, 2)
    (tmp_path / "ids.txt").write_text("1 2 3\n4,5,6\n")
    assert read_id_sample(tmp_path / "ids.txt").tolist() == [[1, 2, 3], [4, 5, 6]]
    (tmp_path / "bad.txt").write_text("1 x\n")
    with pytest.raises(TranspileError, match="cannot read ids"):
        read_id_sample(tmp_path / "bad.txt")
    np.save(tmp_path / "f.npy", np.array([1.5]))
    with pytest.raises(TranspileError, match="must be integers"):
        read_id_sample(tmp_path / "f.npy")


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("1.5KB") == 1500
    assert parse_bytes("100") == 100
    with pytest.raises(TranspileError, match="not a size"):
        parse_bytes("eight gigs")


def test_rates_file_round_trip(tmp_path):
    import json

    rates = Rates(bandwidth=2e9, rpc_us=80.0, source="x")
    (tmp_path / "r.json").write_text(json.dumps(rates.to_json()))
    back = load_rates(tmp_path / "r.json")
    assert back.bandwidth == 2e9 and back.rpc_us == 80.0 and back.op("adam") == rates.op("adam")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TranspileError, match="not a `pstranspile calibrate` file"):
        load_rates(tmp_path / "bad.json")
    with pytest.raises(TranspileError, match="no rate for op 'relu'"):
        rates.op("relu")
    assert math.isfinite(rates.op("lamb"))


def test_resident_bytes_counts_sparse_grads_by_rows_and_kept_step_copies():
    """A pserver's run-time memory: a sparse grad holds its rows, not its declared height;
    Adagrad's step copies (async pservers; a sync one updates in place) count while a block's
    arrays stay under the malloc mmap threshold (their freed pages are kept), not above it."""
    from ops.rpc.malloc import MMAP_THRESHOLD
    from transpiler.cost import resident_bytes

    sys_path = str(PADDLE_PROGRAMS.parents[2] / "examples")
    import sys

    sys.path.insert(0, sys_path)
    try:
        import train_ctr
    finally:
        sys.path.remove(sys_path)
    eps = ["127.0.0.1:1", "127.0.0.1:2"]
    for rows, copies, sync in ((1000, True, False), (2 * (MMAP_THRESHOLD // 256) + 2000, False, False),
                               (1000, False, True)):  # async blocks under / over it; sync: updated in place
        main, startup = train_ctr.build_ctr("local-table", rows, 64)
        plan = transpile(main, startup, pservers=eps, trainers=2, sync_mode=sync).plan
        stats = {"emb": IdStats.uniform_rows(rows, 100)}
        found = [resident_bytes(plan, ep, stats) for ep in eps]
        emb = plan.param("emb")
        block_bytes = [b.rows * 64 * 4 for b in emb.blocks]
        assert sum(f["params"] for f in found) == sum(block_bytes) + 4 * sum(
            math.prod(p.shape) for p in plan.params if p.param != "emb")
        kept = sum(2 * b for b in block_bytes if b < MMAP_THRESHOLD) if not sync else 0
        assert sum(f["step_copies"] for f in found) == kept and (kept > 0) == copies
        assert sum(f["grads"] for f in found) < 4 * 1024 * 1024 + 4 * 4 * sum(
            math.prod(p.shape) for p in plan.params if p.param != "emb")  # rows, not the table's height


def test_calibrate_measures_a_real_pserver_and_the_sparse_block():
    """The calibration's real-pserver and sparse-block measurements run end to end (small
    sizes) and give figures in their units: a request costs CPU, a sparse Adagrad copies
    its block (the copy rate is within 1000x of memcpy's), rows cost more than nothing."""
    from transpiler.calibrate import measure_pserver, measure_sparse_block

    block = measure_sparse_block(rows=20_000, counts=(100, 1600), repeat=3, big_rows=None)
    assert 1e-5 < block["copy_us"] < 1e-1 and block["row_us"] >= 0 and block["merge_elem_us"] >= 0
    assert block["lookup_us"] > 0 and block["update_row_us"] >= 0  # a merged row costs CPU
    real = measure_pserver(100.0, 2e8, 0.002, 0.1, calls=60, id_counts=(128, 4096), repeat=30, width=16)
    assert real["rpc_us"] > 0 and real["row_cpu_us"] > 0
    assert min(real["var_us"], real["block_us"], real["id_us"]) >= 0


def test_sparse_copies_over_the_mmap_threshold_cost_fresh_pages():
    from ops.rpc.malloc import MMAP_THRESHOLD

    rates = Rates(copy_us=0.001, fault_us=0.0005, block_us=0.0, id_us=0.0, row_us=0.0, merge_us=0.0,
                  op_us={"sum": 0.0, "scale": 0.0, "adagrad": 0.0, "sgd": 0.0})
    stats = IdStats.uniform_rows(10_000_000, 1)
    rows = MMAP_THRESHOLD // 256  # [rows, 64] fp32: exactly the threshold
    under = block_cost("adagrad", DType.FP32, 0, rows - 1, 64, Job(2, False), rates, sparse=True, ids=stats)
    over = block_cost("adagrad", DType.FP32, 0, rows, 64, Job(2, False), rates, sparse=True, ids=stats)
    assert under.compute_us == pytest.approx(2 * 2 * (rows - 1) * 64 * 0.001, rel=1e-3)  # async: per trainer's grad
    assert over.compute_us == pytest.approx(2 * 2 * rows * 64 * 0.0015, rel=1e-3)


def test_sparse_bytes_go_at_their_own_rate_dense_at_the_bandwidth():
    """A sparse grad's rows (and prefetched rows) are priced at `sparse_bandwidth`, a dense
    param's bytes at `bandwidth`: hand-worked figures."""
    rates = Rates(bandwidth=1e9, sparse_bandwidth=1e8, sync_sparse_bandwidth=1e8, rpc_us=0.0, op_us={"sum": 0.0, "scale": 0.0, "sgd": 0.0},
                  row_us=0.0, var_us=0.0, block_us=0.0, id_us=0.0, merge_us=0.0, update_row_us=0.0, big_var_us=0.0)
    stats = IdStats.uniform_rows(100, 10)
    fetched = block_cost("sgd", DType.FP32, 0, 100, 8, Job(trainers=2), rates, sparse=True, ids=stats)
    assert fetched.sparse_bytes == pytest.approx(fetched.bytes_in) == pytest.approx(2 * 10 * (8 * 4 + 8))
    assert fetched.bytes_out == 2 * 100 * 8 * 4  # the whole block to each trainer: dense
    assert fetched.time_us(rates) == pytest.approx(800 / 1e8 * 1e6 + 6400 / 1e9 * 1e6)
    prefetched = block_cost("sgd", DType.FP32, 0, 100, 8, Job(trainers=2), rates, sparse=True, prefetch=True,
                            ids=stats)
    assert prefetched.sparse_bytes == pytest.approx(prefetched.bytes_in + prefetched.bytes_out)
    dense = block_cost("sgd", DType.FP32, 0, 100, 8, Job(trainers=2), rates)
    assert dense.sparse_bytes == 0 and dense.time_us(rates) == pytest.approx(2 * 6400 / 1e9 * 1e6)
    total = Cost()
    total.add(fetched)
    total.add(dense)
    assert total.sparse_bytes == fetched.sparse_bytes
    assert total.time_us(rates) == pytest.approx(fetched.time_us(rates) + dense.time_us(rates))


def test_sparse_bytes_of_a_sync_job_go_at_the_sync_rate_an_async_job_at_sparse_bandwidth():
    """A sync pserver's sparse bytes (rows updated in place) are priced at
    `sync_sparse_bandwidth`, an async one's at `sparse_bandwidth`: hand-worked figures, and
    the two kept apart when costs add up (a row block and a `mod` shard alike)."""
    rates = Rates(bandwidth=1e12, sparse_bandwidth=1e8, sync_sparse_bandwidth=4e8, rpc_us=0.0,
                  op_us={"sum": 0.0, "scale": 0.0, "sgd": 0.0}, row_us=0.0, var_us=0.0, block_us=0.0, id_us=0.0,
                  merge_us=0.0, update_row_us=0.0, copy_us=0.0)
    stats = IdStats.uniform_rows(100, 10)
    sparse = 2 * 10 * (8 * 4 + 8)  # 2 trainers' grads: 10 rows of 8 floats and their ids each
    whole = 2 * 100 * 8 * 4 / 1e12 * 1e6  # the block fetched whole: dense bytes
    sync = block_cost("sgd", DType.FP32, 0, 100, 8, Job(2, True), rates, sparse=True, ids=stats)
    unsync = block_cost("sgd", DType.FP32, 0, 100, 8, Job(2, False), rates, sparse=True, ids=stats)
    assert sync.sparse_bytes == unsync.sparse_bytes == pytest.approx(sparse)
    assert sync.async_sparse_bytes == 0 and unsync.async_sparse_bytes == pytest.approx(sparse)
    assert sync.time_us(rates) == pytest.approx(sparse / 4e8 * 1e6 + whole)
    assert unsync.time_us(rates) == pytest.approx(sparse / 1e8 * 1e6 + whole)
    total = Cost()
    total.add(sync)
    total.add(unsync)
    assert total.time_us(rates) == pytest.approx(sync.time_us(rates) + unsync.time_us(rates))
    assert Rates().sync_sparse_bandwidth == SYNC_SPARSE_BANDWIDTH


@pytest.mark.parametrize("field, value, default, bad", [
    ("sync_sparse_bandwidth", 7e8, SYNC_SPARSE_BANDWIDTH, -1),
    ("sparse_bandwidth", 3e8, Rates.sparse_bandwidth, 0),
    ("prefetch_bandwidth", 9e8, PREFETCH_BANDWIDTH, 0),
])
def test_rates_without_a_later_field_keep_its_default(tmp_path, field, value, default, bad):
    """A rates file from before a field existed loads with the field's default; a bad
    value is refused."""
    data = Rates(**{field: value}, source="x").to_json()
    assert data[field] == value and field in data["units"]
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(data))
    assert getattr(load_rates(path), field) == value
    del data[field]
    path.write_text(json.dumps(data))
    assert getattr(load_rates(path), field) == default
    path.write_text(json.dumps(data | {field: bad}))
    with pytest.raises(TranspileError, match="rates must be positive"):
        load_rates(path)


def test_fixed_costs_per_rpc_var_and_block_add_up_per_pserver():
    """Every pserver holding a partition takes a `SendFetchBatch` a trainer (`rpc_us`
    each: one RPC, sync), a grad in and a param out per partition a trainer (`var_us`) and runs
    each partition's block once a round (`block_us`): with zero per-byte and per-element
    rates the estimate is exactly those."""
    import types

    rates = Rates(bandwidth=1e30, sparse_bandwidth=1e30, rpc_us=100.0, var_us=10.0, block_us=50.0, big_var_us=0.0,
                  op_us=dict.fromkeys(("sum", "scale", "momentum"), 0.0))
    block = types.SimpleNamespace(cols=None, rows=10, row_offset=0, name="w.block0")
    param = types.SimpleNamespace(param="w", shape=(10, 4), optimizer="momentum", dtype=DType.FP32, sparse=False, merged_grad=False,
                                  remote_prefetch=False, blocks=[block, block, block],
                                  endpoints=["a", "a", "b"])
    plan = types.SimpleNamespace(trainers=3, sync_mode=True, endpoints=["a", "b", "c"], params=[param], table=None)
    a, b, c = plan_costs(plan, rates)
    assert a.time_us == pytest.approx(3 * 100 + 2 * (2 * 3 * 10 + 50))
    assert b.time_us == pytest.approx(3 * 100 + 2 * 3 * 10 + 50)
    assert c.time_us == 0 and not c.partitions


def test_calibrate_times_a_real_sync_round():
    """A real sync pserver serving two replaying trainers (`transpiler.replay`): a round of
    a 1-layer net costs CPU, within what a small round costs on any machine (< 50 ms)."""
    from transpiler.calibrate import dense_programs, measure_sync_round

    one = measure_sync_round(*dense_programs(1, 4, 4), steps=20, warm=2)
    assert 0 < one < 50_000


def test_calibrate_arrival_add_rate_is_per_element_and_add_like():
    """`measure_arrival_add`: the in-place chunked add a pserver does per element of a copy
    summed on arrival, µs per element, in float32 and float64 (`sum_on_arrival@fp64`)."""
    from transpiler.calibrate import measure_arrival_add

    f32 = measure_arrival_add(elements=1 << 20, repeat=3)
    f64 = measure_arrival_add(elements=1 << 20, repeat=3, dtype="float64")
    assert 0 < f32 < 0.01 and 0 < f64 < 0.02  # a memcpy-like pass: ~0.0002 on the 2-core VM


def test_calibrate_dense_refuses_nets_whose_weights_are_not_summed_on_arrival():
    """`measure_dense` prices the bytes as a real model's big grads travel: widths whose
    weights fall under `arrival_sum.MIN_BYTES` would measure the `sum` op's path instead,
    and are refused before anything runs."""
    from transpiler.calibrate import DENSE_WIDTHS, measure_dense

    assert all(sums_on_arrival(w * w * 4, Job(2)) for w in DENSE_WIDTHS)
    with pytest.raises(ValueError, match="summed on arrival"):
        measure_dense(dict(DEFAULT_OP_US), 0.0, widths=(255, 1024))


def _modelled_rounds(rates: Rates, tweak=None):
    """A stand-in for `calibrate.measure_interleaved_rounds`: each net's pserver costs per
    round what the model says with `rates` (`plan_costs`), every cycle alike; `tweak(n,
    cycle, value)` may change a block's figure (a load spike)."""

    def modelled(nets, cycles, warm=3, trainers=2, think=0.0, settle=1, logs=None):
        out = []
        for n, (main, startup, _) in enumerate(nets):
            result = transpile(main, startup, pservers=["127.0.0.1:1"], trainers=trainers)
            value = plan_costs(result.plan, rates)[0].time_us
            out.append([tweak(n, c, value) if tweak else value for c in range(cycles)])
        return out

    return modelled


def test_calibrate_dense_recovers_the_rates_of_a_pserver_that_costs_what_the_model_says(monkeypatch):
    """`measure_dense` against pservers whose CPU per round is the model's own estimate
    (`plan_costs` with known rates, in place of `measure_interleaved_rounds`): it gives back
    the bandwidth (the two wide nets' weights summed on arrival, their biases by the `sum`
    op, as the model prices them), `block_us`, `rpc_us`, `big_var_us` and `bulk_rpc_us` it
    was given, each cycle's figure alike."""
    from transpiler import calibrate

    rates = Rates(bandwidth=3e9, rpc_us=300.0, var_us=0.0, block_us=50.0, big_var_us=40.0, bulk_rpc_us=200.0,
                  op_us={**DEFAULT_OP_US, SUM_ON_ARRIVAL: 0.0004, "sum": 0.002, "scale": 0.0003, "momentum": 0.001})
    seen = []
    modelled = _modelled_rounds(rates)
    monkeypatch.setattr(calibrate, "measure_interleaved_rounds",
                        lambda nets, cycles, **kw: seen.append(len(nets)) or modelled(nets, cycles, **kw))
    dense = calibrate.measure_dense(dict(rates.op_us), 0.0)
    cycles = calibrate.DENSE_CYCLES
    assert seen == [3 + 3 * calibrate.DENSE_COPIES]  # the three wide nets, each on its own pservers
    # (the biases' shares of `big_var_us`, a 2 kB var against a 4 kB one, ride on the bytes: 0.03%)
    assert dense["bandwidth"] == pytest.approx(3e9, rel=1e-3) and dense["bandwidths"] == [dense["bandwidth"]] * cycles
    # the many-vars net's extra big vars, each sent and fetched by each trainer
    assert dense["big_var_us"] == pytest.approx(40.0, rel=0.01) and len(dense["big_var_us_each"]) == cycles
    # the 256 kB net's batches travel the bulk channel: bulk_rpc_us a call
    assert dense["bulk_rpc_us"] == pytest.approx(200.0, rel=0.01)
    assert dense["bulk_rpc_us_each"] == pytest.approx([200.0] * cycles, rel=0.01)
    # the tiny nets' own bytes and ops ride on the fixed figures: under 1%; rpc_us per call
    # (a SendFetchBatch a trainer), each cycle's figure reported as the noise
    assert dense["block_us"] == pytest.approx(50.0, rel=0.01) and dense["rpc_us"] == pytest.approx(300.0, rel=0.01)
    assert dense["rpc_us_each"] == pytest.approx([300.0] * cycles, rel=0.01)
    # pservers that ran the `sum` op on the weights too would cost more: not that bandwidth
    monkeypatch.setattr("transpiler.cost.sums_on_arrival", lambda nbytes, job: False)
    assert calibrate.measure_dense(dict(rates.op_us), 0.0)["bandwidth"] < 0.9 * 3e9


def test_calibrate_dense_refuses_block_lengths_that_do_not_match_its_nets():
    from transpiler.calibrate import measure_dense

    with pytest.raises(ValueError, match="block lengths"):
        measure_dense(dict(DEFAULT_OP_US), 0.0, rounds=(4, 4))


def test_calibrate_dense_slope_is_the_bytes_over_the_cpu_beyond_the_ops():
    """`dense_slope`: known inputs, known bytes/s; noise that leaves less than a tenth of
    the added CPU beyond the ops (or none) is floored there, not infinite."""
    from transpiler.calibrate import dense_slope

    assert dense_slope(100e6, 30_000.0, 10_000.0) == pytest.approx(5e9)  # 100 MB in 20 ms
    assert dense_slope(100e6, 30_000.0, 29_000.0) == pytest.approx(100e6 / 3_000.0 * 1e6)  # floored at 10%
    assert dense_slope(100e6, -5.0, 0.0) == pytest.approx(100e6 * 1e6)  # floored at 1 us


def test_calibrate_measures_sparse_rows_on_a_real_sync_pserver():
    """`measure_sync_sparse` drives a real sync pserver (rows updated in place) a round at
    a time: a grad row of 64 floats costs it CPU, and the per-float rest is a rate."""
    from transpiler.calibrate import measure_sync_sparse

    synced = measure_sync_sparse(0.0, 0.0, id_counts=(128, 4096), rounds=5)
    assert 0 < synced["row_cpu_us"] < 1_000 and synced["wire_us"] >= 0


def test_measure_sync_ids_serves_two_prefetching_trainers_their_id_sets():
    """`measure_sync_ids` drives a real sync pserver as two prefetching trainers do (rows
    prefetched, grads sent, barriers) with the id sets given: 4,096 grad rows a trainer
    cost it more CPU per round than 64, and draws rotate per round."""
    from transpiler.calibrate import measure_sync_ids

    rng = np.random.default_rng(0)
    few = [[rng.integers(0, 16_384, 64)] for _ in range(2)]
    many = [[rng.integers(0, 16_384, 4096), rng.integers(0, 16_384, 4096)] for _ in range(2)]
    small, big = measure_sync_ids([few, many], width=16, rounds=8, blocks=1)
    assert 0 < small < big < 200_000


def test_calibrate_copy_rate_is_per_element_and_memcpy_like():
    from transpiler.calibrate import measure_copy

    rate = measure_copy(processes=2, elements=1 << 20, rounds=3)
    assert 1e-5 < rate < 1e-2  # µs per float32 element: memcpy's order, within 100x either way


def test_float64_ops_have_their_own_rates():
    """The executor's fused kernels are float32 only: a float64 block is priced at the
    `op@fp64` rates, an op without one at twice its float32 rate, a sparse copy by bytes."""
    rates = Rates(op_us={"sum": 0.001, "scale": 0.002, "momentum": 0.003, "momentum@fp64": 0.05, "sgd": 0.001},
                  block_us=0.0)
    assert rates.op("momentum", DType.FP64) == 0.05 and rates.op("sum", DType.FP64) == 0.002
    assert rates.op("momentum", DType.FP32) == rates.op("momentum") == 0.003
    n = 1000
    f64 = block_cost("momentum", DType.FP64, 0, 100, 10, Job(trainers=2), rates)
    assert f64.compute_us == pytest.approx(n * 0.002 + n * 0.004 + n * 0.05)
    assert Rates().op("adagrad", DType.FP64) > 4 * Rates().op("adagrad")  # the defaults, as measured
    copies = Rates(copy_us=0.001, fault_us=0.0, block_us=0.0, id_us=0.0, row_us=0.0, merge_us=0.0, update_row_us=0.0,
                   op_us={"sum": 0.0, "scale": 0.0, "adagrad": 0.0, "sgd": 0.0})
    stats = IdStats.uniform_rows(1000, 1)
    # an async pserver copies param and moment on each of the 2 trainers' runs; a sync one
    # updates the rows in place and copies nothing, whatever the dtype
    one = block_cost("adagrad", DType.FP32, 0, 1000, 8, Job(2, False), copies, sparse=True, ids=stats)
    two = block_cost("adagrad", DType.FP64, 0, 1000, 8, Job(2, False), copies, sparse=True, ids=stats)
    assert two.compute_us == pytest.approx(2 * one.compute_us) == pytest.approx(2 * 2 * 2 * 8000 * 0.001)
    assert block_cost("adagrad", DType.FP64, 0, 1000, 8, Job(2), copies, sparse=True, ids=stats).compute_us == 0.0


def test_prefetched_rows_go_at_the_prefetch_rate_grad_rows_at_the_sparse_rate():
    """A prefetch's ids in and rows out (`Cost.prefetch_bytes`) are priced at
    `prefetch_bandwidth`, the grad rows at `sync_sparse_bandwidth` (sync) or
    `sparse_bandwidth` (async), the call itself at `prefetch_rpc_us` (not a batch's
    `rpc_us`): hand-worked figures for a prefetched row block and for a distributed
    table's shard, sync and async."""
    from transpiler.cost import mod_shard_cost

    rates = Rates(bandwidth=1e12, sparse_bandwidth=1e8, sync_sparse_bandwidth=4e8, prefetch_bandwidth=2e9,
                  rpc_us=9999.0, prefetch_rpc_us=500.0, op_us={"sum": 0.0, "scale": 0.0, "sgd": 0.0}, row_us=0.0,
                  var_us=0.0, block_us=0.0, id_us=0.0, merge_us=0.0, update_row_us=0.0, copy_us=0.0)
    stats = IdStats.uniform_rows(100, 100)  # every trainer looks up each row once a step, on average
    touched = 100 * -math.expm1(100 * math.log1p(-1 / 100))  # distinct rows a trainer's step asks for
    grads = 2 * 100 * (8 * 4 + 8)  # 2 trainers' grad rows (a row per lookup) and their ids
    fetched = 2 * touched * (8 + 8 * 4)  # 2 trainers' ids asked for and rows sent
    for sync, grad_rate in ((True, 4e8), (False, 1e8)):
        cost = block_cost("sgd", DType.FP32, 0, 100, 8, Job(2, sync), rates, sparse=True, prefetch=True, ids=stats)
        assert cost.prefetch_bytes == pytest.approx(fetched)
        assert cost.sparse_bytes == pytest.approx(grads + fetched)
        assert cost.async_sparse_bytes == pytest.approx(0.0 if sync else grads)
        assert cost.rpcs == cost.prefetch_rpcs == 2  # a prefetch call a trainer (the batches: plan_costs)
        assert cost.time_us(rates) == pytest.approx(grads / grad_rate * 1e6 + fetched / 2e9 * 1e6 + 2 * 500.0)
        shard = mod_shard_cost("sgd", DType.FP32, (100, 8), 0, 1, Job(2, sync), rates, stats)
        assert shard.prefetch_bytes == pytest.approx(fetched)
        assert shard.time_us(rates) == pytest.approx(grads / grad_rate * 1e6 + fetched / 2e9 * 1e6 + 2 * 500.0)
    # added up, each part keeps its rate
    total = Cost()
    for sync in (True, False):
        total.add(block_cost("sgd", DType.FP32, 0, 100, 8, Job(2, sync), rates, sparse=True, prefetch=True, ids=stats))
    assert total.time_us(rates) == pytest.approx(grads / 4e8 * 1e6 + grads / 1e8 * 1e6 + 2 * fetched / 2e9 * 1e6
                                                 + 4 * 500.0)


def test_rates_of_the_first_schema_count_rpc_us_per_half_call(tmp_path):
    """A `pstranspile.rates/1` file priced a sync step's one `SendFetchBatch` a trainer as
    two RPCs: it loads with `rpc_us` doubled, a `/2` file as written, anything else refused."""
    data = Rates(rpc_us=350.0, source="x").to_json()
    assert data["schema"] == "pstranspile.rates/2"
    (tmp_path / "v2.json").write_text(json.dumps(data))
    (tmp_path / "v1.json").write_text(json.dumps(data | {"schema": "pstranspile.rates/1"}))
    (tmp_path / "v9.json").write_text(json.dumps(data | {"schema": "pstranspile.rates/9"}))
    assert load_rates(tmp_path / "v2.json").rpc_us == 350.0
    # a prefetch call's own rate goes through the file; a file written before it had one
    # loads the built-in figure
    (tmp_path / "pf.json").write_text(json.dumps(Rates(prefetch_rpc_us=123.0).to_json()))
    assert load_rates(tmp_path / "pf.json").prefetch_rpc_us == 123.0
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in data.items() if k != "prefetch_rpc_us"}))
    assert load_rates(tmp_path / "old.json").prefetch_rpc_us == Rates().prefetch_rpc_us
    assert load_rates(tmp_path / "v1.json").rpc_us == 700.0
    with pytest.raises(TranspileError, match="not a `pstranspile calibrate` file"):
        load_rates(tmp_path / "v9.json")


def test_rates_keep_calibrate_noise_figures(tmp_path):
    """`Rates.noise` (what calibrate measured of its own spread) goes to the file and back;
    the model does not read it."""
    rates = Rates(noise={"rpc_us": (600.0, 650.0, 700.0), "bandwidth": (3e9, 4e9)}, source="x")
    (tmp_path / "r.json").write_text(json.dumps(rates.to_json()))
    back = load_rates(tmp_path / "r.json")
    assert back.noise == {"bandwidth": (3e9, 4e9), "rpc_us": (600.0, 650.0, 700.0)}
    assert Rates().noise == {} and Rates().to_json()["noise"] == {}


def test_calibrate_dense_takes_the_median_block_past_an_outlier(monkeypatch):
    """`measure_dense`'s figures are medians over its cycles: a tiny-net pserver woken at
    the wrong moment (one block at 2.5x, as X2's 3,800 against 2,000 µs; another at 1.5x)
    moves neither `rpc_us` nor `block_us` by more than a percent, and each cycle's own
    `rpc_us` shows the spread; a load spike over one cycle's wide net (2x) and another's
    many-vars net (3x), as AB2's pairs read 3.5 and 6.9 GB/s, moves neither `bandwidth`
    nor `big_var_us` by more than a percent."""
    from transpiler import calibrate

    rates = Rates(bandwidth=3e9, rpc_us=600.0, var_us=0.0, block_us=50.0, big_var_us=40.0,
                  op_us={**DEFAULT_OP_US, SUM_ON_ARRIVAL: 0.0004, "sum": 0.002, "scale": 0.0003, "momentum": 0.001})
    # (net, cycle): factor; the nets in the order they run: 0 tiny, 1 many tiny layers, 2
    # bulk, then two copies (pservers) each of 3 wide, 4 narrow, 5 many vars (6-8); cycle 0
    # warms (a spike there, 10x on every net, is not read)
    spikes = {(0, 2): 2.5, (0, 5): 1.5, (3, 1): 2.0, (6, 1): 2.0, (5, 6): 3.0, (8, 6): 3.0,
              **{(n, 0): 10.0 for n in range(9)}}
    monkeypatch.setattr(calibrate, "measure_interleaved_rounds",
                        _modelled_rounds(rates, lambda n, c, value: spikes.get((n, c), 1.0) * value))
    dense = calibrate.measure_dense(dict(rates.op_us), 0.0)
    assert dense["rpc_us"] == pytest.approx(600.0, rel=0.01) and dense["block_us"] == pytest.approx(50.0, rel=0.01)
    each = dense["rpc_us_each"]
    assert len(each) == calibrate.DENSE_CYCLES
    assert each[0] == pytest.approx(600.0, rel=0.01) and each[1] > 1.5 * 600.0 and each[4] > 1.2 * 600.0
    assert dense["bandwidth"] == pytest.approx(3e9, rel=0.01) and dense["bandwidths"][0] < 0.5 * 3e9
    assert dense["big_var_us"] == pytest.approx(40.0, rel=0.01) and dense["big_var_us_each"][5] > 3 * 40.0
    # a spike in half the cycles does move them: a median, not a minimum
    half = {(n, c): 2.0 for n in (3, 6) for c in range(1, calibrate.DENSE_CYCLES // 2 + 2)}
    monkeypatch.setattr(calibrate, "measure_interleaved_rounds",
                        _modelled_rounds(rates, lambda n, c, value: half.get((n, c), 1.0) * value))
    assert calibrate.measure_dense(dict(rates.op_us), 0.0)["bandwidth"] < 0.5 * 3e9


def test_calibrate_interleaves_the_nets_a_block_at_a_time(monkeypatch):
    """`measure_interleaved_rounds` runs real sync pservers, one per net, a block each in
    turn: the CPU reads go net 0's block (its start and end), net 1's, net 0's again...
    and give a figure per net per cycle, each a real round's CPU."""
    from transpiler import calibrate

    order = []
    probe = calibrate._probe_cpu

    def logged(child):
        order.append(child.pid)
        return probe(child)

    monkeypatch.setattr(calibrate, "_probe_cpu", logged)
    monkeypatch.delenv("PSTRANSPILE_BULK_SHM", raising=False)  # `auto`: rings on loopback, as a job's
    nets = [(*calibrate.dense_programs(1, 4, 4), 3), (*calibrate.dense_programs(1, 256, 256), 2)]
    logs: list[list[str]] = []
    figures = calibrate.measure_interleaved_rounds(nets, cycles=2, warm=1, think=0.0, logs=logs)
    assert len(figures) == 2 and all(len(f) == 2 and all(0 < x < 50_000 for x in f) for f in figures)
    # each block: a read after its settling round, one at its end; the nets in turn
    a, b = order[0], order[2]
    assert a != b and order == [a, a, b, b, a, a, b, b]
    # the 256 kB weight crossed in the shared-memory rings, as a job's big vars do on one
    # host; the tiny net's vars never
    assert len(logs) == 2 and calibrate.ring_slots(logs[0]) == 0
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert calibrate.ring_slots(logs[1]) > 0


def test_calibrate_reads_the_ring_slots_a_pserver_logged():
    from transpiler.calibrate import ring_slots

    log = ["pserver 127.0.0.1:1: all 2 trainer(s) completed after 9 step(s)",
           "pserver 127.0.0.1:1: 2 bulk connection(s) with a shared-memory ring, 152 slot(s) handed over"]
    assert ring_slots(log) == 152 and ring_slots(log[:1]) == 0 and ring_slots([]) == 0


def test_calibrate_interleaved_rounds_raise_a_trainers_error_without_waiting(monkeypatch):
    """A trainer thread that fails (here: its replay raises) breaks its net's gates: the
    caller gets that error at once, not a wait for the gates' timeout, and the pservers
    are stopped."""
    import time

    from transpiler import calibrate

    started = []
    real_start = calibrate._start_pserver

    def start(*args):
        started.append(real_start(*args))
        return started[-1]

    def broken(client, main, startup, steps, on_step):
        raise RuntimeError("the replay broke")

    monkeypatch.setattr(calibrate, "_start_pserver", start)
    monkeypatch.setattr("transpiler.replay.replay", broken)
    nets = [(*calibrate.dense_programs(1, 4, 4), 3), (*calibrate.dense_programs(2, 4, 4), 3)]
    begun = time.perf_counter()
    with pytest.raises(RuntimeError, match="the replay broke"):
        calibrate.measure_interleaved_rounds(nets, cycles=2, warm=1, timeout=60.0)
    assert time.perf_counter() - begun < 30 and len(started) == 2
    assert all(child.poll() is not None for child in started)


def test_calibrate_interleaved_rounds_refuse_nothing_to_run():
    from transpiler.calibrate import measure_interleaved_rounds

    with pytest.raises(ValueError, match="at least one net"):
        measure_interleaved_rounds([], cycles=2)


def test_calibrate_sync_rounds_are_read_per_block_by_the_pservers_own_clock():
    """`measure_sync_rounds` reads the pserver's CPU through its probe (`process_time`, not
    /proc's 10 ms ticks) after the warm-up and after each block: `blocks` figures, each a
    real round's CPU (a 1-layer net: above 0, under 50 ms), not multiples of a tick."""
    from transpiler.calibrate import dense_programs, measure_sync_rounds

    figures = measure_sync_rounds(*dense_programs(1, 4, 4), steps=20, warm=2, blocks=2)
    assert len(figures) == 2 and all(0 < f < 50_000 for f in figures)
    tick = 1e6 / os.sysconf("SC_CLK_TCK") / 10  # µs of a tick spread over a block's 10 rounds
    assert any(abs(f / tick - round(f / tick)) > 1e-6 for f in figures)


def test_calibrate_measures_prefetched_rows_on_a_real_sync_pserver():
    """`measure_prefetch` drives a real sync pserver as two prefetching trainers do: more
    rows prefetched cost it more CPU, a rate in bytes/s follows from the per-row figure."""
    from transpiler.calibrate import PSERVER_WIDTH, measure_prefetch

    found = measure_prefetch(counts=(8, 4096), rounds=10, repeats=1)
    assert len(found["row_us_each"]) == 1 and found["row_us"] > 0
    assert found["prefetch_bandwidth"] == pytest.approx((8 + PSERVER_WIDTH * 4) / found["row_us"] * 1e6)


def test_measure_prefetch_takes_the_median_repeat_and_refuses_a_rate_it_did_not_see(monkeypatch):
    """`measure_prefetch` on a pserver whose CPU per round is known (few rows, many rows,
    none; per repeat): the per-row figure is the median repeat's, past one outlier; when
    noise leaves no positive per-row figure it gives no rate (`None`), and `calibrate`
    then prices prefetched rows as a grad's."""
    from transpiler import calibrate

    def rounds(rows_us, call_us=500.0):
        def fake(width, table_rows, trainers, sets, rounds, blocks, think=0.0):
            assert len(sets) == 3 * len(rows_us) and blocks == 1
            out = []
            for row in rows_us:
                base = 2000.0
                out += [base + trainers * call_us + trainers * 8 * row, base + trainers * call_us + trainers * 4096 * row,
                        base]
            return out
        return fake

    monkeypatch.setattr(calibrate, "_sync_table_rounds", rounds([0.2, 0.25, 5.0]))
    found = calibrate.measure_prefetch(counts=(8, 4096), repeats=3)
    assert found["row_us"] == pytest.approx(0.25) and found["call_us"] == pytest.approx(500.0 + 8 * 0.25, rel=0.01)
    assert found["call_us_each"] == pytest.approx([500.0 + 8 * r for r in (0.2, 0.25, 5.0)])
    assert found["prefetch_bandwidth"] == pytest.approx((8 + 64 * 4) / 0.25 * 1e6)
    monkeypatch.setattr(calibrate, "_sync_table_rounds", rounds([-0.01, 0.0, 0.3]))
    assert calibrate.measure_prefetch(counts=(8, 4096), repeats=3)["prefetch_bandwidth"] is None


def test_big_dense_vars_cost_big_var_us_per_trainer_each_way():
    """A dense partition of `BIG_VAR_BYTES` (256 kB) or more costs `big_var_us` per trainer
    each way (its grad in, its param out: `Cost.big_vars` = 2·T), beside its bytes, in sync
    and async jobs, on the bulk channel or not; a smaller one its share by bytes. So
    cutting a param never dodges it: two halves cost what the whole does (each under 256
    kB), or twice (each over)."""
    from transpiler.cost import BIG_VAR_BYTES

    rates = Rates(bandwidth=1e30, rpc_us=0.0, var_us=0.0, block_us=0.0, big_var_us=40.0,
                  op_us=dict.fromkeys(("sum", "scale", "momentum", SUM_ON_ARRIVAL), 0.0))
    assert BIG_VAR_BYTES == 256 << 10
    rows = BIG_VAR_BYTES // (4 * 64)  # a [rows, 64] float32 block of exactly 256 kB
    cases = [(Job(3), rows, 6.0), (Job(3), rows // 4, 1.5), (Job(1), rows, 2.0), (Job(3, False), rows, 6.0),
             (Job(2), 4 * rows, 4.0), (Job(2), 1, 4 * 256 / BIG_VAR_BYTES)]
    for job, height, vars_ in cases:
        cost = block_cost("momentum", DType.FP32, 0, height, 64, job, rates)
        assert cost.big_vars == pytest.approx(vars_)
        assert cost.time_us(rates) == pytest.approx(40.0 * vars_)
    assert block_cost("momentum", DType.FP64, 0, rows // 2, 64, Job(2), rates).big_vars == 4  # the bytes count
    for height, ratio in ((rows, 1.0), (4 * rows, 2.0)):  # halves of 128 kB, of 512 kB
        whole = block_cost("momentum", DType.FP32, 0, height, 64, Job(2), rates)
        halves = [block_cost("momentum", DType.FP32, i * height // 2, height // 2, 64, Job(2), rates) for i in range(2)]
        assert sum(h.big_vars for h in halves) == pytest.approx(ratio * whole.big_vars)
    total = Cost()
    total.add(block_cost("momentum", DType.FP32, 0, rows, 64, Job(2), rates))
    total.add(block_cost("momentum", DType.FP32, 0, rows // 2, 64, Job(2), rates))
    assert total.big_vars == pytest.approx(6.0) and total.time_us(rates) == pytest.approx(240.0)


def test_calibrate_splits_a_partition_between_its_block_and_its_vars_keeping_their_sum():
    """A partition's measured fixed CPU (70 µs, 2 trainers: 4 var transfers) is `block_us` +
    4·`var_us`; a `var_us` measured apart keeps its share when it fits, and is capped when
    noise puts it above (21 µs once: 84 > 70), so `block_us` is 0, not negative, and the sum
    stays 70."""
    from transpiler.calibrate import split_partition

    assert split_partition(70.0, 0.0, 2) == (0.0, 70.0)
    assert split_partition(70.0, 5.0, 2) == (5.0, 50.0)
    var_us, block_us = split_partition(70.0, 21.0, 2)
    assert (var_us, block_us) == (17.5, 0.0) and block_us + 4 * var_us == 70.0
    assert split_partition(70.0, -3.0, 2) == (0.0, 70.0)


def test_batches_to_a_pserver_with_a_big_dense_var_are_priced_as_bulk_channel_calls():
    """A pserver holding a dense var of 256 kB or more offers the bulk channel
    (`ops.rpc.bulk.BULK_MIN`, the same threshold as `BIG_VAR_BYTES`) and the trainers'
    batches travel it: `bulk_rpc_us` a call (`Cost.bulk_rpcs`); a pserver with only small
    vars takes gRPC calls at `rpc_us`; a prefetch is always a gRPC call."""
    import types

    from ops.rpc.bulk import BULK_MIN
    from transpiler.cost import BIG_VAR_BYTES

    assert BIG_VAR_BYTES == BULK_MIN
    rates = Rates(bandwidth=1e30, sparse_bandwidth=1e30, rpc_us=700.0, bulk_rpc_us=300.0, var_us=0.0, block_us=0.0,
                  big_var_us=0.0, op_us=dict.fromkeys(("sum", "scale", "momentum", SUM_ON_ARRIVAL), 0.0))

    def block(rows, name):
        return types.SimpleNamespace(cols=None, rows=rows, row_offset=0, name=name)

    big, small = block(1024, "w.block0"), block(1023, "w.block1")  # [rows, 64] float32: 256 kB and just under
    param = types.SimpleNamespace(param="w", shape=(2047, 64), optimizer="momentum", dtype=DType.FP32, sparse=False,
                                  merged_grad=False, remote_prefetch=False, blocks=[big, small], endpoints=["a", "b"])
    plan = types.SimpleNamespace(trainers=2, sync_mode=True, endpoints=["a", "b", "c"], params=[param], table=None)
    a, b, c = plan_costs(plan, rates)
    assert (a.cost.rpcs, a.cost.bulk_rpcs, b.cost.rpcs, b.cost.bulk_rpcs) == (2, 2, 2, 0)
    assert a.time_us == pytest.approx(2 * 300.0) and b.time_us == pytest.approx(2 * 700.0) and c.time_us == 0
    assert load_rates(None).bulk_rpc_us == Rates().bulk_rpc_us
