"""`Session`'s checkpoint options in local training: checkpoints every N steps and at the
end, `restore=` resumes at the step with the same values, `init=` warm starts, `pull()`."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from e2e_support import EXAMPLES

from ops.rpc.checkpoint import CheckpointError
from ops.rpc.fetch import write_vars
from transpiler.errors import PsTranspilerError
from transpiler.runtime.role import Role
from transpiler.runtime.session import Session

sys.path.insert(0, str(EXAMPLES))
import mlp  # noqa: E402


def batch(step):
    rng = np.random.default_rng([7, step])
    return {"img": rng.standard_normal((8, 784)).astype(np.float32), "label": rng.integers(0, 10, (8, 1))}


def train(session, until):
    session.start()
    for step in range(session.steps, until):
        session.run(batch(step))


def test_a_restored_local_session_resumes_at_the_step_with_the_same_state(tmp_path):
    main, startup = mlp.build()
    with Session(main, startup, role=Role.local(), checkpoint_dir=tmp_path, checkpoint_every=2, keep_checkpoints=2) as s:
        train(s, 5)  # checkpoints 2 and 4, and 5 at the end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4", "ckpt-5", "latest"]
    with Session(main, startup, role=Role.local()) as uninterrupted:
        train(uninterrupted, 8)
    with Session(main, startup, role=Role.local(), restore=tmp_path / "ckpt-4") as resumed:
        assert resumed.steps == 4
        train(resumed, 8)
    want, got = uninterrupted.pull(), resumed.pull()
    assert want.keys() == got.keys() == {"h1.w", "h1.b", "h2.w", "h2.b", "out.w", "out.b"}
    for name in want:  # Adam's moments and beta powers came back too: bit for bit
        assert np.array_equal(want[name], got[name]), name


def test_init_warm_starts_and_restore_needs_a_checkpoint(tmp_path):
    main, startup = mlp.build()
    given = {"out.b": np.arange(10, dtype=np.float32)}
    write_vars(tmp_path / "given", given)
    with Session(main, startup, role=Role.local(), init=tmp_path / "given") as s:
        s.start()
        assert np.array_equal(s.pull(["out.b"])["out.b"], given["out.b"])
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Session(main, startup, role=Role.local(), restore=tmp_path)


def test_session_checkpoint_options_fall_back_on_what_a_launcher_set():
    from transpiler.runtime.session import launcher_checkpoint_options

    env = {"PSTRANSPILE_CHECKPOINT_DIR": "/ckpt", "PSTRANSPILE_CHECKPOINT_EVERY": "5", "PSTRANSPILE_RESTORE": "/ckpt"}
    assert launcher_checkpoint_options(None, None, None, env) == ("/ckpt", 5, "/ckpt")
    assert launcher_checkpoint_options("/mine", 2, "/old", env) == ("/mine", 2, "/old")  # the script's own win
    assert launcher_checkpoint_options(None, 0, None, env) == ("/ckpt", 0, "/ckpt")  # 0 is an answer, not a default
    assert launcher_checkpoint_options(None, None, None, {}) == (None, 0, None)
    with pytest.raises(PsTranspilerError, match="PSTRANSPILE_CHECKPOINT_EVERY='often' is not an integer"):
        launcher_checkpoint_options(None, None, None, {"PSTRANSPILE_CHECKPOINT_EVERY": "often"})


def noisy_mlp():
    """The MLP with Gaussian noise (a `gaussian_random` op, seed 0: the executor's
    stream) added to its input every step: a program whose steps draw random numbers."""
    from transpiler.frontend import ParamAttr, Program, data, layers, optimizer, program_guard, unique_name
    from transpiler.frontend.layer_helper import LayerHelper

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        img = data(name="img", shape=[None, 784], dtype="float32")
        label = data(name="label", shape=[None, 1], dtype="int64")
        helper = LayerHelper("gaussian_random")
        noise = helper.create_variable_for_type_inference("float32")
        helper.append_op("gaussian_random", {}, {"Out": [noise]},
                         {"shape": [784], "mean": 0.0, "std": 0.5, "seed": 0, "dtype": int(noise.dtype)})
        noise.stop_gradient = True
        noisy = layers.elementwise_add(img, noise)
        hidden = layers.fc(input=noisy, size=32, act="relu", param_attr=ParamAttr(name="h1.w"), bias_attr=ParamAttr(name="h1.b"))
        logits = layers.fc(input=hidden, size=10, param_attr=ParamAttr(name="out.w"), bias_attr=ParamAttr(name="out.b"))
        optimizer.Adam(learning_rate=0.01).minimize(layers.mean(layers.softmax_with_cross_entropy(logits=logits, label=label)))
    return main, startup


def test_a_program_that_draws_random_numbers_each_step_restores_bit_identical(tmp_path):
    """The RNG state is the step: a restored session draws at step k what an
    uninterrupted one draws there (not what a fresh executor draws first)."""
    main, startup = noisy_mlp()
    assert any(op.type == "gaussian_random" for op in main.global_block().ops)
    with Session(main, startup, role=Role.local(), checkpoint_dir=tmp_path, checkpoint_every=3) as s:
        train(s, 3)
    with Session(main, startup, role=Role.local()) as uninterrupted:
        train(uninterrupted, 6)
    with Session(main, startup, role=Role.local(), restore=tmp_path) as resumed:
        assert resumed.steps == 3
        train(resumed, 6)
    want, got = uninterrupted.pull(), resumed.pull()
    assert want.keys() == got.keys() == {"h1.w", "h1.b", "out.w", "out.b"}
    for name in want:
        assert np.array_equal(want[name], got[name]), name
    with Session(main, startup, role=Role.local()) as other:  # the noise matters: without it the params differ
        other.start()
        for step in range(6):
            other.executor.stream = None  # one stream for the executor's life: what a restore could not reproduce
            other.executor.run(other.program, feed=batch(step), scope=other.scope)
    assert not np.array_equal(other.pull()["h1.w"], want["h1.w"])
