"""The executor on Paddle's fixture programs and on small hand-built programs: training
makes progress, runs are reproducible, learning-rate schedules switch where they
should, errors say where they happened, and other modules can plug kernels in."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from conftest import PADDLE_CASES, PADDLE_PROGRAMS

from ops.executor import ExecutionError, Executor, FetchError
from ops.kernels import register, restore_kernel, swap_kernel, unregister
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.errors import PsTranspilerError, UnknownOpError
from transpiler.ir import DType, Program, VarKind

BATCH = 16
STEPS = 5


def load_case(case: str) -> tuple[Program, Program, dict]:
    folder = PADDLE_PROGRAMS / case
    return (
        Program.load(folder / "startup.pb"),
        Program.load(folder / "main.pb"),
        json.loads((folder / "case.json").read_text()),
    )


def make_feed(program: Program, batch: int, rng: np.random.Generator) -> dict[str, object]:
    """A batch for every var block 0 reads but nothing writes: ids in the table's range
    (with a LoD when the var has one), labels in the classifier's range, small floats."""
    block = program.global_block()
    written = {name for op in block.ops for name in op.output_names}
    feed: dict[str, object] = {}
    for name, var in block.vars.items():
        readers = block.readers(name)
        if var.persistable or name in written or not readers or var.dtype is None:
            continue
        shape = [batch if d < 0 else d for d in var.shape]
        reader = readers[0]
        if var.dtype == DType.INT64:
            if reader.type.startswith("lookup_table"):
                height = block.var(reader.input("W")[0]).shape[0]
                if var.lod_level:
                    lengths = rng.integers(1, 4, size=batch)
                    ids = rng.integers(0, height, size=(int(lengths.sum()), 1))
                    feed[name] = LoDTensor.from_lengths(ids, [lengths.tolist()])
                    continue
                feed[name] = rng.integers(0, height, size=shape)
            else:
                classes = block.var((reader.input("Logits") or reader.input("X"))[0]).shape[-1]
                feed[name] = rng.integers(0, classes, size=shape)
        else:
            feed[name] = (rng.standard_normal(shape) * 0.1).astype(var.dtype.to_numpy())
    return feed


def train(case: str, seed: int = 0, steps: int = STEPS) -> tuple[list[float], Scope, Program]:
    startup, main, info = load_case(case)
    exe, scope = Executor(seed=seed), Scope()
    exe.run(startup, scope=scope)
    feed = make_feed(main, BATCH, np.random.default_rng(seed))
    losses = []
    for _ in range(steps):
        (loss,) = exe.run(main, feed=feed, fetch_list=[info["loss"]], scope=scope)
        losses.append(float(np.asarray(loss).reshape(-1)[0]))
    return losses, scope, main


def params(scope: Scope, program: Program) -> dict[str, np.ndarray]:
    return {
        name: np.array(scope.find_var(name).array)
        for name, var in program.global_block().vars.items()
        if var.persistable and isinstance(scope.find_var(name), LoDTensor)
    }


@pytest.mark.parametrize("case", PADDLE_CASES)
def test_fixture_trains_and_the_loss_decreases(case):
    losses, scope, main = train(case)
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], f"{case}: loss did not decrease: {losses}"
    assert all(np.isfinite(v).all() for v in params(scope, main).values())


@pytest.mark.parametrize("case", ["mlp_adam_2ps", "ctr_v1_sparse_sgd_2ps", "fluid18_ctr_dist_sgd_2ps"])
def test_same_seed_is_bit_identical_and_another_seed_is_not(case):
    _, scope_a, main = train(case, seed=11, steps=3)
    _, scope_b, _ = train(case, seed=11, steps=3)
    _, scope_c, _ = train(case, seed=12, steps=3)
    a, b, c = params(scope_a, main), params(scope_b, main), params(scope_c, main)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert any(not np.array_equal(a[n], c[n]) for n in a if a[n].size > 1)


def test_sparse_embedding_grads_give_the_dense_result():
    """ctr_v1_sparse (is_sparse: SelectedRows grads, sparse sum, sparse sgd) against the
    same program with dense grads."""
    startup, main, info = load_case("ctr_v1_sparse_sgd_2ps")
    dense = main.clone()
    block = dense.global_block()
    for op in block.ops:
        if op.type in ("lookup_table", "lookup_table_grad"):
            op.set_attr("is_sparse", False)
    for name, var in list(block.vars.items()):
        if var.kind == VarKind.SELECTED_ROWS:
            block.remove_var(name)
            block.create_var(name, VarKind.LOD_TENSOR, var.dtype, var.shape)
    feed = make_feed(main, BATCH, np.random.default_rng(1))
    results = []
    for program in (main, dense):
        exe, scope = Executor(seed=2), Scope()
        exe.run(startup, scope=scope)
        for _ in range(3):
            exe.run(program, feed=feed, scope=scope)
        results.append(params(scope, main))
    for name in results[0]:
        np.testing.assert_allclose(results[0][name], results[1][name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_optimize_and_lr_ops_run_every_step():
    startup, main, _ = load_case("fluid18_lr_exp_decay_2ps")
    exe, scope = Executor(), Scope()
    exe.run(startup, scope=scope)
    feed = make_feed(main, 2, np.random.default_rng(0))
    for step in range(3):
        exe.run(main, feed=feed, scope=scope)
        assert scope.find_var("@LR_DECAY_COUNTER@").array.tolist() == [step]


# ------------------------------------------------------------- lr schedules


def lr_after(case: str, fetch: str, counters: list[int]) -> list[float]:
    """The learning rate the main program computes when the step counter (incremented
    by the program itself) starts at each value."""
    startup, main, _ = load_case(case)
    exe, scope = Executor(), Scope()
    exe.run(startup, scope=scope)
    feed = make_feed(main, 2, np.random.default_rng(0))
    out = []
    for counter in counters:
        scope.set_var("@LR_DECAY_COUNTER@", LoDTensor(np.array([counter], np.int64)))
        (lr,) = exe.run(main, feed=feed, fetch_list=[fetch], scope=scope)
        out.append(float(lr.reshape(-1)[0]))
    return out


def test_piecewise_decay_switches_at_the_boundaries():
    """piecewise_decay([10000, 20000], [1.0, 0.5, 1.0]): the conditional sub-blocks
    assign the global `learning_rate`. The counter is incremented before use, so
    counter c gives step c + 1."""
    steps = [0, 1, 9999, 10000, 10001, 19999, 20000, 25000]
    got = lr_after("fluid18_lr_piecewise_2ps", "learning_rate", [s - 1 for s in steps])
    assert got == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0, 1.0]


def test_piecewise_sub_block_temporaries_stay_in_the_child_scope():
    startup, main, _ = load_case("fluid18_lr_piecewise_2ps")
    exe, scope = Executor(), Scope()
    exe.run(startup, scope=scope)
    exe.run(main, feed=make_feed(main, 2, np.random.default_rng(0)), scope=scope)
    step_scopes = scope.find_var("_generated_var_0")  # the Scope output of the first conditional_block
    assert isinstance(step_scopes, list) and isinstance(step_scopes[0], Scope)
    assert step_scopes[0].parent is scope
    assert scope.has_var("learning_rate", local=True) and not step_scopes[0].has_var("learning_rate", local=True)


def test_exponential_decay_is_0_1_to_the_floor_of_step_over_2100():
    steps = [0, 1, 2099, 2100, 2101, 4199, 4200, 6300, 10000]
    got = lr_after("fluid18_lr_exp_decay_2ps", "tmp_3", [s - 1 for s in steps])
    expected = [float(np.float32(0.1) ** np.float32(s // 2100)) for s in steps]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got[3] == pytest.approx(0.1) and got[2] == 1.0


# ---------------------------------------------------------- hand-built programs


def program_with(*ops: tuple, var_decls: dict | None = None) -> Program:
    program = Program.empty()
    block = program.global_block()
    for name, (kind, dtype, shape) in (var_decls or {}).items():
        block.create_var(name, kind, dtype, shape)
    for op_type, inputs, outputs, attrs in ops:
        block.add_op(op_type, inputs, outputs, attrs)
    return program


def test_kernel_failure_names_block_op_and_input_shapes():
    program = program_with(
        ("fill_constant", {}, {"Out": ["a"]}, {"shape": [2, 3], "dtype": int(DType.FP32), "value": 1.0}),
        ("mul", {"X": ["a"], "Y": ["w"]}, {"Out": ["b"]}, {}),
    )
    with pytest.raises(ExecutionError) as info:
        Executor().run(program, feed={"w": np.ones((4, 5), np.float32)}, scope=Scope())
    err = info.value
    assert (err.block, err.op_index, err.op_type) == (0, 1, "mul")
    assert ("X", "a", "float32[2, 3]") in err.inputs and ("Y", "w", "float32[4, 5]") in err.inputs
    assert err.headline.startswith("block 0, op 1 (mul): ValueError")
    assert "op 1 mul X=[a] Y=[w] -> Out=[b]" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert isinstance(err, PsTranspilerError)


def test_missing_input_is_reported_as_missing():
    program = program_with(("relu", {"X": ["nowhere"]}, {"Out": ["y"]}, {}))
    with pytest.raises(ExecutionError, match=r"(?s)input X='nowhere' of op 'relu' has no value.*X=nowhere missing"):
        Executor().run(program, scope=Scope())


def test_unknown_op_fails_before_anything_runs():
    program = program_with(
        ("fill_constant", {}, {"Out": ["a"]}, {"shape": [1], "dtype": int(DType.FP32), "value": 1.0}),
        ("frobnicate", {"X": ["a"]}, {"Out": ["b"]}, {}),
    )
    scope = Scope()
    with pytest.raises(UnknownOpError, match=r"no kernel for op 'frobnicate' \(block 0, op 1\)"):
        Executor().run(program, scope=scope)
    assert not scope.has_var("a")


def conditional_program(cond: bool) -> Program:
    """block 0: lr = 0.1; flag = cond; if flag: {tmp = 2.0 (declared in block 1); lr = tmp}."""
    program = program_with(
        ("fill_constant", {}, {"Out": ["lr"]}, {"shape": [1], "dtype": int(DType.FP32), "value": 0.1}),
        ("fill_constant", {}, {"Out": ["flag"]}, {"shape": [1], "dtype": int(DType.BOOL), "value": float(cond)}),
        var_decls={"lr": (VarKind.LOD_TENSOR, DType.FP32, (1,)), "flag": (VarKind.LOD_TENSOR, DType.BOOL, (1,))},
    )
    sub = program.create_block(0)
    sub.create_var("tmp", VarKind.LOD_TENSOR, DType.FP32, (1,))
    sub.add_op("fill_constant", {}, {"Out": ["tmp"]}, {"shape": [1], "dtype": int(DType.FP32), "value": 2.0})
    sub.add_op("assign", {"X": ["tmp"]}, {"Out": ["lr"]}, {})
    program.global_block().add_op(
        "conditional_block",
        {"Cond": ["flag"], "Input": []},
        {"Out": ["lr"], "Scope": ["scopes"]},
        {"sub_block": sub, "is_scalar_condition": True},
    )
    return program


@pytest.mark.parametrize(("cond", "lr"), [(True, 2.0), (False, 0.1)])
def test_conditional_block_writes_ancestor_vars_in_their_scope(cond, lr):
    scope = Scope()
    (got,) = Executor().run(conditional_program(cond), fetch_list=["lr"], scope=scope)
    assert got.tolist() == [np.float32(lr)]
    assert not scope.has_var("tmp")  # the sub-block's own var died with its scope


def test_failure_inside_a_sub_block_names_the_sub_block():
    program = conditional_program(True)
    program.block(1).add_op("relu", {"X": ["ghost"]}, {"Out": ["tmp"]}, {})
    with pytest.raises(ExecutionError) as info:
        Executor().run(program, scope=Scope())
    assert (info.value.block, info.value.op_index, info.value.op_type) == (1, 2, "relu")


def test_run_a_sub_block_directly_in_a_given_scope():
    """How a pserver runs an optimize block: `block_id` in the scope that holds the grads."""
    program = conditional_program(True)
    scope = Scope()
    scope.set_var("lr", LoDTensor(np.array([0.1], np.float32)))
    Executor().run(program, scope=scope, block_id=1)
    assert scope.find_var("lr").array.tolist() == [2.0]


def test_feed_and_fetch_ops_are_honoured():
    program = program_with(
        ("feed", {"X": ["feed"]}, {"Out": ["x"]}, {"col": 0}),
        ("scale", {"X": ["x"]}, {"Out": ["y"]}, {"scale": 3.0}),
        ("fetch", {"X": ["y"]}, {"Out": ["fetch"]}, {"col": 0}),
        var_decls={"feed": (VarKind.FEED_MINIBATCH, None, None), "fetch": (VarKind.FETCH_LIST, None, None)},
    )
    scope = Scope()
    (y,) = Executor().run(program, feed={"x": np.array([1.0, 2.0], np.float32)}, fetch_list=["y"], scope=scope)
    assert y.tolist() == [3.0, 6.0]
    assert scope.find_var("fetch")[0].array.tolist() == [3.0, 6.0]


def test_fetch_by_var_and_read_only_views():
    program = program_with(("fill_constant", {}, {"Out": ["a"]}, {"shape": [2], "dtype": int(DType.FP32), "value": 4.0}))
    program.global_block().create_var("a", VarKind.LOD_TENSOR, DType.FP32, (2,))
    scope = Scope()
    (a,) = Executor().run(program, fetch_list=[program.global_block().var("a")], scope=scope)
    assert a.tolist() == [4.0, 4.0]
    with pytest.raises(ValueError):
        a[0] = 1.0
    with pytest.raises(FetchError, match="'nope'"):
        Executor().run(program, fetch_list=["nope"], scope=scope)


def test_feed_lists_take_the_declared_dtype():
    program = program_with(
        ("scale", {"X": ["ids"]}, {"Out": ["y"]}, {"scale": 1.0}),
        var_decls={"ids": (VarKind.LOD_TENSOR, DType.INT64, (-1, 1))},
    )
    (y,) = Executor().run(program, feed={"ids": [[1], [2]]}, fetch_list=["y"], scope=Scope())
    assert y.dtype == np.int64


def test_other_modules_plug_kernels_and_services_in():
    """The RPC layer registers its ops into the same registry and reaches its client
    through `ctx.env`; the executor passes its own env merged with the run's."""

    class FakeClient:
        def __init__(self) -> None:
            self.sent: list[tuple[str, str, list[float]]] = []

        def send(self, endpoint: str, name: str, value) -> None:
            self.sent.append((endpoint, name, value.array.tolist()))

    @register("test_send")
    def test_send(ctx) -> None:
        for name, endpoint in zip(ctx.input_names("X"), ctx.attr("epmap"), strict=True):
            ctx.env["rpc"].send(endpoint, name, ctx.scope.find_var(name))

    try:
        client = FakeClient()
        program = program_with(("test_send", {"X": ["g"]}, {}, {"epmap": ["127.0.0.1:6170"]}))
        exe = Executor(env={"rpc": client, "trainer_id": 0})
        exe.run(program, feed={"g": np.array([1.5], np.float32)}, scope=Scope())
        assert client.sent == [("127.0.0.1:6170", "g", [1.5])]
        other = FakeClient()
        exe.run(program, feed={"g": np.array([2.5], np.float32)}, scope=Scope(), env={"rpc": other})
        assert other.sent == [("127.0.0.1:6170", "g", [2.5])] and len(client.sent) == 1
        with pytest.raises(ValueError, match="already has a kernel"):
            register("test_send")(lambda ctx: None)
    finally:
        unregister("test_send")


def test_a_prepared_block_follows_edits_to_the_program_and_the_registry():
    """The executor resolves a block's kernels once, but an op added, a slot renamed or a
    kernel re-registered between runs is what the next run runs."""
    program = program_with(("scale", {"X": ["x"]}, {"Out": ["y"]}, {"scale": 2.0}))
    exe, scope = Executor(), Scope()
    feed = {"x": np.array([1.0], np.float32)}
    assert exe.run(program, feed=feed, fetch_list=["y"], scope=scope)[0].tolist() == [2.0]
    block = program.global_block()
    block.create_var("z", dtype=DType.FP32, shape=(1,))
    block.add_op("scale", inputs={"X": ["y"]}, outputs={"Out": ["z"]}, attrs={"scale": 3.0})
    assert exe.run(program, feed=feed, fetch_list=["z"], scope=scope)[0].tolist() == [6.0]
    block.ops[1].rename_input("y", "x")
    assert exe.run(program, feed=feed, fetch_list=["z"], scope=scope)[0].tolist() == [3.0]
    calls = []
    original = swap_kernel("scale", lambda ctx: calls.append(ctx.op.type))
    try:
        exe.run(program, feed=feed, scope=scope)
        assert calls == ["scale", "scale"]
    finally:
        restore_kernel(original)


def test_runs_from_threads_share_a_scope_safely():
    """Two threads run blocks that read the same params and write their own outputs."""
    program = program_with(
        ("mul", {"X": ["x"], "Y": ["w"]}, {"Out": ["y"]}, {}),
        ("reduce_sum", {"X": ["y"]}, {"Out": ["s"]}, {"reduce_all": True}),
    )
    shared = Scope()
    shared.set_var("w", LoDTensor(np.ones((3, 2), np.float32)))
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            local = shared.new_scope()
            exe = Executor()
            for _ in range(50):
                (s,) = exe.run(program, feed={"x": np.full((2, 3), k, np.float32)}, fetch_list=["s"], scope=local)
                assert float(s.reshape(-1)[0]) == 12.0 * k
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_selected_rows_fetch_comes_back_as_is():
    program = program_with(("scale", {"X": ["g"]}, {"Out": ["h"]}, {"scale": 2.0}))
    g = SelectedRows([1], np.ones((1, 2), np.float32), 4)
    (h,) = Executor().run(program, feed={"g": g}, fetch_list=["h"], scope=Scope())
    assert isinstance(h, SelectedRows) and h.to_dense()[1].tolist() == [2.0, 2.0]


def test_unknown_op_in_a_sub_block_names_the_sub_block():
    program = conditional_program(True)
    program.block(1).add_op("frobnicate", {}, {}, {})
    with pytest.raises(UnknownOpError, match=r"no kernel for op 'frobnicate' \(block 1, op 2\)"):
        Executor().run(program, scope=Scope())


def test_persistable_vars_of_a_sub_block_live_in_the_outer_scope():
    program = conditional_program(True)
    sub = program.block(1)
    sub.create_var("kept", VarKind.LOD_TENSOR, DType.FP32, (1,), persistable=True)
    sub.add_op("fill_constant", {}, {"Out": ["kept"]}, {"shape": [1], "dtype": int(DType.FP32), "value": 3.0})
    scope = Scope()
    Executor().run(program, scope=scope)
    assert scope.has_var("kept", local=True) and not scope.has_var("tmp")


def split_roles(program: Program) -> tuple[Program, Program, list[str]]:
    """(forward+backward only, optimizer ops only, the grads the optimizers read)."""
    from transpiler.ir import OpRole

    compute, optimize = program.clone(), program.clone()
    for op in list(compute.global_block().ops):
        if op.role & OpRole.Optimize:
            compute.global_block().remove_op(op)
    grads = []
    for op in list(optimize.global_block().ops):
        if op.role & OpRole.Optimize:
            grads.extend(op.input("Grad"))
        else:
            optimize.global_block().remove_op(op)
    return compute, optimize, grads


@pytest.mark.parametrize("case", ["mlp_adam_2ps", "ctr_v1_sparse_sgd_2ps", "seed_fc3_sgd_3ps"])
def test_averaged_half_batch_grads_give_the_full_batch_step(case):
    """What sync-mode parameter serving relies on: two trainers' grads on half batches,
    summed and scaled by 1/2 (dense or SelectedRows, as the pserver does), then the
    optimizer, equal one local step on the whole batch (the loss is a mean)."""
    from ops.testing import run_op

    startup, main, _ = load_case(case)
    compute, optimize, grads = split_roles(main)
    feed = make_feed(main, 2 * BATCH, np.random.default_rng(4))
    halves = [{k: v[i * BATCH : (i + 1) * BATCH] for k, v in feed.items()} for i in range(2)]

    local, dist = Scope(), Scope()
    Executor(seed=5).run(startup, scope=local)
    Executor(seed=5).run(startup, scope=dist)
    Executor().run(main, feed=feed, scope=local)

    trainers = [dist.new_scope() for _ in halves]
    for scope, half in zip(trainers, halves, strict=True):
        Executor().run(compute, feed=half, scope=scope)
    for grad in grads:
        total = run_op("sum", {"X": [t.find_var(grad) for t in trainers]}, raw=True)["Out"]
        dist.set_var(grad, run_op("scale", {"X": total}, attrs={"scale": 0.5}, raw=True)["Out"])
    Executor().run(optimize, scope=dist)

    a, b = params(local, main), params(dist, main)
    assert a.keys() == b.keys()
    # Adam's first step divides g by ~|g|: for grads near zero float32 rounding of the
    # two summation orders shows up as ~1e-5 of the lr-sized step; SGD stays tight.
    atol = 2e-5 if "adam" in case else 1e-6
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=atol, err_msg=name)
    assert any(isinstance(t.find_var(g), SelectedRows) for t in trainers for g in grads) == (case.startswith("ctr"))


def test_run_as_a_pserver_updates_sparse_rows_in_place_or_copies():
    """`Executor.run(update_in_place=..., concurrent_readers=...)` runs a block as a sync
    pserver (rows written into the param's own array, even while another holder sees it)
    or an async one (the kernel copies: a holder keeps the old values), as calibrate
    measures both paths; the numbers are the same either way."""
    import sparse_table_support  # noqa: F401  (puts examples/ on the path)
    import train_ctr
    from transpiler.api import transpile

    main, startup = train_ctr.build_ctr("local-table", 64, 4)
    pserver, pserver_startup = transpile(main, startup, pservers=["127.0.0.1:1"], trainers=2).pservers["127.0.0.1:1"]
    block = next(b.idx for b in pserver.blocks
                 if any(o.type == "adagrad" and o.inputs.get("Param") == ("emb",) for o in b.ops))
    results = []
    for sync in (True, False):
        scope, exe = Scope(), Executor(seed=0)
        exe.run(pserver_startup, scope=scope)
        for t in range(2):
            scope.set_var(f"emb@GRAD.trainer_{t}", SelectedRows(np.array([3, 5, 3]), np.ones((3, 4), np.float32), 64))
        held = scope.find_var("emb").array  # another holder: in place only where the run allows it
        before = held.copy()
        exe.run(pserver, scope=scope, block_id=block, update_in_place=sync, concurrent_readers=True)
        after = scope.find_var("emb").array
        assert (after is held) == sync
        assert np.array_equal(held, after) == sync and (np.array_equal(held, before) != sync)
        assert not np.array_equal(after[[3, 5]], before[[3, 5]]) and np.array_equal(after[0], before[0])
        results.append(after.copy())
    assert np.array_equal(results[0], results[1])
