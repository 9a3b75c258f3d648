"""The `plan` partitioner (transpiler/planner.py) on synthetic cases with a known optimum,
on the Paddle-built fixtures, and `pstranspile plan` / `calibrate` with its flags."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.cost import SYNC_SPARSE_BANDWIDTH, Job, Rates, batch_rpcs, block_cost, declared_memory, mod_shard_cost, plan_costs
from transpiler.errors import TranspileError
from transpiler.ir import Program
from transpiler.ir.types import DType
from transpiler.partition import ParamInfo, checked_partitions
from transpiler.planner import PlanPartitioner, candidates, even_cuts, grid_partitions

# the search's known optima are worked out with these rates (no per-var cost for big vars:
# `big_var_us` has its own tests in test_cost.py)
# (a prefetch call priced as any other call in these cases: `prefetch_rpc_us` = `rpc_us`)
RATES = Rates(bandwidth=1e9, rpc_us=100.0, op_us={"sum": 0.001, "scale": 0.001, "sgd": 0.002, "adam": 0.01},
              row_us=0.01, big_var_us=0.0, prefetch_rpc_us=100.0)
FEW_FIXED = Rates(rpc_us=100.0, prefetch_rpc_us=100.0)
MLP = PADDLE_PROGRAMS / "mlp_adam_2ps"
CTR = PADDLE_PROGRAMS / "ctr_v1_sparse_sgd_2ps"


def dense(name, shape, optimizer="sgd", **kw):
    return ParamInfo(name, tuple(shape), DType.FP32, optimizer, **kw)


def run(planner: PlanPartitioner, params, servers: int, trainers: int = 2):
    planner.servers, planner.trainers, planner.sync_mode = servers, trainers, True
    planner.reset()
    planner.prepare(params)
    out = {}
    for p in params:
        parts = checked_partitions(p, planner.partitions(p), "plan")
        out[p.name] = (parts, planner.assign(parts))
    return out


def loads(planner, params, placed, servers, trainers=2):
    total = [trainers * planner.rates.rpc_us] * servers  # a SendFetchBatch per trainer, as the planner counts
    for p in params:
        for part, server in zip(*placed[p.name], strict=True):
            total[server] += block_cost(p.optimizer, p.dtype, part.start_row, part.rows, part.cols, Job(trainers),
                                        planner.rates, sparse=p.sparse, ids=planner.ids.get(p.name)).time_us(planner.rates)
    return total


def test_even_cuts_and_candidates():
    assert even_cuts(10, 3) == [(0, 4), (4, 7), (7, 10)]
    kinds = [(c.kind, c.grid) for c in candidates([dense("w", (8, 8))], 4)]
    assert kinds == [("whole", (1, 1)), ("row", (2, 1)), ("row", (3, 1)), ("row", (4, 1)), ("column", (1, 2)),
                     ("column", (1, 3)), ("column", (1, 4)), ("2-D", (2, 2))]
    assert [c.kind for c in candidates([dense("w", (8, 8), "lamb", row_cuts_only=True)], 2)] == ["whole", "row"]
    assert [c.kind for c in candidates([dense("c", (4, 3, 3))], 2)] == ["whole", "row"]  # rank 3: rows only


def test_two_equal_params_on_two_pservers_stay_whole_one_each():
    """Optimum: each param whole on its own pserver (a cut adds RPCs and balances nothing)."""
    params = [dense("a", (1000, 100)), dense("b", (1000, 100))]
    planner = PlanPartitioner(rates=RATES)
    placed = run(planner, params, 2)
    assert [len(placed[n][0]) for n in "ab"] == [1, 1]
    assert sorted(placed["a"][1] + placed["b"][1]) == [0, 1]
    assert planner.loads[0] == pytest.approx(planner.loads[1])


def test_one_large_param_is_cut_across_every_pserver():
    """Optimum for one big dense param on 4 pservers: 4 equal parts, one per pserver."""
    params = [dense("w", (4000, 1000), "adam")]
    planner = PlanPartitioner(rates=RATES)
    placed = run(planner, params, 4)
    parts, servers = placed["w"]
    assert len(parts) == 4 and sorted(servers) == [0, 1, 2, 3]
    assert max(planner.loads) / min(planner.loads) == pytest.approx(1.0)


def test_whole_params_are_packed_optimally():
    """Sizes 3,3,2,2,2 kept whole on 2 pservers: greedy alone gives 7|5 (the classic LPT
    miss), the known optimum is 3+3 | 2+2+2."""
    rates = Rates(bandwidth=1e12, rpc_us=0.0, op_us={"sum": 0.0, "scale": 0.0, "sgd": 1.0}, row_us=0.0, var_us=0.0,
                  block_us=0.0, big_var_us=0.0)
    params = [dense(n, (size * 1000, 1)) for n, size in zip("abcde", (2, 3, 2, 3, 2), strict=True)]
    planner = PlanPartitioner(rates=rates, kinds={n: ("whole",) for n in "abcde"})
    placed = run(planner, params, 2, trainers=1)
    assert all(len(placed[n][0]) == 1 for n in "abcde")
    assert planner.loads == [pytest.approx(6000.0, rel=1e-4), pytest.approx(6000.0, rel=1e-4)]
    groups = {s: sorted(n for n in "abcde" if placed[n][1][0] == s) for s in (0, 1)}
    assert sorted(groups.values()) == [["a", "c", "e"], ["b", "d"]]


def test_skewed_table_is_cut_by_columns():
    """Zipf ids: a row cut puts most lookups on one pserver; column ranges split every
    lookup evenly, the known optimum."""
    rng = np.random.default_rng(0)
    sample = np.minimum(rng.zipf(1.1, 100_000), 10_000) - 1
    table = dense("emb", (10_000, 64), sparse=True, table=True)
    # every rate the optimum depends on stated (the built-in ones move with calibrations)
    rates = Rates(bandwidth=1e8, rpc_us=100.0, op_us=dict(RATES.op_us), row_us=0.01, var_us=0.0, merge_us=0.0086,
                  update_row_us=0.39, prefetch_bandwidth=SYNC_SPARSE_BANDWIDTH)
    planner = PlanPartitioner(rates=rates, id_samples={"emb": sample}, batch_size=4096)
    placed = run(planner, [table], 4)
    parts, servers = placed["emb"]
    assert all(p.rows == 10_000 for p in parts) and len(parts) == 4  # column ranges
    assert sorted(servers) == [0, 1, 2, 3]
    assert max(planner.loads) / min(planner.loads) < 1.01
    row_cut = PlanPartitioner(rates=rates, id_samples={"emb": sample}, batch_size=4096, kinds={"emb": ("row",)})
    placed_rows = run(row_cut, [table], 4)
    rows_load = loads(row_cut, [table], placed_rows, 4)
    assert max(rows_load) > 1.5 * max(planner.loads)


def test_memory_cap_forces_a_cut_and_refuses_when_nothing_fits():
    w = dense("w", (1000, 250))  # sgd, 2 trainers: params + merged + 2 buffers = 4 MB whole
    whole = block_cost("sgd", DType.FP32, 0, 1000, 250, Job(2), RATES).memory_bytes
    planner = PlanPartitioner(rates=RATES, memory_cap=whole // 2 + 64)
    parts, servers = run(planner, [w], 2)["w"]
    assert len(parts) == 2 and sorted(servers) == [0, 1]
    assert max(planner.memory) <= whole // 2 + 64
    with pytest.raises(TranspileError, match=r"no plan fits --pserver-memory .*\(.* over\)"):
        run(PlanPartitioner(rates=RATES, memory_cap=whole // 3), [w], 2)
    # enough in total, but the second param fits nowhere once the first is placed
    tight = PlanPartitioner(rates=RATES, memory_cap=whole // 2 + 64, kinds={"w": ("whole",), "v": ("whole",)})
    with pytest.raises(TranspileError, match=r"param 'w' \[1000, 250\] fits on no pserver in any cut, the best is "
                                             r".* over the cap"):
        run(tight, [w, dense("v", (10, 10))], 4)


def test_colocated_params_share_cut_and_pservers():
    params = [dense("fc_w", (512, 64)), dense("fc_b", (512, 1)), dense("other", (2048, 64))]
    planner = PlanPartitioner(rates=RATES, colocate=[("fc_w", "fc_b")])
    placed = run(planner, params, 3)
    assert placed["fc_w"][1] == placed["fc_b"][1]
    assert [(p.start_row, p.end_row) for p in placed["fc_w"][0]] == [(p.start_row, p.end_row) for p in placed["fc_b"][0]]
    with pytest.raises(TranspileError, match="--colocate names 'nope'"):
        run(PlanPartitioner(colocate=[("fc_w", "nope")]), params, 3)
    with pytest.raises(TranspileError, match="unknown partition kind 'diagonal'"):
        PlanPartitioner(kinds={"fc_w": ("diagonal",)})


def test_search_is_deterministic():
    params = [dense(f"p{i}", (100 * (i % 5 + 1), 30 + i)) for i in range(20)]
    first = run(PlanPartitioner(rates=RATES), params, 4)
    second = run(PlanPartitioner(rates=RATES), params, 4)
    assert first == second


@pytest.mark.parametrize("case", ["mlp_adam_2ps", "ctr_v1_sparse_sgd_2ps", "mlp_lamb_3ps", "resnet_small_momentum_3ps_sync",
                                  "bert_small_adam_3ps_sync"])
def test_plan_partitioner_on_paddle_fixtures(case):
    folder = PADDLE_PROGRAMS / case
    eps = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4"
    result = transpile(Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"), pservers=eps, trainers=2,
                       partitioner="plan", verify=True)
    assert result.plan.partitioner == "plan"
    predicted = {row.endpoint: row for row in plan_costs(result.plan)}
    for endpoint, (main, _) in result.pservers.items():
        declared = declared_memory(result.plan, endpoint, main)
        for kind, value in declared.memory.items():
            if kind != "other":
                assert predicted[endpoint].cost.memory[kind] == value, (endpoint, kind)
    again = transpile(Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"), pservers=eps, trainers=2,
                      partitioner="plan", trainer_id=1)
    assert again.plan.to_json() == result.plan.to_json()  # every trainer plans alike


def test_plan_against_paddle_on_the_estimate_for_the_mlp():
    """Paddle's sliced round robin is already balanced on the MLP (the plan is within 1%);
    unsliced it is not (h1.w whole on one pserver), and the plan is far better."""
    main, startup = Program.load(MLP / "main.pb"), Program.load(MLP / "startup.pb")
    eps = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4"

    def slowest(**kw):  # the module's RATES: the claim is about the search, not this machine's defaults
        plan = transpile(main, startup, pservers=eps, trainers=2, **kw).plan
        return max(r.time_us for r in plan_costs(plan, RATES))

    ours = slowest(partitioner=PlanPartitioner(rates=RATES))
    assert ours <= 1.01 * slowest()
    assert ours < 0.5 * slowest(slice_var_up=False)


# ------------------------------------------------------------------ the CLI

EPS = "127.0.0.1:6170,127.0.0.1:6171"


def cli(capsys, *args):
    from transpiler.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_cost_report_text_json_svg(capsys, tmp_path):
    code, out, err = cli(capsys, "plan", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "--svg",
                         tmp_path / "p.svg")
    assert code == 0, err
    assert "memory per pserver, declared by its program (bytes; 2 trainer(s), sync)" in out
    assert re.search(r"127\.0\.0\.1:6170 +457\.04 KiB +914\.11 KiB +914\.08 KiB +457\.04 KiB +0 B +4 B +2\.68 MiB", out)
    assert "estimated step:" in out and re.search(r"h1\.w +row +2x1 +2", out)
    svg = (tmp_path / "p.svg").read_text()
    import xml.etree.ElementTree as ET

    ET.fromstring(svg)
    assert svg.count("<title>est ") == 2
    code, out, _ = cli(capsys, "plan", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "--json")
    cost = json.loads(out)["cost"]
    first = cost["pservers"][0]
    assert first["declared"]["optimizer_state"] == first["memory"]["optimizer_state"] == 936048
    assert first["declared_bytes"] == sum(first["declared"].values())
    assert set(cost["imbalance"]) >= {"memory_bytes", "bytes_in", "bytes_out", "rpcs", "est_ms", "declared_bytes"}
    assert cost["units"]["est_ms"] == "ms per step"


def test_cli_id_sample_and_plan_partitioner(capsys, tmp_path):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "ids.npy", (np.minimum(rng.zipf(1.1, 20_000), 100_000) - 1).reshape(-1, 4))
    base = ["plan", CTR / "main.pb", "--pservers", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4", "--trainers", "2",
            "--id-sample", tmp_path / "ids.npy", "--batch-size", "64", "--json"]
    code, out, err = cli(capsys, *base)
    assert code == 0, err
    cost = json.loads(out)["cost"]
    assert cost["ids"]["emb"]["ids_per_step"] == 256 and cost["ids"]["emb"]["distribution"] == "sample"
    lookups = [row["lookups"] for row in cost["pservers"]]
    assert max(lookups) > 0.6 * sum(lookups)  # paddle's row blocks: the hot rows on one pserver
    code, out, err = cli(capsys, *base, "--partitioner", "plan")
    assert code == 0, err
    planned = json.loads(out)
    emb = next(p for p in planned["params"] if p["param"] == "emb")
    # not prefetched: trainers receive the whole table each step, which outweighs the skewed
    # grad rows (test_skewed_table_is_cut_by_columns has a prefetched one)
    assert len(emb["blocks"]) == 4 and sorted(b["endpoint"] for b in emb["blocks"]) == sorted(planned["endpoints"])
    assert planned["cost"]["est_step_ms"] < cost["est_step_ms"]


def test_cli_plan_errors_are_one_line(capsys, tmp_path):
    base = ["plan", MLP / "main.pb", "--pservers", EPS, "--trainers", "2"]
    code, _, err = cli(capsys, *base, "--partitioner", "plan", "--pserver-memory", "1MiB")
    assert code == 2 and err.count("\n") == 1
    assert "no plan fits --pserver-memory 1.00 MiB" in err and "over" in err
    code, _, err = cli(capsys, *base, "--pserver-memory", "8GiB")
    assert code == 2 and "--pserver-memory, --pserver-cores and --colocate belong to --partitioner plan" in err
    code, _, err = cli(capsys, *base, "--partitioner", "plan", "--pserver-memory", "lots")
    assert code == 2 and "'lots' is not a size" in err
    code, _, err = cli(capsys, *base, "--id-sample", tmp_path / "none.npy")
    assert code == 2 and "--id-sample" in err and err.count("\n") == 1
    np.save(tmp_path / "ids.npy", np.array([1, 2]))
    code, _, err = cli(capsys, *base, "--id-sample", tmp_path / "ids.npy")
    assert code == 2 and "0 sparse params or tables" in err
    code, _, err = cli(capsys, *base, "--partitioner", "plan", "--colocate", "h1.w")
    assert code == 2 and "name two params or more" in err
    code, out, err = cli(capsys, *base, "--partitioner", "plan", "--colocate", "h1.w,h1.b", "--json")
    assert code == 0, err
    params = {p["param"]: p for p in json.loads(out)["params"]}
    assert [b["endpoint"] for b in params["h1.w"]["blocks"]] == [b["endpoint"] for b in params["h1.b"]["blocks"]]


# ------------------------------------------------------------------ distributed equals local


def test_float64_sync_training_with_the_plan_equals_local(tmp_path):
    """`PSTRANSPILE_PARTITIONER=plan` (as `launch --partitioner plan` sets it): every process
    plans alike, and 2 trainers x 3 pservers train the MLP (Adam) as local training does."""
    from e2e_support import launch_training, save, trained_params, train_locally
    from transpiler.ir.precision import as_float64

    main, startup = (as_float64(Program.load(MLP / f)) for f in ("main.pb", "startup.pb"))
    plan = transpile(main, startup, pservers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", trainers=2,
                     partitioner="plan").plan
    assert any(len(p.blocks) > 1 for p in plan.params)  # something is cut
    main_pb, startup_pb = save(tmp_path, main, startup)
    launch_training(tmp_path, main_pb, startup_pb, pservers=3, env={"PSTRANSPILE_PARTITIONER": "plan"})
    held = 0
    for i in range(3):
        log = (tmp_path / "logs" / f"pserver.{i}.log").read_text()
        found = re.search(r"(\d+) partition\(s\) of \d+ param\(s\), partitioner plan\n", log)
        assert found, log
        held += int(found[1])
    assert held == sum(len(p.blocks) for p in plan.params)
    init0, final0 = trained_params(tmp_path, 0)
    local = train_locally(tmp_path, main_pb, startup_pb)
    assert local.keys() == final0.keys() and local
    for name in local:
        assert final0[name].dtype == np.float64 and np.abs(local[name] - init0[name]).max() > 0, name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-5, atol=0, err_msg=name)


def test_cli_transpile_with_the_plan(capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, _, err = cli(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "--partitioner",
                       "plan", "--pserver-memory", "8GiB", "-o", out_dir)
    assert code == 0, err
    assert json.loads((out_dir / "plan.json").read_text())["partitioner"] == "plan"
    code, _, err = cli(capsys, "transpile", MLP / "main.pb", "--pservers", EPS, "--trainers", "2", "--rates",
                       tmp_path / "r.json", "-o", tmp_path / "o2")
    assert code == 2 and "--id-sample and --rates feed the cost model" in err


def test_hot_first_table_gets_row_bands_sized_by_frequency():
    """Zipf ids with the hot ids first, Adagrad: a column cut sends every id to every
    pserver; row bands of equal
    estimated time (a short hot band, long cold ones) beat it and the even row bands."""
    rng = np.random.default_rng(0)
    sample = (rng.zipf(1.1, 50_000) - 1) % 100_000
    table = dense("emb", (100_000, 64), "adagrad", sparse=True, table=True)
    planner = PlanPartitioner(id_samples={"emb": sample}, batch_size=2000)
    parts, servers = run(planner, [table], 4)["emb"]
    assert [p.cols for p in parts] == [64] * 4 and sorted(servers) == [0, 1, 2, 3]
    assert parts[0].rows < 100_000 // 4 < parts[-1].rows  # the hot band is the short one
    stats = planner._stats([table])

    def slowest(grid):
        from transpiler.planner import grid_partitions

        base = 2 * 2 * planner.rates.rpc_us
        return max(base + block_cost("adagrad", DType.FP32, p.start_row, p.rows, p.cols, Job(2), planner.rates,
                                     sparse=True, prefetch=True, ids=stats["emb"]).time_us(planner.rates)
                   for p in grid_partitions(table, grid))

    assert max(planner.loads) < 0.9 * slowest((4, 1)) and max(planner.loads) < slowest((1, 4))
    assert max(planner.loads) / min(planner.loads) < 1.05


# -- the search space for a table: id % k shards, frequency bands, a subset of the pservers

def _hot_ids_sample(height: int, hot: int = 4, seed: int = 0) -> np.ndarray:
    """`hot` ids (the first rows) drawing 80% of the lookups, the rest uniform over the table."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.repeat(np.arange(hot), 20_000 * 4 // hot), rng.integers(hot, height, 20_000)])


def _distributed_table(height: int = 40_000, width: int = 16, optimizer: str = "adagrad") -> ParamInfo:
    return dense("emb", (height, width), optimizer, sparse=True, table=True, distributed=True)


# Per-lookup work well above the fixed per-pserver RPC and block costs (the defaults' fixed

# 4 x rpc_us per pserver, ~1.6 ms, would dilute any spread of the lookups; a synthetic case

# with a known optimum must not move with the machine's calibration)
LOOKUP_RATES = Rates(bandwidth=1e9, sparse_bandwidth=1e9, rpc_us=100.0, block_us=50.0, row_us=0.2, id_us=0.2,
                     merge_us=0.01, var_us=0.0, op_us={"sum": 0.001, "scale": 0.001, "sgd": 0.002, "adagrad": 0.002},
                     prefetch_rpc_us=100.0)


def _best_by_kind(table, sample, cap=None, rates=None) -> dict[str, float]:
    """The slowest pserver's estimate of the planner's best plan with one partition kind
    allowed at a time (None where nothing of that kind fits the cap)."""
    out = {}
    for kind in ("whole", "row", "column", "2-D", "mod"):
        planner = PlanPartitioner(id_samples={"emb": sample}, batch_size=4096, memory_cap=cap, kinds={"emb": (kind,)},
                                  rates=rates)
        try:
            run(planner, [table], 4)
        except TranspileError:
            out[kind] = None
            continue
        out[kind] = max(planner.loads)
    return out


def test_id_mod_shards_spread_hot_ids_that_no_row_band_can():
    """Four hot ids in the first rows of a distributed table (80% of the lookups), the rest
    uniform: row bands can isolate the hot ids but one band keeps the cold rows with a hot
    one; `id % 4` puts one hot id and a quarter of the cold ones on each pserver: the known
    optimum, well ahead of every other kind (`LOOKUP_RATES`: the lookups' work dominates)."""
    table = _distributed_table()
    sample = _hot_ids_sample(table.rows)
    planner = PlanPartitioner(id_samples={"emb": sample}, batch_size=4096, rates=LOOKUP_RATES)
    run(planner, [table], 4)
    assert sorted(planner.table_shards(table)) == [0, 1, 2, 3]
    assert max(planner.loads) / min(planner.loads) < 1.05  # the hot ids one per pserver
    best = _best_by_kind(table, sample, rates=LOOKUP_RATES)
    assert max(planner.loads) == pytest.approx(best["mod"])
    assert all(best[kind] > 1.2 * best["mod"] for kind in ("whole", "row", "column", "2-D"))


def test_a_memory_cap_forces_the_best_plan_that_fits():
    """A hot-first Zipf distributed table: unconstrained, row bands by frequency win (a
    short hot band, a cold band of 60% of the rows); under a cap that band does not fit
    (nor does a shard of `id % 4`, which declares the table's whole height of grads), and
    the plan is the best of the kinds that fit, by enumeration."""
    table = _distributed_table()
    rng = np.random.default_rng(1)
    sample = (rng.zipf(1.1, 50_000) - 1) % table.rows
    unit = 4 * table.rows * table.cols  # bytes of the whole table
    free = PlanPartitioner(id_samples={"emb": sample}, batch_size=4096, rates=LOOKUP_RATES)
    parts, _ = run(free, [table], 4)["emb"]
    assert free.table_shards(table) is None and len(parts) == 4 and parts[0].rows < 100 < 20_000 < parts[-1].rows
    assert max(free.loads) == pytest.approx(min(v for v in _best_by_kind(table, sample, rates=LOOKUP_RATES).values()))
    cap = 2 * unit
    assert max(free.memory) > cap
    capped = PlanPartitioner(id_samples={"emb": sample}, batch_size=4096, memory_cap=cap, rates=LOOKUP_RATES)
    run(capped, [table], 4)
    assert max(capped.memory) <= cap and max(capped.loads) > max(free.loads)
    fitting = _best_by_kind(table, sample, cap, LOOKUP_RATES)
    assert fitting["mod"] is None and fitting["row"] is not None
    assert max(capped.loads) == pytest.approx(min(v for v in fitting.values() if v is not None))


def test_frequency_bands_beat_even_bands_and_put_the_hot_rows_in_a_short_band():
    """A hot-first Zipf table (not distributed: no id % k): row bands of equal estimated
    time are the optimum among the row cuts, far ahead of even bands (the built-in rates
    with RPCs of 100 µs: fixed costs small beside the rows')."""
    rng = np.random.default_rng(1)
    sample = (rng.zipf(1.1, 50_000) - 1) % 100_000
    table = dense("emb", (100_000, 64), "adagrad", sparse=True, table=True)
    planner = PlanPartitioner(id_samples={"emb": sample}, batch_size=2000, kinds={"emb": ("row",)}, rates=FEW_FIXED)
    parts, servers = run(planner, [table], 4)["emb"]
    assert len(parts) == 4 and sorted(servers) == [0, 1, 2, 3] and planner.table_shards(table) is None
    assert parts[0].rows < 1000 < 25_000 < parts[-1].rows
    even = PlanPartitioner(id_samples={"emb": sample}, batch_size=2000, kinds={"emb": ("row",)}, rates=FEW_FIXED)
    even_loads = loads(even, [table], {"emb": (grid_partitions(table, (4, 1)), [0, 1, 2, 3])}, 4)
    assert max(even_loads) > 1.5 * max(planner.loads)
    assert max(planner.loads) / min(planner.loads) < 1.05


def test_a_table_with_few_lookups_stays_on_a_subset_of_the_pservers():
    """Each partition of a prefetched table costs every trainer a prefetch RPC: a table with
    few lookups is kept whole, on one pserver, beside three dense params one per pserver
    (the known optimum: one part per pserver)."""
    table = dense("emb", (1000, 8), "sgd", sparse=True, table=True)
    params = [table, *(dense(f"w{i}", (200, 50)) for i in range(3))]
    planner = PlanPartitioner(rates=RATES, batch_size=8)
    placed = run(planner, params, 4)
    assert len(placed["emb"][0]) == 1
    assert sorted(server for name in placed for server in placed[name][1]) == [0, 1, 2, 3]


@pytest.mark.parametrize("only", [None, 3], ids=["planner's k", "k=3"])
def test_id_mod_shards_on_all_or_a_subset_of_the_pservers(only, monkeypatch):
    """Forced to `id % k` (kinds), the planner picks k and distinct pservers; k = 4 over 4
    pservers is Paddle's own sharding (the same table vars), and k < 4 (here forced to 3)
    a table on k of them that the transpiler builds and verifies."""
    import sys

    import transpiler.planner as planner_module

    if only is not None:
        every = planner_module.candidates
        monkeypatch.setattr(planner_module, "candidates", lambda params, servers, allowed=planner_module.KINDS: [
            c for c in every(params, servers, allowed) if c.kind != "mod" or c.grid[0] == only])

    sys.path.insert(0, str(PADDLE_PROGRAMS.parents[2] / "examples"))
    try:
        import train_ctr
    finally:
        sys.path.pop(0)
    from transpiler.ir.printer import dump

    main, startup = train_ctr.build_ctr("distributed", 40_000, 16, "adagrad")
    eps = [f"127.0.0.1:{i}" for i in range(1, 5)]
    paddle = transpile(main, startup, pservers=eps, trainers=2, verify=True)
    # a batch whose distinct ids need every pserver (the trainer merges its grad rows: hot ids are cheap)
    planner = PlanPartitioner(kinds={"emb": ("mod",)}, id_samples={"emb": _hot_ids_sample(40_000)}, batch_size=4096)
    result = transpile(main, startup, pservers=eps, trainers=2, partitioner=planner, verify=True)
    shards = result.plan.table.endpoints
    assert len(set(shards)) == len(shards) == (only or 4) and "emb" not in [p.param for p in result.plan.params]
    assert shards == tuple(eps[s] for s in planner.table_shards(_distributed_table()))
    for shard, endpoint in enumerate(shards):  # the planner's memory for its shard is what the program declares
        declared = declared_memory(result.plan, endpoint, result.pservers[endpoint][0])
        cost = mod_shard_cost("adagrad", DType.FP32, (40_000, 16), shard, len(shards), Job(2), Rates(), None)
        assert declared.memory["table"] == cost.memory["table"]
        assert declared.memory["grad_buffers"] >= cost.memory["grad_buffers"]  # + the prefetch buffers (runtime-sized)
        assert declared.memory["optimizer_state"] >= cost.memory["optimizer_state"]
    if len(shards) == 4:  # shard i declares what Paddle's pserver i does for the table
        def table_vars(program):
            return [line for line in dump(program).splitlines() if line.startswith("  var emb")]

        for shard, endpoint in enumerate(shards):
            assert table_vars(result.pservers[endpoint][0]) == table_vars(paddle.pservers[eps[shard]][0])
    else:
        idle = [ep for ep in eps if ep not in shards]
        assert all("emb" not in dump(result.pservers[ep][0]) for ep in idle)


def test_the_plan_is_the_same_under_any_hash_seed(tmp_path):
    """Every trainer computes the same plan: no set or dict order leaks into it."""
    import subprocess
    import sys

    script = tmp_path / "plan.py"
    script.write_text(
        "import json, numpy as np\n"
        "from transpiler.partition import ParamInfo\n"
        "from transpiler.ir.types import DType\n"
        "from transpiler.planner import PlanPartitioner\n"
        "rng = np.random.default_rng(0)\n"
        "sample = np.concatenate([np.repeat(np.arange(4), 20000), rng.integers(4, 40000, 20000)])\n"
        "params = [ParamInfo('emb', (40000, 16), DType.FP32, 'adagrad', True, True, True),\n"
        "          ParamInfo('t2', (50000, 8), DType.FP32, 'adagrad', True, True)]\n"
        "params += [ParamInfo(f'w{i}', (100 * (i % 5 + 1), 30 + i), DType.FP32, 'adam') for i in range(12)]\n"
        "for cores in (None, 2):\n"
        "    p = PlanPartitioner(id_samples={'emb': sample}, batch_size=1024, colocate=[('w1', 'w2')], cores=cores)\n"
        "    p.servers, p.trainers = 4, 2\n"
        "    p.prepare(params)\n"
        "    print(json.dumps({q.name: [[[x.start_row, x.end_row, x.start_col, x.end_col] for x in p.partitions(q)], p._result[q.name][1]] for q in params}),\n"
        "          p.table_shards(params[0]), p.chosen_from, json.dumps(p.considered))\n"
    )
    import os

    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(PADDLE_PROGRAMS.parents[2])}
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
        outs.add(done.stdout)
    assert len(outs) == 1


def test_table_shards_naming_a_pserver_twice_is_refused():
    import sys

    sys.path.insert(0, str(PADDLE_PROGRAMS.parents[2] / "examples"))
    try:
        import train_ctr
    finally:
        sys.path.pop(0)

    class Twice(PlanPartitioner):
        def table_shards(self, param):
            return [0, 0] if param.distributed else None

    main, startup = train_ctr.build_ctr("distributed", 1000, 8)
    with pytest.raises(TranspileError, match=r"table_shards\('emb'\) returned \[0, 0\]; it must name distinct "
                                             r"pservers 0\.\.1"):
        transpile(main, startup, pservers=["127.0.0.1:1", "127.0.0.1:2"], trainers=2, partitioner=Twice())


def test_cli_plan_reports_a_table_kept_id_mod_k(capsys, tmp_path):
    """A distributed table with hot ids spread by `id % 4`: `pstranspile plan --partitioner
    plan` keeps it sharded and says so, in text (`mod`, `id%4`) and JSON."""
    import sys

    sys.path.insert(0, str(PADDLE_PROGRAMS.parents[2] / "examples"))
    try:
        import train_ctr
    finally:
        sys.path.pop(0)
    main, startup = train_ctr.build_ctr("distributed", 40_000, 16, "adagrad")
    main.save(tmp_path / "main.pb")
    startup.save(tmp_path / "startup.pb")
    np.save(tmp_path / "ids.npy", _hot_ids_sample(40_000))
    base = ["plan", tmp_path / "main.pb", "--pservers", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4",
            "--trainers", "2", "--id-sample", tmp_path / "ids.npy", "--batch-size", "4096", "--partitioner", "plan"]
    code, out, err = cli(capsys, *base)  # (a smaller batch's distinct rows fit row bands on 3 pservers)
    assert code == 0, err
    assert re.search(r"^emb +mod +id%4 +4$", out, re.M)
    code, out, err = cli(capsys, *base, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["table"]["endpoints"]) == 4 and "emb" not in [p["param"] for p in data["params"]]
    assert {"param": "emb", "kind": "mod", "grid": [1, 1, 1, 1], "pservers": data["table"]["endpoints"]} in \
        data["cost"]["params"]


def test_a_table_whose_trainer_merges_its_grads_gets_a_wider_hot_band():
    """A trainer that merges its table's grad (`merged_grad`) sends the hot ids once a step,
    not once per lookup: the hot band's estimate falls, so the bands of equal estimated time
    give it more rows than when every lookup sends a row."""
    rng = np.random.default_rng(1)
    sample = (rng.zipf(1.1, 50_000) - 1) % 100_000
    bands = {}
    for merged in (False, True):
        table = dense("emb", (100_000, 64), "adagrad", sparse=True, table=True, merged_grad=merged)
        planner = PlanPartitioner(id_samples={"emb": sample}, batch_size=2000, kinds={"emb": ("row",)})
        parts, _ = run(planner, [table], 4)["emb"]
        bands[merged] = parts[0].rows
        assert max(planner.loads) / min(planner.loads) < 1.05  # still balanced, by its own estimate
    assert bands[True] > 2 * bands[False]
@pytest.mark.parametrize("cores, parts", [(None, 4), (4, 4), (2, 2), (1, 1)])
def test_pservers_sharing_cores_cut_a_param_into_as_many_parts_as_cores(cores, parts):
    """One big param, 4 pservers sharing `cores` cores: a step takes at least the larger of
    the slowest pserver's time and all the pservers' time over the cores, and each part
    adds its own per-block work. Optimum: one part per core (`cores` parts on distinct
    pservers): fewer leaves a core idle, more adds work no core is free to run. Each part's
    block costs 15% of the param's time here, above the planner's TOLERANCE (2%) and 10%, below
    which more parts would win on the lighter slowest pserver."""
    params = [dense("w", (4000, 1000), "adam")]
    rates = Rates(bandwidth=RATES.bandwidth, rpc_us=RATES.rpc_us, op_us=dict(RATES.op_us), row_us=RATES.row_us,
                  block_us=15000.0)
    planner = PlanPartitioner(rates=rates, cores=cores, baselines=False)
    placed = run(planner, params, 4)
    got, servers = placed["w"]
    assert len(got) == parts and len(set(servers)) == parts
    assert max(p.numel for p in got) == min(p.numel for p in got)
    # with the baselines (the default): Paddle's 4 blocks are lighter on the slowest pserver
    # than the search's `cores` parts, which are lighter only on the step bound: neither
    # dominates, and the plan kept is one not worse than Paddle's on either (its 4 blocks)
    seeded = PlanPartitioner(rates=rates, cores=cores)
    got, servers = run(seeded, params, 4)["w"]
    assert len(got) == 4 and sorted(servers) == [0, 1, 2, 3]
    paddle = next(c for c in seeded.considered if c["source"] == "paddle (baseline)")
    assert max(seeded.loads) <= paddle["slowest_us"] + 1e-6


def _plan(name, loads):
    from transpiler.planner import _Plan

    return _Plan(name, [], list(loads), [0] * len(loads))


def test_choose_is_lexicographic_with_a_tolerance_on_the_step_bound():
    """Known optimum by hand, 4 pservers on 2 cores (bound = max(slowest, total / 2)),
    a tolerance of 2%:
    `a` has the least bound (100); `b` is within 2% of it (101) with a lighter slowest
    pserver (60 against 100) and wins; `c`'s slowest is lighter still (50) but its bound
    (110) is 10% over: it loses."""
    from transpiler.planner import TOLERANCE, choose

    assert TOLERANCE == 0.02
    a = _plan("a", [100, 50, 30, 20])  # bound max(100, 200 / 2) = 100
    b = _plan("b", [60, 60, 41, 41])  # bound 101
    c = _plan("c", [55, 55, 55, 55])  # bound 110, slowest 55
    pick, considered = choose([a, b, c], [], shared=2, tolerance=0.02)
    assert pick is b and [r["chosen"] for r in considered] == [False, True, False]
    assert [r["bound_us"] for r in considered] == [100, 101, 110]
    # 3% over the best is outside the tolerance: the least bound wins even with a heavier slowest
    pick, _ = choose([a, _plan("d", [60, 60, 41, 45])], [], shared=2, tolerance=0.02)
    assert pick is a
    assert choose([a, _plan("d", [60, 60, 41, 45])], [], shared=2, tolerance=0.1)[0].source == "d"  # within 10%
    # equal on both: the fewest RPCs, then the first in order
    assert choose([_plan("e", [10, 10]), _plan("f", [10, 10])], [], shared=2)[0].source == "e"


def test_choose_keeps_a_plan_not_worse_than_both_baselines_when_one_exists():
    """Pareto first: `a` has the best bound but a heavier slowest pserver than the baseline
    `paddle`; `b` is not worse than either baseline on either estimate and is kept; with no
    such plan, the lexicographic choice over all of them."""
    from transpiler.planner import choose

    paddle, balanced = _plan("paddle", [80, 80, 80, 80]), _plan("balanced", [90, 70, 70, 70])  # bounds 160, 150
    a = _plan("a", [100, 100, 0, 0])  # bound 100, slowest 100: worse than both on the slowest
    b = _plan("b", [75, 75, 75, 75])  # bound 150, slowest 75: not worse than either
    pick, considered = choose([a, b], [paddle, balanced], shared=2)
    assert pick is b and [r["dominates_baselines"] for r in considered[:2]] == [False, True]
    pick, _ = choose([a, _plan("c", [85, 85, 85, 85])], [paddle, balanced], shared=2)  # c: slowest 85 > 80
    assert pick is a  # nothing dominates both: the least bound


def test_the_seeds_keep_the_plan_from_being_worse_than_paddle():
    """Two dense params `[4600, 16]`, `[3600, 16]` on 3 pservers: the greedy search alone
    ends 15% heavier on its slowest pserver than Paddle's placement (each param in 3 row
    blocks, round robin: near-equal loads, the known optimum here); seeded with it, the
    plan kept is not worse than Paddle's or `balanced`'s on either estimate."""
    params = [dense("a", (4600, 16)), dense("b", (3600, 16))]
    alone = PlanPartitioner(rates=RATES, baselines=False)
    run(alone, params, 3)
    seeded = PlanPartitioner(rates=RATES)
    placed = run(seeded, params, 3)
    found = {c["source"]: c for c in seeded.considered}
    for base in ("paddle (baseline)", "balanced (baseline)"):
        assert max(seeded.loads) <= found[base]["slowest_us"] + 1e-6
    assert max(alone.loads) > 1.1 * found["paddle (baseline)"]["slowest_us"]
    assert max(seeded.loads) == pytest.approx(sum(seeded.loads) / 3, rel=1e-3)  # every pserver equal
    assert [len(placed[n][0]) for n in "ab"] == [3, 3] and seeded.chosen_from == "paddle improved"


def test_a_hot_first_table_on_shared_cores_gets_bands_of_equal_time():
    """A hot-first Zipf table on 4 pservers sharing 2 cores. The least step bound (the
    pservers' total over the cores): 2 row bands on 2 pservers. At a 2% tolerance, bands of
    equal rows and of equal time have the same bound and the equal-time ones the lighter
    slowest pserver (a short hot band): they are kept. At 15%, 3 bands of equal time are
    within it (one more band's fixed work: each trainer's SendFetchBatch and prefetch, at
    `rpc_us` each) and lighter still on the slowest; 4 bands (Paddle's count) are not."""
    rng = np.random.default_rng(1)
    sample = (rng.zipf(1.1, 50_000) - 1) % 100_000
    table = dense("emb", (100_000, 64), "adagrad", sparse=True, table=True, merged_grad=True)
    tight = PlanPartitioner(id_samples={"emb": sample}, batch_size=2000, cores=2)
    parts, servers = run(tight, [table], 4)["emb"]
    assert len(parts) == 2 and len(set(servers)) == 2 and parts[0].rows < 100_000 // 4
    held = sorted(tight.loads)[-2:]
    assert held[1] / held[0] < 1.05  # the two bands' pservers near equal
    stats = tight._stats([table])
    even = [batch_rpcs(Job(2)) * tight.rates.rpc_us] * 4  # a SendFetchBatch a trainer
    for server, part in enumerate(grid_partitions(table, (2, 1))):
        even[server] += tight.part_cost(table, part, Job(2), stats).time_us(tight.rates)
    assert sum(even) == pytest.approx(sum(tight.loads), rel=0.02) and max(tight.loads) < 0.9 * max(even)

    planner = PlanPartitioner(id_samples={"emb": sample}, batch_size=2000, cores=2, tolerance=0.15)
    parts, servers = run(planner, [table], 4)["emb"]
    assert len(parts) == 3 and len(set(servers)) == 3 and parts[0].rows < parts[1].rows < parts[2].rows
    least = min(c["bound_us"] for c in planner.considered)
    assert least == pytest.approx(sum(tight.loads) / 2)  # the 2 bands' bound is the least found
    kept = max(max(planner.loads), sum(planner.loads) / 2)
    assert least < kept <= 1.15 * least and max(planner.loads) < 0.9 * max(tight.loads)
    four = next(c for c in planner.considered if c["source"] == "search without --pserver-cores")
    assert four["bound_us"] > 1.15 * least


def test_plan_by_name_takes_the_pserver_cores_from_the_environment(monkeypatch):
    from transpiler.partition import resolve_partitioner

    monkeypatch.delenv("PSTRANSPILE_PSERVER_CORES", raising=False)
    assert resolve_partitioner("plan").cores is None
    monkeypatch.setenv("PSTRANSPILE_PSERVER_CORES", "2")
    assert resolve_partitioner("plan").cores == 2
    monkeypatch.setenv("PSTRANSPILE_PSERVER_CORES", "off")
    assert resolve_partitioner("plan").cores is None
    monkeypatch.setenv("PSTRANSPILE_PSERVER_CORES", "two")
    with pytest.raises(TranspileError, match=r"PSTRANSPILE_PSERVER_CORES='two': give a core count >= 1, or off"):
        resolve_partitioner("plan")


@pytest.mark.parametrize("cpus, partitioner, backend, preset, expected", [
    (2, "plan", "local", None, "2"),  # 4 pservers on 2 cores: the plan counts them
    (8, "plan", "local", None, None),  # a core or more per pserver: nothing to count
    (2, "paddle", "local", None, None),  # not the plan
    (2, "plan", "ray", None, None),  # processes on other nodes
    (2, "plan", "local", "off", None),  # the user's own setting is kept (inherited, not overridden)
])
def test_launch_sets_the_pserver_cores_for_the_plan_on_one_host(monkeypatch, cpus, partitioner, backend, preset,
                                                                 expected):
    import transpiler.runtime.launch as launch_module
    from transpiler.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_launch(config, *a, **kw):
        seen["env"] = dict(config.env)
        raise Stop

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    if preset is None:
        monkeypatch.delenv("PSTRANSPILE_PSERVER_CORES", raising=False)
    else:
        monkeypatch.setenv("PSTRANSPILE_PSERVER_CORES", preset)
    main(["launch", "--pservers", "4", "--trainers", "2", "--partitioner", partitioner, "--backend", backend,
          "--", "python3", "train.py"])  # the fake launch stops it: an internal error, after the config was seen
    assert seen["env"].get("PSTRANSPILE_PSERVER_CORES") == expected
