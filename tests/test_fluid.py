"""`transpiler.fluid`: Fluid 1.x's names over our builder and executor — a script trains,
saves Fluid's LoDTensor files, loads them back, and saves a pruned inference model."""

from __future__ import annotations

import numpy as np
import pytest

import transpiler.fluid as fluid
from ops.rpc.tensor_file import read_tensor
from transpiler.errors import PsTranspilerError
from transpiler.ir import Program


def build():
    main, startup = fluid.Program(), fluid.Program()
    with fluid.unique_name.guard(), fluid.program_guard(main, startup):
        img = fluid.layers.data(name="img", shape=[4], dtype="float32")
        label = fluid.layers.data(name="label", shape=[1], dtype="int64")
        pred = fluid.layers.fc(input=img, size=3, act="softmax")
        loss = fluid.layers.mean(fluid.layers.cross_entropy(input=pred, label=label))
        fluid.optimizer.Adam(learning_rate=0.1).minimize(loss)
    return main, startup, pred, loss


def data():
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    return x, np.array([[0], [1], [2], [0], [1], [2]], dtype="int64")


def test_a_fluid_script_trains_saves_and_loads(tmp_path):
    main, startup, _, loss = build()
    exe = fluid.Executor(fluid.CPUPlace())
    scope = fluid.Scope()
    exe.run(startup, scope=scope)
    x, y = data()
    feeder = fluid.DataFeeder(feed_list=["img", "label"], place=fluid.CPUPlace(), program=main)
    feed = feeder.feed(list(zip(x, y)))
    assert feed["img"].shape == (6, 4) and feed["label"].dtype == np.int64
    losses = [float(exe.run(main, feed=feed, fetch_list=[loss], scope=scope)[0][0]) for _ in range(5)]
    assert losses[-1] < losses[0]
    names = fluid.io.persistable_names(main)
    assert "fc_0.w_0" in names and "fc_0.w_0_moment1_0" in names and "learning_rate_0" in names
    values = fluid.io.scope_values(names, scope)
    fluid.io.write_vars(tmp_path / "model", values)
    for name in names:
        np.testing.assert_array_equal(read_tensor(tmp_path / "model" / name), values[name])
    other = fluid.Scope()
    fluid.io.load_vars(exe, tmp_path / "model", main, scope=other)
    for name in names:
        np.testing.assert_array_equal(other.find_var(name).array, values[name])


def test_the_global_scope_round_trip_and_inference_model(tmp_path):
    main, startup, pred, loss = build()
    exe = fluid.Executor(fluid.CPUPlace())
    exe.run(startup)  # the global scope, as Fluid scripts use it
    x, y = data()
    exe.run(main, feed={"img": x, "label": y}, fetch_list=[loss])
    saved = fluid.io.save_persistables(exe, tmp_path / "p", main)
    assert sorted(p.name for p in saved) == fluid.io.persistable_names(main)
    targets = fluid.io.save_inference_model(str(tmp_path / "inf"), ["img"], [pred], exe, main)
    assert targets == [pred.name]
    assert sorted(p.name for p in (tmp_path / "inf").iterdir()) == ["__model__", "fc_0.b_0", "fc_0.w_0"]
    inference = Program.from_bytes((tmp_path / "inf" / "__model__").read_bytes())
    assert [op.type for op in inference.global_block().ops] == ["feed", "mul", "elementwise_add", "softmax", "fetch"]
    (probs,) = exe.run(inference, feed={"img": x}, fetch_list=[pred.name])
    w = read_tensor(tmp_path / "inf" / "fc_0.w_0")
    b = read_tensor(tmp_path / "inf" / "fc_0.b_0")
    logits = x @ w + b
    expected = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probs, expected / expected.sum(1, keepdims=True), rtol=1e-5)
    fluid.io.load_persistables(exe, tmp_path / "p", main)  # files of every persistable load back


def test_clear_errors():
    main, _, _, _ = build()
    exe = fluid.Executor(fluid.CPUPlace())
    with pytest.raises(PsTranspilerError, match="CPU only"):
        fluid.CUDAPlace(0)
    with pytest.raises(fluid.io.FluidIOError, match="not a tensor in the scope"):
        fluid.io.scope_values(["fc_0.w_0"], fluid.Scope())
    with pytest.raises(fluid.io.FluidIOError, match="no var 'nope'"):
        fluid.io.inference_program(main, ["img"], ["nope"])
    with pytest.raises(fluid.io.FluidIOError, match="filename="):
        fluid.io.save_persistables(exe, "/nonexistent", main, filename="all")
    exe.close()
    with pytest.raises(PsTranspilerError, match="after close"):
        exe.run(main)
