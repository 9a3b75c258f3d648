"""Fluid's LoDTensor file format (`ops.rpc.tensor_file`): round trips, torn and foreign
files refused, and — when Fluid 1.8.5's venv is on this machine (`tools/paddle_env.py`) —
byte-identical to what `fluid.io.save_persistables` writes, loaded by
`fluid.io.load_persistables`, and a model trained here (the MLP with Adam: params,
moments, beta powers, learning rate), fetched whole from its checkpoint, loads into the
same network built by Fluid itself, every var bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import TESTS
from ops.rpc.tensor_file import TensorFileError, conform_scalar, decode_tensor, encode_tensor, read_tensor, write_tensor
from transpiler.cli import main as cli_main

sys.path.insert(0, str(TESTS.parent))
from tools.paddle_env import installed  # noqa: E402

VALUES = {
    "w": np.full((3, 2), 0.5, np.float32),
    "b.x": np.full((4,), -1.25, np.float64),
    "step_i": np.full((2,), 7, np.int64),
}

PADDLE_SCRIPT = r"""
import sys, numpy as np, paddle.fluid as fluid
out, ours = sys.argv[1], sys.argv[2]
def program():
    main, start = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, start):
        fluid.layers.create_parameter([3, 2], "float32", name="w", default_initializer=fluid.initializer.ConstantInitializer(0.5))
        fluid.layers.create_parameter([4], "float64", name="b.x", default_initializer=fluid.initializer.ConstantInitializer(-1.25))
        fluid.layers.create_global_var([2], 7, "int64", persistable=True, name="step_i")
    return main, start
exe = fluid.Executor(fluid.CPUPlace())
main, start = program()
exe.run(start)
fluid.io.save_persistables(exe, out, main)
main, start = program()
scope = fluid.Scope()
with fluid.scope_guard(scope):
    exe.run(start)
    fluid.io.load_persistables(exe, ours, main)
    for name in ("w", "b.x", "step_i"):
        print(name, np.array(scope.find_var(name).get_tensor()).ravel().tolist())
"""


def test_round_trip_keeps_dtype_shape_values_and_lod(tmp_path):
    for dtype in (np.float32, np.float64, np.int64, np.int32, np.float16, np.bool_):
        array = (np.arange(24).reshape(2, 3, 4) % 3).astype(dtype)
        back = decode_tensor(encode_tensor(array))
        assert back.array.dtype == array.dtype and np.array_equal(back.array, array)
    lod = [np.array([0, 2, 3])]
    back = decode_tensor(encode_tensor(np.ones((3, 1), np.float32), lod))
    assert back.lod_lists() == [[0, 2, 3]]
    sha = write_tensor(tmp_path / "x", np.zeros((0, 5), np.float32))
    assert read_tensor(tmp_path / "x").shape == (0, 5) and len(sha) == 64


# What Paddle 2.6.2's `core.save_lod_tensor` wrote for float32 0.5 held 0-d (`shape []`)
# and held `[1]` (the two ways the two Paddles hold a scalar such as the learning rate).
PADDLE_2_6_ZERO_D = bytes.fromhex("00000000" "0000000000000000" "00000000" "02000000" "0805" "0000003f")
PADDLE_2_6_ONE = bytes.fromhex("00000000" "0000000000000000" "00000000" "04000000" "08051001" "0000003f")


def test_a_0_d_var_is_written_as_paddle_2_x_writes_it_and_both_forms_read():
    assert encode_tensor(np.array(0.5, np.float32)) == PADDLE_2_6_ZERO_D  # dims empty, not [1]
    assert encode_tensor(np.array([0.5], np.float32)) == PADDLE_2_6_ONE
    assert encode_tensor(np.array(3.0, np.float64)[()]) == encode_tensor(np.array(3.0, np.float64))  # a numpy scalar
    zero_d, one = decode_tensor(PADDLE_2_6_ZERO_D).array, decode_tensor(PADDLE_2_6_ONE).array
    assert zero_d.shape == () and one.shape == (1,) and zero_d == one == 0.5
    assert conform_scalar(one, []).shape == () and conform_scalar(zero_d, [1]).shape == (1,)
    assert conform_scalar(one, [1]) is one
    assert conform_scalar(np.zeros(2), []) is None and conform_scalar(np.zeros((1, 1)), []) is None
    assert conform_scalar(zero_d, [2]) is None


PADDLE_2_SCRIPT = r"""
import sys, numpy as np
from paddle.base import core
t = core.LoDTensor()
core.load_lod_tensor(t, sys.argv[1])
print(list(np.array(t).shape), float(np.array(t)))
t.set(np.array(-2.5, np.float64), core.CPUPlace())
core.save_lod_tensor(t, sys.argv[2])
"""


def test_paddle_2_6_loads_our_0_d_file_and_we_read_its(tmp_path):
    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    write_tensor(tmp_path / "ours", np.array(0.25, np.float32))
    script = tmp_path / "zero_d.py"
    script.write_text(PADDLE_2_SCRIPT)
    done = subprocess.run([str(python), str(script), str(tmp_path / "ours"), str(tmp_path / "theirs")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[] 0.25"
    theirs = read_tensor(tmp_path / "theirs")
    assert theirs.shape == () and theirs.dtype == np.float64 and theirs == -2.5
    assert (tmp_path / "theirs").read_bytes() == encode_tensor(np.array(-2.5, np.float64))


def test_a_torn_or_foreign_file_is_refused(tmp_path):
    data = encode_tensor(np.ones((10, 10), np.float32))
    for bad in (data[:-1], data[:20], b"", b"\x93NUMPY..." + data, data + b"x"):
        with pytest.raises(TensorFileError):
            decode_tensor(bad)
    with pytest.raises(TensorFileError, match="cannot read"):
        read_tensor(tmp_path / "missing")


def test_files_match_fluid_1_8_5_both_ways(tmp_path):
    python = installed("1.8.5")
    if python is None:
        pytest.skip("Fluid 1.8.5's venv is not on this machine (python tools/paddle_env.py 1.8.5 makes it)")
    ours = tmp_path / "ours"
    for name, array in VALUES.items():
        write_tensor(ours / name, array * (2 if array.dtype != np.int64 else 3))
    script = tmp_path / "paddle_io.py"
    script.write_text(PADDLE_SCRIPT)
    done = subprocess.run([str(python), str(script), str(tmp_path / "paddle"), str(ours)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, array in VALUES.items():  # Paddle's bytes are ours, byte for byte
        assert (tmp_path / "paddle" / name).read_bytes() == encode_tensor(array), name
    loaded = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    for name, array in VALUES.items():  # Paddle loads what we wrote
        expected = (array * (2 if array.dtype != np.int64 else 3)).ravel().tolist()
        assert json.loads(loaded[name]) == expected, name


FLUID_MLP = r"""
import json, sys, numpy as np, paddle.fluid as fluid
main, start = fluid.Program(), fluid.Program()
with fluid.program_guard(main, start):
    img = fluid.data(name="img", shape=[None, 784], dtype="float32")
    label = fluid.data(name="label", shape=[None, 1], dtype="int64")
    fc = lambda x, n, name, act=None: fluid.layers.fc(x, n, act=act, param_attr=fluid.ParamAttr(name=name + ".w"),
                                                       bias_attr=fluid.ParamAttr(name=name + ".b"))
    logits = fc(fc(fc(img, 256, "h1", "relu"), 128, "h2", "relu"), 10, "out")
    fluid.optimizer.Adam(0.001).minimize(fluid.layers.mean(fluid.layers.softmax_with_cross_entropy(logits, label)))
exe = fluid.Executor(fluid.CPUPlace())
exe.run(start)
fluid.io.load_persistables(exe, sys.argv[1], main)
names = sorted(v.name for v in main.list_vars() if fluid.io.is_persistable(v))
print(json.dumps({n: np.array(fluid.global_scope().find_var(n).get_tensor()).tobytes().hex() for n in names}))
"""


def test_a_model_trained_here_loads_in_fluid_1_8_5(tmp_path):
    python = installed("1.8.5")
    if python is None:
        pytest.skip("Fluid 1.8.5's venv is not on this machine (python tools/paddle_env.py 1.8.5 makes it)")
    from e2e_support import EXAMPLES, run_script_locally, save

    sys.path.insert(0, str(EXAMPLES))
    import mlp

    main_pb, startup_pb = save(tmp_path, *mlp.build())
    run_script_locally((str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
                        "--loss", "mean_0.tmp_0", "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--checkpoint-every", "2"))
    assert cli_main(["fetch", "--checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "model")]) == 0
    script = tmp_path / "fluid_mlp.py"
    script.write_text(FLUID_MLP)
    done = subprocess.run([str(python), str(script), str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    ours = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert sorted(loaded) == ours and len(ours) == 31  # 6 params, 4 accumulators each, the learning rate
    for name in ours:
        assert bytes.fromhex(loaded[name]) == read_tensor(tmp_path / "model" / name).tobytes(), name


PADDLE_2_LOAD = r"""
import json, sys, numpy as np, paddle
paddle.enable_static()
main = paddle.static.Program.parse_from_string(open(sys.argv[1], "rb").read())
exe = paddle.static.Executor(paddle.CPUPlace())
names = sorted(v.name for v in main.list_vars() if v.persistable and v.name not in ("feed", "fetch"))
paddle.static.io.load_vars(exe, sys.argv[2], main_program=main, predicate=lambda v: v.persistable and v.name in names)
scope = paddle.static.global_scope()
out = {n: np.array(scope.find_var(n).get_tensor()) for n in names if scope.find_var(n) is not None}
print(json.dumps({n: [list(a.shape), a.dtype.name, a.tobytes().hex()] for n, a in out.items()}))
"""


def test_a_paddle_2_6_program_trained_here_loads_back_into_paddle_2_6(tmp_path):
    """The Paddle 2.6-built MLP (`mlp_adam_2ps`: a 0-d learning rate) trained here with
    checkpoints, fetched whole (`pstranspile fetch`), loads into the same program in Paddle
    2.6.2 (`paddle.static.io.load_vars`): every persistable var, the learning rate 0-d, bit
    for bit."""
    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    from conftest import PADDLE_PROGRAMS
    from e2e_support import EXAMPLES, run_script_locally

    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    run_script_locally((str(EXAMPLES / "train_program.py"), "--main", str(case / "main.pb"), "--startup",
                        str(case / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "3", "--batch", "8",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"))
    assert cli_main(["fetch", "--checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "model")]) == 0
    ours = {p.name: read_tensor(p) for p in (tmp_path / "model").iterdir()}
    assert ours["learning_rate_0"].shape == ()
    script = tmp_path / "paddle_load.py"
    script.write_text(PADDLE_2_LOAD)
    done = subprocess.run([str(python), str(script), str(case / "main.pb"), str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(loaded) == sorted(ours) and len(ours) == 31
    for name, array in ours.items():
        assert loaded[name] == [list(array.shape), array.dtype.name, array.tobytes().hex()], name
