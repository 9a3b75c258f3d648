"""The fused `rnn` op and its grad (ops/kernels/recurrent.py): float64 finite differences
for every mode over two stacked layers, and Paddle 2.6's own kernels on the same weights
(`paddle.nn.LSTM` / `GRU` / `SimpleRNN` built in a Paddle subprocess; skipped when its
venv is absent); plus `coalesce_tensor` and `fill_any_like`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import TESTS
from ops.executor import ExecutionError
from ops.testing import run_op

sys.path.insert(0, str(TESTS.parent))
from tools.paddle_env import installed  # noqa: E402

T, N, I, H, LAYERS = 3, 2, 4, 5, 2
MODES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def weights(mode: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Paddle's WeightList order: every layer's [W_ih, W_hh], then every layer's [b_ih, b_hh]."""
    g = MODES[mode] * H
    ws = []
    for layer in range(LAYERS):
        ws += [rng.uniform(-0.5, 0.5, (g, I if layer == 0 else H)), rng.uniform(-0.5, 0.5, (g, H))]
    bs = [rng.uniform(-0.5, 0.5, g) for _ in range(2 * LAYERS)]
    return ws + bs


def attrs(mode: str) -> dict:
    return {"mode": mode, "num_layers": LAYERS, "hidden_size": H, "input_size": I, "is_bidirec": False,
            "dropout_prob": 0.0, "is_test": False, "seed": 0}


def forward(mode: str, x, states, ws) -> dict:
    n_states = 2 if mode == "LSTM" else 1
    return run_op("rnn", {"Input": x, "PreState": states, "WeightList": ws},
                  {"Out": 1, "State": n_states, "Reserve": 1, "DropoutState": 1}, attrs(mode))


def backward(mode: str, x, states, ws, d_out, d_states) -> dict:
    fwd = forward(mode, x, states, ws)
    n_states = len(states)
    return run_op("rnn_grad", {"Input": x, "PreState": states, "WeightList": ws, "Out": one(fwd["Out"]),
                               "Out@GRAD": d_out, "State@GRAD": d_states},
                  {"Input@GRAD": 1, "PreState@GRAD": n_states, "WeightList@GRAD": len(ws)}, attrs(mode))


def as_list(value):
    return value if isinstance(value, list) else [value]


def one(value):
    (only,) = as_list(value)
    return only


@pytest.mark.parametrize("mode", list(MODES))
def test_grads_match_finite_differences(mode):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, N, I))
    states = [rng.standard_normal((LAYERS, N, H)) * 0.5 for _ in range(2 if mode == "LSTM" else 1)]
    ws = weights(mode, rng)
    d_out = rng.standard_normal((T, N, H))
    d_states = [rng.standard_normal((LAYERS, N, H)) for _ in states]

    def loss(x, states, ws) -> float:
        out = forward(mode, x, states, ws)
        total = float((one(out["Out"]) * d_out).sum())
        return total + sum(float((s * d).sum()) for s, d in zip(as_list(out["State"]), d_states, strict=True))

    grads = backward(mode, x, states, ws, d_out, d_states)

    def numeric(array: np.ndarray, index) -> float:
        keep = array[index]
        array[index] = keep + 1e-6
        up = loss(x, states, ws)
        array[index] = keep - 1e-6
        down = loss(x, states, ws)
        array[index] = keep
        return (up - down) / 2e-6

    checks = [(w, g) for w, g in zip(ws, as_list(grads["WeightList@GRAD"]), strict=True)]
    checks += [(x, one(grads["Input@GRAD"]))] + list(zip(states, as_list(grads["PreState@GRAD"]), strict=True))
    for array, grad in checks:
        assert grad.shape == array.shape
        for index in list(np.ndindex(array.shape))[:: max(1, array.size // 5)]:
            assert grad[index] == pytest.approx(numeric(array, index), rel=1e-6, abs=1e-8)


def test_unsupported_configurations_are_refused_by_name():
    rng = np.random.default_rng(0)
    ws = weights("GRU", rng)
    x, h0 = np.zeros((T, N, I)), np.zeros((LAYERS, N, H))
    with pytest.raises(ExecutionError, match="bidirectional"):
        run_op("rnn", {"Input": x, "PreState": [h0], "WeightList": ws}, {"Out": 1, "State": 1},
               {**attrs("GRU"), "is_bidirec": True})
    with pytest.raises(ExecutionError, match="mode 'LSTMP'"):
        run_op("rnn", {"Input": x, "PreState": [h0], "WeightList": ws}, {"Out": 1, "State": 1},
               {**attrs("GRU"), "mode": "LSTMP"})


def test_coalesce_tensor_copies_or_sets_and_fuses():
    a, b = np.arange(6.0).reshape(2, 3), np.array([7.0, 8.0])
    out = run_op("coalesce_tensor", {"Input": [a, b]}, {"Output": 2, "FusedOutput": 1},
                 {"dtype": 6, "copy_data": True})
    assert np.array_equal(out["Output"][0], a) and np.array_equal(out["Output"][1], b)
    assert np.array_equal(one(out["FusedOutput"]), np.concatenate([a.ravel(), b]))
    out = run_op("coalesce_tensor", {"Input": [a, b]}, {"Output": 2, "FusedOutput": 1},
                 {"dtype": 6, "set_constant": True, "constant": 0.5})
    assert np.array_equal(one(out["FusedOutput"]), np.full(8, 0.5))


def test_fill_any_like():
    out = run_op("fill_any_like", {"X": np.zeros((2, 3), np.float32)}, attrs={"value": 2.0, "dtype": -1})["Out"]
    assert out.dtype == np.float32 and np.array_equal(out, np.full((2, 3), 2.0, np.float32))


PADDLE_SCRIPT = textwrap.dedent('''
    import numpy.random  # noqa: F401
    import sys
    import numpy as np
    import paddle
    folder = sys.argv[1]
    paddle.enable_static()
    paddle.set_default_dtype("float64")
    for mode in sys.argv[2:]:
        given = np.load(f"{folder}/{mode}.in.npz")
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [3, 2, 4], "float64")
            x.stop_gradient = False
            layer = {"LSTM": paddle.nn.LSTM, "GRU": paddle.nn.GRU, "RNN_TANH": paddle.nn.SimpleRNN,
                     "RNN_RELU": lambda *a, **k: paddle.nn.SimpleRNN(*a, activation="relu", **k)}[mode](
                         4, 5, num_layers=2, time_major=True)
            out, _ = layer(x)
            d_out = paddle.static.data("d_out", [3, 2, 5], "float64")  # fed: a constant would be kept in float32
            loss = paddle.sum(out * d_out)
            paddle.static.append_backward(loss)
        (rnn,) = [op for op in main.global_block().ops if op.type == "rnn"]
        names = rnn.input("WeightList")
        exe = paddle.static.Executor(paddle.CPUPlace())
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            exe.run(startup)
            for i, name in enumerate(names):
                scope.var(name).get_tensor().set(given[f"w{i}"], paddle.CPUPlace())
            fetched = exe.run(main, feed={"x": given["x"], "d_out": given["d_out"]},
                              fetch_list=[out.name, "x@GRAD"] + [n + "@GRAD" for n in names])
        np.savez(f"{folder}/{mode}.out.npz", out=fetched[0], dx=fetched[1],
                 **{f"dw{i}": v for i, v in enumerate(fetched[2:])})
''')


def case_inputs(mode: str):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((T, N, I))
    ws = weights(mode, rng)
    return x, ws, rng.standard_normal((T, N, H))


@pytest.fixture(scope="module")
def paddle_results(tmp_path_factory):
    """Paddle's outputs and grads for every mode, from one Paddle subprocess."""
    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    folder = tmp_path_factory.mktemp("paddle_rnn")
    for mode in MODES:
        x, ws, d_out = case_inputs(mode)
        np.savez(folder / f"{mode}.in.npz", x=x, d_out=d_out, **{f"w{i}": w for i, w in enumerate(ws)})
    (folder / "paddle_rnn.py").write_text(PADDLE_SCRIPT)
    done = subprocess.run([str(python), str(folder / "paddle_rnn.py"), str(folder), *MODES], capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return {mode: dict(np.load(folder / f"{mode}.out.npz")) for mode in MODES}


@pytest.mark.parametrize("mode", list(MODES))
def test_matches_paddle_2_6(mode, paddle_results):
    """Two stacked layers with zero initial states (what Paddle makes when none are given):
    the output and every grad agree with Paddle's CPU kernels to 1e-10 in float64."""
    theirs = paddle_results[mode]
    x, ws, d_out = case_inputs(mode)
    states = [np.zeros((LAYERS, N, H)) for _ in range(2 if mode == "LSTM" else 1)]
    ours = forward(mode, x, states, ws)
    np.testing.assert_allclose(one(ours["Out"]), theirs["out"], rtol=1e-10, atol=1e-12)
    grads = backward(mode, x, states, ws, d_out, [np.zeros((LAYERS, N, H)) for _ in states])
    np.testing.assert_allclose(one(grads["Input@GRAD"]), theirs["dx"], rtol=1e-10, atol=1e-12)
    for i, grad in enumerate(as_list(grads["WeightList@GRAD"])):
        np.testing.assert_allclose(grad, theirs[f"dw{i}"], rtol=1e-10, atol=1e-12, err_msg=f"WeightList[{i}]")
