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
    # a dense rank-3 param: columns of its [2, 12] matrix; a rank-3 sparse table stays whole
    assert rects(column.partitions(info((2, 3, 4)))) == [(0, 2, 0, 4), (0, 2, 4, 8), (0, 2, 8, 12)]
    assert rects(column.partitions(ParamInfo("t", (2, 3, 4), DType.FP32, "sgd", sparse=True))) == [(0, 2, 0, 12)]
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


def test_a_rank_3_param_is_cut_as_its_matrix_a_rank_3_table_by_rows_only():
    from transpiler.partition import checked_partitions
    from transpiler.plan import make_partition_blocks

    conv = ParamInfo("conv.w", (8, 3, 5), DType.FP32, "sgd")  # 8 rows x 15 columns
    parts = checked_partitions(conv, [Partition(0, 4, 0, 15), Partition(4, 8, 0, 5), Partition(4, 8, 5, 15)], "test")
    blocks = make_partition_blocks("conv.w", conv.shape, parts)
    # every block of a rank-3 param cut by columns is a [rows, cols] matrix, whole-width ones too
    assert [(b.shape, b.col_offset, b.cols) for b in blocks] == [((4, 15), 0, 15), ((4, 5), 0, 5), ((4, 10), 5, 10)]
    rows_only = make_partition_blocks("conv.w", conv.shape, checked_partitions(
        conv, [Partition(0, 4, 0, 15), Partition(4, 8, 0, 15)], "test"))
    assert [b.shape for b in rows_only] == [(4, 3, 5), (4, 3, 5)]  # Paddle's row blocks, as ever
    table = ParamInfo("t", (8, 3, 5), DType.FP32, "sgd", sparse=True)
    with pytest.raises(TranspileError, match=r"'t' \[8, 3, 5\].*rank-3 sparse table.*cut its rows only"):
        checked_partitions(table, [Partition(0, 8, 0, 5), Partition(0, 8, 5, 15)], "test")


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


DIST_ROWS = 2000


def _train_distributed_table(tmp_path, partitioner, *flags, program=None, checkpoint=False):
    """examples/train_ctr.py's distributed table (`is_distributed`, Adam on the pservers),
    or a Paddle fixture's (`program`: its main.pb), cut by `partitioner`, 2 trainers x 3
    pservers, and local training from trainer 0's start: (trainer 0's, trainer 1's, local)
    saved arrays. `checkpoint`: the job also checkpoints after its last step into
    `tmp_path/ckpt`."""
    from e2e_support import launch_ok, run_script_locally

    model = ("--main", str(program)) if program is not None else \
        ("--variant", "distributed", "--table-optimizer", "adam", "--rows", str(DIST_ROWS))
    common = (str(EXAMPLES / "train_ctr.py"), *model, "--steps", "8", "--batch", "32", "--quiet", *flags)
    launch_ok(tmp_path, (sys.executable, *common, "--save", str(tmp_path / "params")), pservers=3, trainers=2,
              sync_mode=True, timeout=60.0,
              env={"PSTRANSPILE_PARTITIONER": partitioner, "PYTHONPATH": f"{EXAMPLES.parent}{os.pathsep}{EXAMPLES}",
                   **({"PSTRANSPILE_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "PSTRANSPILE_CHECKPOINT_EVERY": "8"}
                      if checkpoint else {})})
    run_script_locally((*common, "--init", str(tmp_path / "params" / "trainer_0.npz"), "--save", str(tmp_path / "local")))
    load = lambda path: dict(np.load(path))  # noqa: E731
    return load(tmp_path / "params" / "trainer_0.npz"), load(tmp_path / "params" / "trainer_1.npz"), \
        load(tmp_path / "local" / "local.npz")


def _distributed_table_plan(partitioner):
    import ctr

    main, startup = ctr.build(is_sparse=True, is_distributed=True, table=(DIST_ROWS, 16), table_optimizer="adam")
    spec = ThreeBands if ":" in partitioner else partitioner
    return transpile(main, startup, pservers=EPS3, trainers=2, partitioner=spec)


@pytest.mark.parametrize(("partitioner", "grid"), [
    ("column", [3]),  # all rows, 3 column pieces
    ("angel", [1, 1, 1, 1]),  # rows >= 3: bands of 666 rows (and a short 4th), whole width
    ("angel_custom_partitioner:ThreeBands", [4, 2, 2]),  # uneven: 3 row bands in 4, 2, 2 column pieces
])
def test_float64_distributed_table_by_adam_cut_by_partitioners_equals_local(partitioner, grid, tmp_path):
    """The distributed table (auto-grown pieces, Adam's moments following their rows) cut
    by rows, by columns or both: each lookup asks every column piece of its row's band and
    joins them, the SelectedRows grads are cut the same way; 2 trainers x 3 pservers,
    float64, every dense param and every touched row equal to local training."""
    result = _distributed_table_plan(partitioner)
    emb = result.plan.param("emb")
    assert result.plan.table is None and emb.distributed and [len(b) for b in emb.bands()] == grid
    assert len(set(emb.endpoints)) == 3
    for endpoint, (program, _) in result.pservers.items():
        for block in emb.blocks_on(endpoint):
            assert program.global_block().var(block.name).kind.name == "SELECTED_ROWS"
    bands = ":" in partitioner
    t0, t1, local = _train_distributed_table(tmp_path, partitioner, "--float64", checkpoint=bands)
    if bands:  # the pieces the job's checkpoint holds, merged whole (rows in 4, 2, 2 column pieces)
        _merge_table_of_the_checkpoint(tmp_path, t0, local, rtol=1e-5, atol=0.0)
    finals = [k for k in local if k.startswith(("final/", "final_rows/"))]
    assert "final_rows/emb" in finals
    for key in finals:
        start = key.replace("final", "init", 1)
        assert t0[key].dtype == np.float64 and np.abs(local[key] - local[start]).max() > 0, key
        assert np.array_equal(t0[key], t1[key]), key
        np.testing.assert_allclose(t0[key], local[key], rtol=1e-5, atol=0, err_msg=f"{partitioner}: {key}")


def test_float64_paddle_built_distributed_table_cut_in_2d_equals_local(tmp_path):
    """Paddle 2.6's ctr_v1_dist_sgd_2ps (an `is_distributed` [100000, 16] table, SGD) cut by
    the three bands (8 auto-grown pieces): float64, every dense param and touched row equal."""
    program = PADDLE_PROGRAMS / "ctr_v1_dist_sgd_2ps" / "main.pb"
    main, startup = Program.load(program), Program.load(program.with_name("startup.pb"))
    emb = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=ThreeBands).plan
    table = next(p for p in emb.params if p.distributed)
    assert emb.table is None and [len(b) for b in table.bands()] == [4, 2, 2]
    t0, t1, local = _train_distributed_table(tmp_path, "angel_custom_partitioner:ThreeBands", "--float64",
                                             program=program, checkpoint=True)
    _merge_table_of_the_checkpoint(tmp_path, t0, local, rtol=1e-5, atol=0.0, table=table.param, rows=table.shape[0])
    finals = [k for k in local if k.startswith(("final/", "final_rows/"))]
    assert any(k.startswith("final_rows/") for k in finals)
    for key in finals:
        start = key.replace("final", "init", 1)
        assert t0[key].dtype == np.float64 and np.abs(local[key] - local[start]).max() > 0, key
        assert np.array_equal(t0[key], t1[key]), key
        np.testing.assert_allclose(t0[key], local[key], rtol=1e-5, atol=0, err_msg=key)


# (one case: the three bands cut every filter unevenly, whole-width pieces included; `make
# interop`'s conv_column case runs a `column` cut of a filter on Fluid 1.8.5's runtime)
@pytest.mark.parametrize("partitioner", ["angel_custom_partitioner:ThreeBands"])
def test_float64_conv_filters_cut_by_columns_equal_local(partitioner, tmp_path):
    """Paddle 2.6's small ResNet (rank-4 conv filters, batch norm, Momentum) with every
    filter cut by columns of its [out, in * kh * kw] matrix: the trainer `reshape2`s each
    filter's grad to that matrix before cutting it, and joins the filter as that matrix
    before `reshape2`ing it back (Fluid ops). 2 trainers x 3 pservers, 4 steps, float64:
    every trained param equals local training as the trainers train (batch norm: see
    test_e2e_resnet.py) element-wise."""
    from e2e_support import launch_ok, run_script_locally

    folder = PADDLE_PROGRAMS / "resnet_small_momentum_3ps_sync"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    spec = ThreeBands if ":" in partitioner else partitioner
    result = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=spec, verify=True)
    filters = [p for p in result.plan.params if len(p.shape) == 4]
    assert filters and all(p.cuts_columns and all(len(b.shape) == 2 for b in p.blocks) for p in filters)
    reshapes = [op for op in result.trainer.global_block().ops if op.type == "reshape2"]
    assert len(reshapes) == 2 * len(filters)  # each filter's grad to a matrix, its param back
    common = (str(EXAMPLES / "train_program.py"), "--main", str(folder / "main.pb"), "--startup",
              str(folder / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "3", "--batch", "8", "--float64")
    launch_ok(tmp_path, (sys.executable, *common, "--save", str(tmp_path / "params")), pservers=3, trainers=2,
              sync_mode=True, timeout=120.0,
              env={"PSTRANSPILE_PARTITIONER": partitioner, "PYTHONPATH": f"{EXAMPLES.parent}{os.pathsep}{EXAMPLES}"})
    run_script_locally((*common, "--as-trainers", "2", "--init", str(tmp_path / "params" / "trainer_0.npz"),
                        "--save", str(tmp_path / "local")))
    dist, local = np.load(tmp_path / "params" / "trainer_0.npz"), np.load(tmp_path / "local" / "local.npz")
    trained = [p.param for p in result.plan.params]
    for name in trained:
        got, want = dist[f"final/{name}"], local[f"final.trainer_0/{name}"]
        assert got.dtype == np.float64 and np.abs(want - dist[f"init/{name}"]).max() > 0, name
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=0, err_msg=f"{partitioner}: {name}")


def test_float32_distributed_table_cut_by_columns_equals_local(tmp_path):
    """Once in float32, within the bound of the uncut table's float32 proof (1e-4 of the
    table's scale: Adam divides by sqrt(v); test_e2e_sparse.py says why)."""
    t0, _, local = _train_distributed_table(tmp_path, "angel_custom_partitioner:ThreeBands", checkpoint=True)
    _merge_table_of_the_checkpoint(tmp_path, t0, local, rtol=1e-5, atol=1e-4 * float(np.abs(local["final_rows/emb"]).max()))
    for key in [k for k in local if k.startswith(("final/", "final_rows/"))]:
        assert t0[key].dtype == np.float32, key
        bound = (1e-4 if key.startswith("final_rows/") else 1e-5) * float(np.abs(local[key]).max())
        np.testing.assert_allclose(t0[key], local[key], rtol=1e-5, atol=bound, err_msg=key)


def _merge_table_of_the_checkpoint(tmp_path, t0, local, *, rtol, atol, table="emb", rows=DIST_ROWS):
    """`pstranspile merge-table` of every piece file of `table` in the job's last checkpoint
    (their @POOL files too: skipped) with the checkpoint's MANIFEST.json as the plan: the
    table `fetch --checkpoint` reads, the rows trainer 0 read from the pservers after its
    last step exactly, local training's within (rtol, atol), every other row never touched
    (0)."""
    from ops.rpc.tensor_file import read_tensor
    from transpiler.cli import main as cli_main

    folder = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text().strip()
    assert folder.name == "ckpt-8"
    files = sorted(folder.glob(f"ps*/{table}.block*"))
    assert len([f for f in files if not f.name.endswith("@POOL")]) == 8, files
    merged_path = tmp_path / "table.npy"
    assert cli_main(["merge-table", *map(str, files), "--plan", str(folder / "MANIFEST.json"), "-o", str(merged_path)]) == 0
    assert cli_main(["fetch", "--checkpoint", str(tmp_path / "ckpt"), "--vars", table, "-o", str(tmp_path / "fetched")]) == 0
    merged = np.load(merged_path)
    ids = t0[f"ids/{table}"]
    assert merged.shape == (rows, 16) and merged.dtype == t0[f"final_rows/{table}"].dtype
    assert np.array_equal(merged, read_tensor(tmp_path / "fetched" / table))
    assert np.array_equal(merged[ids], t0[f"final_rows/{table}"])
    np.testing.assert_allclose(merged[ids], local[f"final_rows/{table}"], rtol=rtol, atol=atol)
    untouched = np.setdiff1d(np.arange(rows), ids)
    assert untouched.size and not merged[untouched].any()


# ------------------------------------------------------------------ goldens


@pytest.mark.parametrize("partitioner", ["column", "angel", "three_bands"])
def test_2d_golden(golden, partitioner):
    """The plan report and every program's dump of Paddle's mlp_adam_2ps cut by each
    partitioner, on 3 pservers (tests/golden/transpile/partition-*.txt; `--update-golden`)."""
    from test_api_golden import render

    spec = ThreeBands if partitioner == "three_bands" else partitioner
    result = transpile(*mlp(), pservers=EPS3, trainers=2, partitioner=spec, verify=True)
    golden.check(f"transpile/partition-mlp_adam_2ps-{partitioner}-3ps.txt", render(result))


@pytest.mark.parametrize("partitioner", ["column", "three_bands"])
def test_2d_golden_of_a_distributed_table(golden, partitioner):
    """Paddle's ctr_v1_dist_sgd_2ps (the `is_distributed` table) cut by each partitioner on
    3 pservers: its auto-grown pieces, the trainer's distributed_lookup_table and split ops."""
    from test_api_golden import render

    folder = PADDLE_PROGRAMS / "ctr_v1_dist_sgd_2ps"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    spec = ThreeBands if partitioner == "three_bands" else partitioner
    result = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=spec, verify=True)
    golden.check(f"transpile/partition-ctr_v1_dist_sgd_2ps-{partitioner}-3ps.txt", render(result))


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


def test_checkpoints_of_a_partitioned_distributed_table_merge_and_reshard(tmp_path):
    """Save the pservers of the distributed table cut by three_bands (auto-grown pieces and
    Adam moments following their rows, ids re-based to their band), read the table and its
    moments back whole (touched rows only), and restore onto 2 pservers `id % M`, 2 cut by
    column and 4 by angel: every piece holds its band's touched rows and its columns, the
    moments in the table's slots, the rest of the pool as this pserver drew it."""
    from ops.rpc.checkpoint import Checkpointer, CheckpointReader
    from ops.scope import Scope
    from ops.tensor import LoDTensor, SelectedRows

    result = _distributed_table_plan("angel_custom_partitioner:ThreeBands")
    layouts = _layouts(result)
    rng = np.random.default_rng(0)
    touched = np.sort(rng.choice(DIST_ROWS, 300, replace=False))
    wholes: dict[str, np.ndarray] = {}
    parts = tuple(f"ps{i}" for i in range(3))
    pieces = 0
    for i, layout in enumerate(layouts.values()):
        scope = Scope()
        for name, where in layout.items():
            if where.origin not in wholes:
                wholes[where.origin] = rng.standard_normal(where.whole_shape).astype(np.float32)
            whole = wholes[where.origin]
            if where.table:
                assert where.rows is not None
                pieces += 1
                (r0, r1), (c0, c1) = where.rows, where.cols or (0, 16)
                ids = touched[(touched >= r0) & (touched < r1)]
                order = rng.permutation(ids.size) if where.follows is None else None
                ids = ids[order] if order is not None else ids
                pool = np.full((r1 - r0, c1 - c0), 7.0, np.float32)
                pool[: ids.size] = whole[ids, c0:c1]
                scope.set_var(name, SelectedRows(ids - r0, pool, r1 - r0))
            else:
                scope.set_var(name, LoDTensor(np.array(where.cut(whole))))
        Checkpointer(tmp_path, parts[i], parts, layout, result.plan.to_json_text(), 3).save(scope, "ckpt-5")
    assert pieces == 8 * 3  # the table and its two moments, 8 pieces each
    reader = CheckpointReader(tmp_path)
    for origin in ("emb", "emb_moment1_0", "emb_moment2_0"):
        ids, values = reader.table_rows(origin)
        assert np.array_equal(ids, touched) and np.array_equal(values, wholes[origin][touched]), origin
        dense = reader.whole(origin)
        assert np.array_equal(dense[touched], wholes[origin][touched]) and np.count_nonzero(dense.any(axis=1)) == 300
    import ctr

    main, startup = ctr.build(is_sparse=True, is_distributed=True, table=(DIST_ROWS, 16), table_optimizer="adam")
    for spec, count in (("paddle", 2), ("column", 2), ("angel", 4)):
        eps = ",".join(f"127.0.0.1:{7000 + i}" for i in range(count))
        other = transpile(main, startup, pservers=eps, trainers=2, partitioner=None if spec == "paddle" else spec)
        for i, layout in enumerate(_layouts(other).values()):
            scope = Scope()
            for name, where in layout.items():
                if where.table:
                    rows = (where.rows[1] - where.rows[0]) if where.rows else other.plan.table.shard_rows
                    width = (where.cols[1] - where.cols[0]) if where.cols else 16
                    scope.set_var(name, SelectedRows(np.zeros(0, np.int64), np.full((rows, width), 7.0, np.float32),
                                                     rows))
            reader.restore(scope, layout, f"ps{i}", count)
            for name, where in layout.items():
                value = scope.find_var(name)
                if not where.table:
                    assert np.array_equal(value.array, where.cut(wholes[where.origin])), (spec, name)
                    continue
                if where.rows is None:  # id % M
                    ids = touched[touched % count == i]
                    assert np.array_equal(value.rows, ids), (spec, name)
                    assert np.array_equal(value.active_value(), wholes[where.origin][ids]), (spec, name)
                    continue
                (r0, r1), (c0, c1) = where.rows, where.cols or (0, 16)
                ids = touched[(touched >= r0) & (touched < r1)]
                assert np.array_equal(value.rows, ids - r0), (spec, name)
                assert np.array_equal(value.active_value(), wholes[where.origin][ids, c0:c1]), (spec, name)
                assert (value.value[ids.size :] == 7.0).all(), (spec, name)


def test_checkpoints_of_conv_filters_cut_by_columns_merge_and_reshard(tmp_path):
    """The small ResNet's rank-4 filters cut by the three bands ([rows, cols] pieces, and
    their Momentum velocities): saved, read back whole in their own shape, restored onto
    `paddle` row blocks and `column` pieces of 2 pservers."""
    from ops.rpc.checkpoint import Checkpointer, CheckpointReader
    from ops.scope import Scope
    from ops.tensor import LoDTensor

    folder = PADDLE_PROGRAMS / "resnet_small_momentum_3ps_sync"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    result = transpile(main, startup, pservers=EPS3, trainers=2, partitioner=ThreeBands)
    layouts = _layouts(result)
    rng = np.random.default_rng(2)
    wholes: dict[str, np.ndarray] = {}
    parts = tuple(f"ps{i}" for i in range(3))
    flat = 0
    for i, layout in enumerate(layouts.values()):
        scope = Scope()
        for name, where in layout.items():
            if where.origin not in wholes:
                wholes[where.origin] = rng.standard_normal(where.whole_shape).astype(np.float32)
            piece = where.cut(wholes[where.origin])
            flat += len(where.whole_shape) == 4 and piece.ndim == 2
            scope.set_var(name, LoDTensor(np.array(piece)))
        Checkpointer(tmp_path, parts[i], parts, layout, result.plan.to_json_text(), 3).save(scope, "ckpt-5")
    assert flat > 24  # filters and velocities, pieces of their [out, in * kh * kw] matrices
    reader = CheckpointReader(tmp_path)
    for origin, whole in wholes.items():
        assert np.array_equal(reader.whole(origin), whole), origin
    eps = "127.0.0.1:7000,127.0.0.1:7001"
    for spec in ("paddle", "column"):
        other = transpile(main, startup, pservers=eps, trainers=2, partitioner=None if spec == "paddle" else spec,
                          min_block_size=64)
        for i, layout in enumerate(_layouts(other).values()):
            scope = Scope()
            reader.restore(scope, layout, f"ps{i}", 2)
            for name, where in layout.items():
                assert np.array_equal(scope.find_var(name).array, where.cut(wholes[where.origin])), (spec, name)


def test_fetch_pulls_a_partitioned_distributed_table_whole():
    """`pull` (fetch from running pservers): each auto-grown piece answers its touched rows
    (ids re-based to its band); the table comes back dense, untouched rows 0."""
    from ops.rpc.fetch import FetchError, pull
    from ops.tensor import SelectedRows

    plan = _distributed_table_plan("angel_custom_partitioner:ThreeBands").plan.to_json()
    emb = next(p for p in plan["params"] if p["param"] == "emb")
    assert emb["distributed"] and emb["grid"] == [4, 2, 2]
    rng = np.random.default_rng(1)
    whole = rng.standard_normal((DIST_ROWS, 16))
    touched = np.sort(rng.choice(DIST_ROWS, 50, replace=False))
    answers = {}
    for b in emb["blocks"]:
        r0, r1, c0, c1 = b["row_offset"], b["row_offset"] + b["rows"], b["col_offset"], b["col_offset"] + b["cols"]
        ids = touched[(touched >= r0) & (touched < r1)][::-1]  # first-touch order, not sorted
        value = np.full((b["rows"], b["cols"]), 9.0)
        value[: ids.size] = whole[ids, c0:c1]
        answers[(b["endpoint"], b["name"])] = SelectedRows(ids - r0, value, b["rows"])

    class Client:
        def get_many(self, requests):
            return [answers[r] for r in requests]

    got = pull(Client(), plan, ["emb"])["emb"]
    expected = np.zeros_like(whole)
    expected[touched] = whole[touched]
    assert np.array_equal(got, expected)
    first = emb["blocks"][0]
    answers[(first["endpoint"], first["name"])] = SelectedRows(np.array([first["rows"]]), np.zeros((1, first["cols"])),
                                                                first["rows"])
    with pytest.raises(FetchError, match="outside its"):
        pull(Client(), plan, ["emb"])


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


def test_a_checkpoint_of_a_partitioned_distributed_table_restores_onto_other_cuts_and_trains_on(tmp_path):
    """train_program.py on a distributed CTR table of 64 rows (Adam) cut by the three bands on
    3 pservers checkpoints at step 6 (every row touched by then): read whole, it is the
    table the pservers held (pulled). Restored by the same plan and by `column` on 2
    pservers and trained to step 12, both jobs end bit-identical (params, table): the pieces' rows and
    the Adam moments following them were resharded into the right slots and columns.
    (Not against an uninterrupted run: an auto-grown row takes the next pool row in the
    order the trainers' concurrent prefetches arrive, so two runs start rows differently.)"""
    import ctr
    from e2e_support import launch_ok
    from ops.rpc.checkpoint import CheckpointReader
    from ops.rpc.tensor_file import read_tensor
    from test_e2e_recovery import finals

    rows = 64
    main, startup = ctr.build(is_sparse=True, is_distributed=True, table=(rows, 16), table_optimizer="adam")
    main_pb, startup_pb = save(tmp_path, main, startup)
    bands = {"PSTRANSPILE_PARTITIONER": "angel_custom_partitioner:ThreeBands",
             "PYTHONPATH": f"{EXAMPLES.parent}{os.pathsep}{EXAMPLES}"}
    saved = tmp_path / "first" / "ckpt"
    restore = ("--restore", str(saved))
    # (onto `id % M` shards: test_checkpoints_of_a_partitioned_distributed_table_merge_and_reshard)

    def job(name, steps, pservers, env, *extra):
        # every job checkpoints into a dir of its own: a sync trainer's pull reads the
        # pservers' table through a checkpoint of its last step (Session.pull)
        command = (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup",
                   str(startup_pb), "--loss", "mean_0.tmp_0", "--steps", str(steps), "--batch", "16", "--save",
                   str(tmp_path / name / "params"), "--pull-to", str(tmp_path / name / "pulled"),
                   "--checkpoint-dir", str(tmp_path / name / "ckpt"), *extra)
        launch_ok(tmp_path / name, command, pservers=pservers, trainers=2, sync_mode=True, timeout=60.0, env=env)
        return finals(tmp_path / name / "params"), read_tensor(tmp_path / name / "pulled" / "emb")

    first, first_emb = job("first", 6, 3, bands, "--checkpoint-every", "6")
    manifest = json.loads((saved / "ckpt-6" / "MANIFEST.json").read_text())
    pieces = [e for part in manifest["parts"].values() for e in part.values() if e.get("table")]
    assert {e["origin"] for e in pieces} == {"emb", "emb_moment1_0", "emb_moment2_0"} and len(pieces) == 3 * 8
    assert first_emb.any(axis=1).all()  # every row touched: no pool row is drawn after the restore
    assert np.array_equal(CheckpointReader(saved).whole("emb"), first_emb)
    assert CheckpointReader(saved).whole("emb_moment2_0").any(axis=1).all()

    same, same_emb = job("same", 12, 3, bands, *restore)
    other, other_emb = job("other", 12, 2, {"PSTRANSPILE_PARTITIONER": "column"}, *restore)
    assert not np.array_equal(same_emb, first_emb)
    assert same.keys() == other.keys() == first.keys() and same
    for name, value in same.items():
        assert not np.array_equal(value, first[name]) and np.array_equal(other[name], value), name
    assert np.array_equal(other_emb, same_emb)


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
