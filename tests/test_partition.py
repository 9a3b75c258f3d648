"""Partitioners (transpiler/partition.py): the built-in cuts, the checks of a user's
partitions, the programs a 2-D plan makes, and sync training with 2-D partitions equal to
local training in float64 (Paddle's mlp_adam_2ps, 2 trainers, 3 pservers)."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS
from e2e_support import EXAMPLES, launch_training, save, trained_params, train_locally
from transpiler.api import transpile
from transpiler.config import DistributeTranspilerConfig
from transpiler.errors import TranspileError
from transpiler.ir import DType, Program
from transpiler.ir.precision import as_float64
from transpiler.partition import AngelPartitioner, ColumnPartitioner, ParamInfo, Partition, Partitioner

sys.path.insert(0, str(EXAMPLES))
from angel_custom_partitioner import ThreeBands, angel_matrix  # noqa: E402

MLP = PADDLE_PROGRAMS / "mlp_adam_2ps"
EPS3 = "127.0.0.1:6170,127.0.0.1:6171,127.0.0.1:6172"


def mlp():
    return Program.load(MLP / "main.pb"), Program.load(MLP / "startup.pb")


def info(shape, name="w"):
    return ParamInfo(name, tuple(shape), DType.FP32, "sgd")


def rects(parts):
    return [(p.start_row, p.end_row, p.start_col, p.end_col) for p in parts]


# ------------------------------------------------------------------ the built-in cuts


def test_angel_on_its_documented_matrix_spreads_over_all_8_servers():
    angel = AngelPartitioner()
    angel.servers = 8
    parts = angel.partitions(info((3, 10_000_000)))
    # rows < S: blockRow = 3, blockCol = min(5M / 3, max(100, 10M / 8)) = 1,250,000
    assert rects(parts) == [(0, 3, c, c + 1_250_000) for c in range(0, 10_000_000, 1_250_000)]
    assert angel.assign(parts) == list(range(8))


def test_angel_rows_at_least_servers():
    angel = AngelPartitioner(max_elements=1000)
    angel.servers = 4
    # blockRow = min(10 / 4, max(1, 1000 / 300)) = 2; blockCol = min(1000 / 2, 300) = 300
    assert rects(angel.partitions(info((10, 300)))) == [(r, r + 2, 0, 300) for r in range(0, 10, 2)]
    # blockRow = min(100 / 4, max(1, 1000 / 5000)) = 1; blockCol = min(1000, 5000) = 1000
    parts = angel.partitions(info((100, 5000)))
    assert len(parts) == 500 and rects(parts)[:6] == [(0, 1, c, c + 1000) for c in range(0, 5000, 1000)] + [(1, 2, 0, 1000)]


def test_column_cuts_columns_of_rank_2_dense_sparse_and_prefetched():
    column = ColumnPartitioner()
    column.servers = 3
    assert rects(column.partitions(info((4, 10)))) == [(0, 4, 0, 4), (0, 4, 4, 7), (0, 4, 7, 10)]
    assert rects(column.partitions(info((7,)))) == [(0, 7, 0, 1)]
    assert rects(column.partitions(info((2, 3, 4)))) == [(0, 2, 0, 12)]
    sparse = ParamInfo("emb", (100, 16), DType.FP32, "sgd", sparse=True)
    assert rects(column.partitions(sparse)) == [(0, 100, 0, 6), (0, 100, 6, 11), (0, 100, 11, 16)]
    table = ParamInfo("emb", (100, 16), DType.FP32, "sgd", sparse=True, table=True)
    assert rects(column.partitions(table)) == [(0, 100, 0, 6), (0, 100, 6, 11), (0, 100, 11, 16)]


def test_the_custom_example_transpiles_to_8_partitions_on_8_pservers():
    main, startup = angel_matrix()
    pservers = ",".join(f"127.0.0.1:{6170 + i}" for i in range(8))
    result = transpile(main, startup, pservers=pservers, trainers=2, partitioner=ThreeBands)
    w = result.plan.param("w")
    assert [(b.row_offset, b.rows, b.col_offset, b.cols) for b in w.blocks] == [
        (0, 1, 0, 2_500_000), (0, 1, 2_500_000, 2_500_000), (0, 1, 5_000_000, 2_500_000), (0, 1, 7_500_000, 2_500_000),
        (1, 1, 0, 5_000_000), (1, 1, 5_000_000, 5_000_000), (2, 1, 0, 5_000_000), (2, 1, 5_000_000, 5_000_000)]
    assert w.endpoints == pservers.split(",")
    ops = [(op.type, op.attr("axis") if op.has_attr("axis") else None) for op in result.trainer.global_block().ops
           if op.type in ("split_byref", "split", "concat")]
    assert ops == [("split_byref", None), ("split", 1), ("split", 1), ("split", 1),
                   ("concat", 1), ("concat", 1), ("concat", 1), ("concat", 0)]


# ------------------------------------------------------------------ checks


class Fixed(Partitioner):
    def __init__(self, parts, servers=None):
        super().__init__()
        self.parts, self.servers_out = parts, servers

    def partitions(self, param):
        return self.parts if param.name == "h2.w" else [Partition(0, param.rows, 0, param.cols)]

    def assign(self, partitions):
        if self.servers_out is not None and partitions[0].param.name == "h2.w":
            return self.servers_out
        return super().assign(partitions)


@pytest.mark.parametrize(("parts", "servers", "problem"), [
    ([Partition(0, 256, 0, 64)], None, "columns [64, 128) of rows [0, 256) are in no partition (a gap)"),
    ([Partition(0, 200, 0, 128)], None, "rows [200, 256) are in no partition (a gap)"),
    ([Partition(0, 256, 0, 70), Partition(0, 256, 64, 128)], None, "partitions overlap at rows [0, 256) column 64"),
    ([Partition(0, 256, 0, 129)], None, "is empty or out of range"),
    ([Partition(0, 128, 0, 64), Partition(0, 256, 64, 128), Partition(128, 256, 0, 64)], None, "not laid out in row bands"),
    ([Partition(0, 256, 0, 64), Partition(0, 256, 64, 128)], [0, 3], "pserver index 3, out of range for 3"),
    ([Partition(0, 256, 0, 64), Partition(0, 256, 64, 128)], [0], "returned 1 pserver indices for 2 partitions"),
])
def test_bad_partitions_are_one_error_naming_the_param(parts, servers, problem):
    with pytest.raises(TranspileError, match="h2.w") as caught:
        transpile(*mlp(), pservers=EPS3, trainers=2, partitioner=Fixed(parts, servers))
    assert problem in str(caught.value)


def test_unknown_partitioner_and_runtime_split_are_refused():
    with pytest.raises(TranspileError, match="unknown partitioner 'nope'"):
        transpile(*mlp(), pservers=EPS3, trainers=2, partitioner="nope")
    config = DistributeTranspilerConfig()
    config.runtime_split_send_recv = True
    config.partitioner = "column"
    with pytest.raises(TranspileError, match="runtime_split_send_recv"):
        transpile(*mlp(), pservers=EPS3, trainers=2, sync_mode=False, config=config)


def test_paddle_is_the_default_and_unchanged():
    default = transpile(*mlp(), pservers=EPS3, trainers=2)
    named = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner="paddle")
    assert default.plan.to_json_text() == named.plan.to_json_text()
    assert "partitioner" not in default.plan.to_json()
    assert default.trainer.to_bytes() == named.trainer.to_bytes()


def test_config_and_module_class_name_the_partitioner():
    config = DistributeTranspilerConfig()
    config.partitioner = "angel_custom_partitioner:ThreeBands"
    result = transpile(*mlp(), pservers=EPS3, trainers=2, config=config)
    assert result.plan.partitioner == "three_bands"
    assert [len(band) for band in result.plan.param("h1.w").bands()] == [4, 2, 2]


def test_2d_pserver_blocks_are_elementwise_adam_on_the_rectangle():
    result = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner="column")
    h1 = result.plan.param("h1.w")
    for block, endpoint in zip(h1.blocks, h1.endpoints, strict=True):
        main = result.pservers[endpoint][0]
        var = main.global_block().var(block.name)
        assert tuple(var.shape) == (784, block.cols)
        adam = [op for b in main.blocks for op in b.ops if op.type == "adam" and list(op.input("Param")) == [block.name]]
        assert len(adam) == 1
        moment = main.global_block().var(adam[0].input("Moment1")[0])
        assert tuple(moment.shape) == (784, block.cols)


# ------------------------------------------------------------------ distributed equals local


@pytest.mark.parametrize(("fixture", "partitioner", "expected_partitions"), [
    ("mlp_adam_2ps", "column", 3 * 3 + 3),  # each weight in 3 column ranges, each bias whole
    # rows >= 3: bands of rows // 3 rows, and a short 4th (784, 256, 128, 10 rows: none divides by 3)
    ("mlp_adam_2ps", "angel", 6 * 4),
    ("mlp_adam_2ps", "angel_custom_partitioner:ThreeBands", 3 * 8 + 3 * 3),  # weights 4 + 2 + 2, biases 3 bands
    # Fluid 1.8's exponential_decay on the pservers (an lr-decay block), SGD on rectangles
    ("fluid18_lr_exp_decay_2ps", "column", 3 + 1),
])
def test_float64_sync_training_with_2d_partitions_equals_local(fixture, partitioner, expected_partitions, tmp_path):
    folder = PADDLE_PROGRAMS / fixture
    main, startup = (as_float64(Program.load(folder / f)) for f in ("main.pb", "startup.pb"))
    main_pb, startup_pb = save(tmp_path, main, startup)
    launch_training(tmp_path, main_pb, startup_pb, pservers=3,
                    env={"PSTRANSPILE_PARTITIONER": partitioner, "PYTHONPATH": str(EXAMPLES.parent)})
    name = {"angel_custom_partitioner:ThreeBands": "three_bands"}.get(partitioner, partitioner)
    held = 0
    for i in range(3):
        log = (tmp_path / "logs" / f"pserver.{i}.log").read_text()
        found = re.search(rf"(\d+) partition\(s\) of \d+ param\(s\), partitioner {name}\n", log)
        assert found, log
        held += int(found[1])
    assert held == expected_partitions
    init0, final0 = trained_params(tmp_path, 0)
    init1, final1 = trained_params(tmp_path, 1)
    for name in init0:
        assert np.array_equal(init0[name], init1[name]) and np.array_equal(final0[name], final1[name]), name
    local = train_locally(tmp_path, main_pb, startup_pb)
    assert local.keys() == final0.keys() and local
    for name in local:
        assert final0[name].dtype == np.float64 and np.abs(local[name] - init0[name]).max() > 0, name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-5, atol=0, err_msg=f"{partitioner}: {name}")


# (column cuts alone of a sparse grad: the prefetched-table test below; this fixture
# receives its 100000 x 16 table whole every step, so one case of it)
@pytest.mark.parametrize(("partitioner", "emb_partitions"), [
    ("angel_custom_partitioner:ThreeBands", 8),  # three row bands in 4, 2 and 2 column ranges
])
def test_float64_sparse_embedding_cut_by_columns_equals_local(partitioner, emb_partitions, tmp_path):
    """Paddle's ctr_v1_sparse_sgd_2ps (an is_sparse embedding, SelectedRows grads, SGD):
    its grads cut by row bands and column ranges, 2 trainers x 3 pservers, equal local."""
    folder = PADDLE_PROGRAMS / "ctr_v1_sparse_sgd_2ps"
    main, startup = (as_float64(Program.load(folder / f)) for f in ("main.pb", "startup.pb"))
    spec = ThreeBands if ":" in partitioner else partitioner
    plan = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=spec).plan
    emb = plan.param("emb")
    assert emb.sparse and emb.cuts_columns and len(emb.blocks) == emb_partitions
    main_pb, startup_pb = save(tmp_path, main, startup)
    launch_training(tmp_path, main_pb, startup_pb, pservers=3,
                    env={"PSTRANSPILE_PARTITIONER": partitioner, "PYTHONPATH": str(EXAMPLES.parent)})
    init0, final0 = trained_params(tmp_path, 0)
    local = train_locally(tmp_path, main_pb, startup_pb)
    assert local.keys() == final0.keys() and "emb" in local
    for name in local:
        assert np.abs(local[name] - init0[name]).max() > 0, name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-5, atol=0, err_msg=f"{partitioner}: {name}")


@pytest.mark.parametrize("partitioner", ["column", "angel_custom_partitioner:ThreeBands"])
def test_float64_prefetched_table_cut_by_columns_equals_local(partitioner, tmp_path):
    """examples/train_ctr.py's remote-prefetch table (20000 x 16, Adagrad): each lookup
    asks every column piece of its row band and joins them (`distributed_lookup_table`'s
    column_sections / column_offsets), the grads are cut the same way; 2 trainers x 3
    pservers, float64, every dense param and touched row equal to local training."""
    import ctr
    from e2e_support import launch_ok, run_script_locally

    main, startup = ctr.build(is_sparse=True, is_distributed=False, table=(20_000, 16))
    spec = ThreeBands if ":" in partitioner else partitioner
    result = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=spec)
    emb = result.plan.param("emb")
    assert emb.remote_prefetch and emb.cuts_columns
    lookup = next(op for op in result.trainer.global_block().ops if op.type == "distributed_lookup_table")
    assert list(lookup.attr("column_sections")) == [b.cols for b in emb.blocks]
    common = (str(EXAMPLES / "train_ctr.py"), "--variant", "local-table", "--rows", "20000", "--steps", "10",
              "--batch", "32", "--quiet", "--float64")
    launch_ok(tmp_path, (sys.executable, *common, "--save", str(tmp_path / "params")), pservers=3, trainers=2,
              sync_mode=True, timeout=60.0,
              env={"PSTRANSPILE_PARTITIONER": partitioner, "PYTHONPATH": f"{EXAMPLES.parent}{os.pathsep}{EXAMPLES}"})
    run_script_locally((*common, "--init", str(tmp_path / "params" / "trainer_0.npz"), "--save", str(tmp_path / "local")))
    dist, local = np.load(tmp_path / "params" / "trainer_0.npz"), np.load(tmp_path / "local" / "local.npz")
    finals = [k for k in local.files if k.startswith(("final/", "final_rows/"))]
    assert "final_rows/emb" in finals
    for key in finals:
        start = key.replace("final", "init", 1)
        assert np.abs(local[key] - local[start]).max() > 0, key
        np.testing.assert_allclose(dist[key], local[key], rtol=1e-5, atol=0, err_msg=f"{partitioner}: {key}")


# ------------------------------------------------------------------ goldens


@pytest.mark.parametrize("partitioner", ["column", "angel", "three_bands"])
def test_2d_golden(golden, partitioner):
    """The plan report and every program's dump of Paddle's mlp_adam_2ps cut by each
    partitioner, on 3 pservers (tests/golden/transpile/partition-*.txt; `--update-golden`)."""
    from test_api_golden import render

    spec = ThreeBands if partitioner == "three_bands" else partitioner
    result = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner=spec, verify=True)
    golden.check(f"transpile/partition-mlp_adam_2ps-{partitioner}-3ps.txt", render(result))


# ------------------------------------------------------------------ checkpoints and fetch


def _layouts(result):
    from ops.rpc.checkpoint import pserver_layout

    plan = result.plan.to_json()
    grads = {g for p in result.plan.params for b in p.blocks for g in result.plan.trainer_grad_names(p, b.index)}
    grads |= {p.grad_block_name(b.index) for p in result.plan.params for b in p.blocks}
    return {ep: pserver_layout(main, plan, ep, grads) for ep, (main, _) in result.pservers.items()}


def test_checkpoints_of_2d_partitions_merge_and_reshard_onto_other_partitioners(tmp_path):
    """Save the pservers of a three_bands plan (params and Adam moments cut in rectangles),
    read every var back whole, and restore onto 2 pservers cut by paddle and by column."""
    from ops.rpc.checkpoint import Checkpointer, CheckpointReader
    from ops.scope import Scope
    from ops.tensor import LoDTensor

    main, startup = mlp()
    result = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=ThreeBands)
    layouts = _layouts(result)
    h1 = layouts["127.0.0.1:6170"]["h1.w.block0"]
    assert h1.rows == (0, 262) and h1.cols == (0, 64) and h1.piece_shape() == (262, 64)
    rng = np.random.default_rng(0)
    wholes: dict[str, np.ndarray] = {}
    parts = tuple(f"ps{i}" for i in range(3))
    for i, (endpoint, layout) in enumerate(layouts.items()):
        scope = Scope()
        for name, where in layout.items():
            if where.origin not in wholes:
                wholes[where.origin] = rng.standard_normal(where.whole_shape).astype(np.float32)
            scope.set_var(name, LoDTensor(np.array(where.cut(wholes[where.origin]))))
        Checkpointer(tmp_path, parts[i], parts, layout, result.plan.to_json_text(), 3).save(scope, "ckpt-5")
    reader = CheckpointReader(tmp_path)
    cut_moments = [o for o in wholes if o.startswith("h1.w_moment1")]
    assert cut_moments, sorted(wholes)
    for origin, whole in wholes.items():
        assert np.array_equal(reader.whole(origin), whole), origin
    for spec, count in (("paddle", 2), ("column", 2), ("angel", 4)):
        eps = ",".join(f"127.0.0.1:{7000 + i}" for i in range(count))
        other = transpile(main, startup, pservers=eps, trainers=2, partitioner=spec)
        for i, layout in enumerate(_layouts(other).values()):
            scope = Scope()
            reader.restore(scope, layout, f"ps{i}", count)
            for name, where in layout.items():
                assert np.array_equal(scope.find_var(name).array, where.cut(wholes[where.origin])), (spec, name)


def test_fetch_joins_2d_blocks_into_whole_params():
    from ops.rpc.fetch import _join_2d

    result = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner=ThreeBands)
    param = next(p for p in result.plan.to_json()["params"] if p["param"] == "out.w")
    whole = np.arange(1280, dtype=np.float64).reshape(128, 10)
    blocks = [whole[b["row_offset"]:b["row_offset"] + b["rows"], b["col_offset"]:b["col_offset"] + b["cols"]]
              for b in param["blocks"]]
    assert len(blocks) == 8 and np.array_equal(_join_2d(param, blocks), whole)


# ------------------------------------------------------------------ the CLI


def test_cli_plan_shows_the_grid_json_and_svg(tmp_path, capsys):
    from transpiler.cli import main as cli_main

    args = ["plan", str(MLP / "main.pb"), "--pservers", EPS3, "--trainers", "2", "--partitioner", "column"]
    assert cli_main([*args, "--svg", str(tmp_path / "plan.svg")]) == 0
    text = capsys.readouterr().out
    assert "partitioner column" in text and "h1.w [784, 256] fp32 (adam, grad h1.w@GRAD, grid 1x3)" in text
    assert re.search(r"h1.w.block1 +127.0.0.1:6172 +0:784,86:171 \[784, 85\]", text), text
    svg = (tmp_path / "plan.svg").read_text()
    import xml.etree.ElementTree as ET

    assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"  # well-formed
    grid = svg.split('<g id="cost">')[0]  # the cost bars follow the grids (tests/test_cost_report.py)
    assert svg.startswith("<svg") and grid.count("<rect") == 3 + 3 * 3 + 3  # legend + 3 weights x 3 + 3 biases
    assert "h1.w.block1 rows 0:784 cols 86:171 on 127.0.0.1:6172" in svg
    assert cli_main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    h1 = next(p for p in plan["params"] if p["param"] == "h1.w")
    assert plan["partitioner"] == "column" and h1["grid"] == [3]
    assert [(b["col_offset"], b["cols"]) for b in h1["blocks"]] == [(0, 86), (86, 85), (171, 85)]


def test_cli_bad_partitioner_is_one_line_and_exit_2(capsys):
    from transpiler.cli import main as cli_main

    args = ["plan", str(MLP / "main.pb"), "--pservers", EPS3, "--trainers", "2", "--partitioner", "nosuch:Thing"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "cannot import 'nosuch'" in err and len(err.strip().splitlines()) == 1


def test_cli_transpile_with_a_partitioner_writes_its_plan(tmp_path):
    from transpiler.cli import main as cli_main

    argv = ["transpile", str(MLP / "main.pb"), "--pservers", EPS3, "--trainers", "2", "--partitioner", "angel",
            "-o", str(tmp_path)]
    assert cli_main(argv) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["partitioner"] == "angel" and [len(p["blocks"]) for p in plan["params"]] == [4] * 6


def test_cli_launch_gives_every_process_the_partitioner(tmp_path):
    from transpiler.cli import main as cli_main

    script = "import os, sys; open(sys.argv[1] + os.environ['TRAINING_ROLE'], 'w').write(os.environ['PSTRANSPILE_PARTITIONER'])"
    argv = ["launch", "-q", "--pservers", "1", "--trainers", "1", "--partitioner", "angel", "--log-dir",
            str(tmp_path / "logs"), "--exit-grace", "5", "--", sys.executable, "-c", script, str(tmp_path / "seen_")]
    assert cli_main(argv) == 0
    assert (tmp_path / "seen_PSERVER").read_text() == (tmp_path / "seen_TRAINER").read_text() == "angel"


def test_a_checkpoint_of_column_partitions_restores_onto_paddle_blocks_and_another_pserver_count(tmp_path):
    """A job cut by `column` on 3 pservers checkpoints at step 6; a job cut by `paddle` on 2
    pservers restores it and trains on to step 12: bit-identical to 12 steps cut by
    `column` throughout (element-wise Adam on rectangles or row blocks computes the same)."""
    import mlp
    from e2e_support import launch_ok
    from test_e2e_recovery import command, finals

    main_pb, startup_pb = save(tmp_path, *mlp.build())
    column = {"PSTRANSPILE_PARTITIONER": "column"}
    launch_ok(tmp_path / "reference", command(main_pb, startup_pb, tmp_path / "reference" / "params", steps=12),
              pservers=3, trainers=2, sync_mode=True, timeout=60.0, env=column)
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "6")
    launch_ok(tmp_path / "first", command(main_pb, startup_pb, tmp_path / "first" / "params", *ckpt, steps=6),
              pservers=3, trainers=2, sync_mode=True, timeout=60.0, env=column)
    manifest = json.loads((tmp_path / "ckpt" / "ckpt-6" / "MANIFEST.json").read_text())
    cut = [e for part in manifest["parts"].values() for e in part.values() if e.get("cols")]
    assert {e["origin"] for e in cut} >= {"h1.w", "h1.w_moment1_0", "h1.w_moment2_0"}
    launch_ok(tmp_path / "second", command(main_pb, startup_pb, tmp_path / "second" / "params", *ckpt, "--restore",
                                           str(tmp_path / "ckpt"), steps=12),
              pservers=2, trainers=2, sync_mode=True, timeout=60.0, env={"PSTRANSPILE_PARTITIONER": "paddle"})
    reference, restored = finals(tmp_path / "reference" / "params"), finals(tmp_path / "second" / "params")
    after_six = finals(tmp_path / "first" / "params")
    started = np.load(tmp_path / "second" / "params" / "trainer_0.npz")
    for name, value in after_six.items():  # the second job began where the first stopped, not from scratch
        assert np.array_equal(started[f"init/{name}"], value), name
    assert any(not np.array_equal(after_six[name], reference[name]) for name in reference)
    assert reference.keys() == restored.keys() and reference
    for name, value in reference.items():
        assert np.array_equal(restored[name], value), (name, np.abs(restored[name] - value).max())


def test_a_column_cut_of_a_param_lars_updates_is_refused_rows_are_not():
    """LARS scales a param's step by its norm: a column partition would change it."""
    from ops.catalogue import make_op
    from transpiler.frontend import ParamAttr, Program as Builder, data, layers, optimizer, program_guard, unique_name
    from transpiler.ir import OpRole

    main, startup = Builder(), Builder()
    with unique_name.guard(), program_guard(main, startup):
        x = data(name="x", shape=[None, 8], dtype="float32")
        y = layers.fc(input=x, size=6, param_attr=ParamAttr(name="w"), bias_attr=False)
        optimizer.Momentum(learning_rate=0.1, momentum=0.9).minimize(layers.mean(y))
    block = main.global_block()
    momentum = next(op for op in block.ops if op.type == "momentum")
    lars = make_op("lars_momentum", dict(momentum.inputs), dict(momentum.outputs), {"mu": 0.9},
                   role=OpRole.Optimize, role_vars=momentum.role_vars)
    block.insert_before(momentum, lars)
    block.remove_op(momentum)
    with pytest.raises(TranspileError, match="param 'w' is cut by columns, but its pserver op 'lars_momentum'"):
        transpile(main, startup, pservers=EPS3, trainers=2, partitioner="column")
    rows = transpile(main, startup, pservers=EPS3, trainers=2, partitioner="angel")  # 8 rows: bands of 8 // 3 = 2
    assert not rows.plan.param("w").cuts_columns and len(rows.plan.param("w").blocks) == 4


def test_an_instance_carries_its_own_knobs():
    result = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner=ColumnPartitioner(parts=2))
    assert [len(p.blocks) for p in result.plan.params] == [1, 2, 1, 2, 1, 2]
    result = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner=AngelPartitioner(max_elements=10_000))
    h1 = result.plan.param("h1.w")  # 784 rows >= 3: blockRow = min(261, max(1, 10000 / 256)) = 39
    assert {b.rows for b in h1.blocks} == {39, 784 - 20 * 39} and len(h1.blocks) == 21
