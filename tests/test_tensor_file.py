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
from ops.rpc.tensor_file import TensorFileError, decode_tensor, encode_tensor, read_tensor, write_tensor
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



def test_a_0d_tensor_stays_0d():
    """Paddle 2.x programs hold 0-d vars (the learning rate): dims [] in the file, as Paddle
    2.6 writes them, and back as 0-d (a checkpoint's manifest records shape [])."""
    back = decode_tensor(encode_tensor(np.array(0.5, np.float32)))
    assert back.array.shape == () and back.array == np.float32(0.5)


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
