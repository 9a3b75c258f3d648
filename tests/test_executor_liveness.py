"""The executor's liveness pass (`Executor(free_dead=True)`, `ops.executor.Liveness`): a
temporary leaves the scope after its last read, never a persistable var, a fetch target,
a var another block names, a feed or a var the block writes last; training gives the same
bits with and without it, float32 and float64; and the kernels that compute into a dying
input's array, into the output var's own array or in chunks (`sum`, `scale`, `sgd`,
`concat`) give the bits of the plain path."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import PADDLE_PROGRAMS, TESTS

from ops.executor import Executor, Liveness
from ops.kernels import optimizers
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.api import as_float64, transpile
from transpiler.ir import DType, Program

sys.path.insert(0, str(TESTS.parent / "examples"))
from train_program import synthetic_batch  # noqa: E402

EPS = "127.0.0.1:6174,127.0.0.1:6175"


def program_with(*ops: tuple, persistable: tuple[str, ...] = ()) -> Program:
    program = Program.empty()
    block = program.global_block()
    names = {n for _, ins, outs, _ in ops for args in (*ins.values(), *outs.values()) for n in args}
    for name in sorted(names):
        block.create_var(name, dtype=DType.FP32, shape=[-1], persistable=name in persistable)
    for op_type, inputs, outputs, attrs in ops:
        block.add_op(op_type, inputs, outputs, attrs)
    return program


def chain() -> Program:
    """x -> scale -> a -> scale -> b -> sum(a?, b) ...: temporaries, a persistable, an output."""
    return program_with(
        ("scale", {"X": ["x"]}, {"Out": ["a"]}, {"scale": 2.0}),
        ("scale", {"X": ["a"]}, {"Out": ["b"]}, {"scale": 3.0}),
        ("sum", {"X": ["b", "w"]}, {"Out": ["c"]}, {}),
        ("scale", {"X": ["c"]}, {"Out": ["out"]}, {"scale": 0.5}),
        persistable=("w",),
    )


def test_liveness_lists_each_temporary_after_its_last_read_and_nothing_else():
    program = chain()
    block = program.global_block()
    dying = Liveness(block, block.ops, ()).dying
    # a dies after op 1, b after the sum, c after the last scale; x is a feed (not produced
    # here), w persistable, out written last (what the block produces)
    assert [sorted(d) for d in dying] == [[], ["a"], ["b"], ["c"]]


def test_free_dead_drops_temporaries_and_keeps_fetches_feeds_persistables_and_outputs():
    x, w = np.arange(6, dtype=np.float32), np.ones(6, np.float32)
    results = {}
    for free in (False, True):
        scope = Scope()
        scope.set_var("w", LoDTensor(w.copy()))
        exe = Executor(free_dead=free)
        (b,) = exe.run(chain(), feed={"x": x}, fetch_list=["b"], scope=scope)
        results[free] = (b.copy(), scope.find_var("out").array.copy())
        names = set(scope.local_names())
        if free:
            assert names == {"x", "w", "b", "out"}  # a and c dropped; b is fetched
        else:
            assert names == {"x", "w", "a", "b", "c", "out"}
    assert all(np.array_equal(u, v) for u, v in zip(results[False], results[True], strict=True))
    np.testing.assert_array_equal(results[True][1], (x * 2 * 3 + 1) * 0.5)


def test_a_var_another_block_names_is_never_freed():
    program = chain()
    sub = program.create_block(parent_idx=0)
    sub.add_op("scale", {"X": ["a"]}, {"Out": ["d"]}, {"scale": 1.0})
    block = program.global_block()
    assert [sorted(d) for d in Liveness(block, block.ops, ()).dying] == [[], [], ["b"], ["c"]]


def test_a_kept_reference_stops_reuse_but_not_the_result():
    """sum may compute into its dying X[0]'s array only when nothing else holds it."""
    program = program_with(
        ("scale", {"X": ["x"]}, {"Out": ["a"]}, {"scale": 2.0}),
        ("sum", {"X": ["a", "x"]}, {"Out": ["s"]}, {}),
    )
    x = np.arange(4, dtype=np.float32)
    scope = Scope()
    Executor(free_dead=True).run(program, feed={"x": x}, scope=scope)
    assert scope.find_var("a") is None
    np.testing.assert_array_equal(scope.find_var("s").array, x * 2 + x)


def mlp_steps(free: bool, float64: bool, steps: int = 3) -> tuple[dict[str, bytes], list[bytes]]:
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    if float64:
        main, startup = as_float64(main), as_float64(startup)
    scope, exe = Scope(), Executor(seed=5, free_dead=free)
    exe.run(startup, scope=scope)
    losses = []
    for step in range(steps):
        (loss,) = exe.run(main, feed=synthetic_batch(main, 8, 0, step), fetch_list=["mean_0.tmp_0"], scope=scope)
        losses.append(loss.tobytes())
    params = {name: scope.find_var(name).array.tobytes() for name, var in main.global_block().vars.items()
              if var.persistable and isinstance(scope.find_var(name), LoDTensor)}
    return params, losses


@pytest.mark.parametrize("float64", [False, True], ids=["float32", "float64"])
def test_training_with_free_dead_gives_the_same_bits(float64):
    plain, plain_losses = mlp_steps(False, float64)
    freed, freed_losses = mlp_steps(True, float64)
    assert plain_losses == freed_losses
    assert plain.keys() == freed.keys() and [n for n in plain if plain[n] != freed[n]] == []


def test_a_pserver_block_frees_the_trainers_grads_after_their_sum_never_the_params():
    folder = PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    result = transpile(main, startup, pservers=EPS, trainers=2)
    for pserver, _ in result.pservers.values():
        served = [b for b in pserver.blocks if b.idx > 0]
        assert served
        for block in served:
            liveness = Liveness(block, block.ops, ())
            assert liveness.served
            freed = {name for d in liveness.dying for name in d}
            sums = [op for op in block.ops if op.type == "sum"]
            for op in sums:  # every per-trainer grad dies at its sum
                assert set(op.input_names) <= freed
            assert all(not block.find_var(name).persistable for name in freed)
    # the trainer frees grads and activations it produced, never a feed; of the params,
    # only those it receives whole later in the step (`Liveness.released`)
    trainer = result.trainer.global_block()
    liveness = Liveness(trainer, trainer.ops, ())
    freed = {name for d in liveness.dying for name in d}
    assert {n for n in freed if trainer.find_var(n).persistable} == liveness.released == {"fc_w", "fc_b"}
    assert not freed & {"x", "y"} and any(name.endswith("@GRAD") for name in freed)


# ------------------------------------------------------------ kernels into kept arrays


def run_sync(program: Program, scope: Scope) -> None:
    """Run as a sync pserver's blocks run: every read ordered before the updates."""
    Executor(free_dead=True).run(program, scope=scope, update_in_place=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sgd_in_place_in_chunks_gives_the_bits_of_the_whole_array_path(dtype, monkeypatch):
    monkeypatch.setattr(optimizers, "SGD_CHUNK_BYTES", 1000 * np.dtype(dtype).itemsize)  # a few chunks, one partial
    rng = np.random.default_rng(0)
    param, grad = rng.standard_normal(4321).astype(dtype), rng.standard_normal(4321).astype(dtype)
    lr = np.array([0.1], dtype)
    program = program_with(("sgd", {"Param": ["p"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["p"]}, {}),
                           persistable=("p", "g", "lr"))
    scope = Scope()
    for name, value in (("p", param.copy()), ("g", grad), ("lr", lr)):
        scope.set_var(name, LoDTensor(value))
    where = scope.find_var("p").array
    run_sync(program, scope)
    assert scope.find_var("p").array is where  # in place
    assert scope.find_var("p").array.tobytes() == np.subtract(param, np.multiply(grad, lr[0], dtype=dtype)).tobytes()


def test_sum_and_concat_compute_into_the_output_var_they_replace_when_nobody_else_holds_it():
    program = program_with(
        ("sum", {"X": ["a", "b"]}, {"Out": ["s"]}, {}),
        ("concat", {"X": ["a", "b"]}, {"Out": ["c"]}, {"axis": 0}),
        persistable=("a", "b", "s", "c"),
    )
    a, b = np.arange(3, dtype=np.float32), np.full(3, 0.5, np.float32)
    scope = Scope()
    for name, value in (("a", a), ("b", b), ("s", np.zeros(3, np.float32)), ("c", np.zeros(6, np.float32))):
        scope.set_var(name, LoDTensor(value))
    s_array, c_array = scope.find_var("s").array, scope.find_var("c").array
    del s_array  # only the scope holds s: reused; c is held here too: a new array
    s_address = scope.find_var("s").array.__array_interface__["data"][0]
    Executor().run(program, scope=scope)
    assert scope.find_var("s").array.__array_interface__["data"][0] == s_address
    assert scope.find_var("c").array is not c_array and not c_array.any()  # what we hold did not change
    np.testing.assert_array_equal(scope.find_var("s").array, a + b)
    np.testing.assert_array_equal(scope.find_var("c").array, np.concatenate([a, b]))


def test_a_freed_grad_goes_back_to_the_op_that_computes_into_it():
    """Local training: the weight grads leave the scope after their last read, and
    `mul_grad` computes the next step's into the same arrays (its output buffers)."""
    folder = PADDLE_PROGRAMS / "mlp_adam_2ps"
    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    scope, exe = Scope(), Executor(seed=5, free_dead=True)
    exe.run(startup, scope=scope)
    grads = [name for name in main.global_block().vars if name.endswith(".w@GRAD")]
    assert len(grads) == 3
    places = []
    for step in range(3):
        exe.run(main, feed=synthetic_batch(main, 8, 0, step), fetch_list=["mean_0.tmp_0"], scope=scope)
        assert [name for name in grads if scope.find_var(name) is not None] == []
        prepared = exe._prepared[main.global_block()]
        places.append([{key: array.__array_interface__["data"][0] for key, array in memo["spares"].items()
                        if array is not None} for op, _, memo in prepared.steps if op.type == "mul_grad"])
    assert places[0] and all(len(spares) for spares in places[0])
    assert places[1] == places[0] == places[2]


def test_concat_of_blocks_received_into_the_output_itself_copies_nothing():
    """A transport that writes param blocks straight into views of the param: concat
    keeps the array (its bytes are the concatenation already); anything else is copied."""
    program = program_with(("concat", {"X": ["b0", "b1"]}, {"Out": ["w"]}, {"axis": 0}), persistable=("w",))
    whole = np.arange(12, dtype=np.float32).reshape(4, 3)
    scope = Scope()
    scope.set_var("w", LoDTensor(whole))
    scope.set_var("b0", LoDTensor(whole[:1]))
    scope.set_var("b1", LoDTensor(whole[1:]))
    Executor().run(program, scope=scope)
    assert scope.find_var("w").array is whole
    np.testing.assert_array_equal(whole, np.arange(12, dtype=np.float32).reshape(4, 3))
    scope.set_var("b0", LoDTensor(whole[1:2]))  # out of order: a real concatenation
    scope.set_var("b1", LoDTensor(whole[1:]))
    Executor().run(program, scope=scope)
    got = scope.find_var("w").array
    assert got is not whole
    np.testing.assert_array_equal(got, np.concatenate([whole[1:2], whole[1:]]))
