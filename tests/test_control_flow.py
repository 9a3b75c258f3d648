"""Control flow and recurrent layers in Paddle-built programs (`paddle.static.nn.cond`,
`switch_case`, `while_loop`, a `cond` inside a `while_loop`, a loop writing a tensor
array, `paddle.nn.LSTM`; tests/fixtures/paddle_programs/*, made by
tools/make_paddle_fixtures.py): training steps against Paddle 2.6's own executor when its
venv is here, grads against finite differences, distributed training equal to local
training in float64, the LSTM's coalesced weights, the CLI. The verifier's scoping rule
for grad sub-blocks is tested in test_ir_verifier.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from e2e_support import ONE_THREAD, differences, launch_training, save, train_locally, trained_params

from conftest import PADDLE_PROGRAMS, TESTS
from ops.executor import Executor
from ops.scope import Scope
from ops.tensor import LoDTensor
from paddle_fixtures_support import run_case
from transpiler.api import as_float64, transpile
from transpiler.cli import main as cli_main
from transpiler.ir import Program
from transpiler.ir.verifier import check

sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS.parent / "examples"))
from tools.paddle_env import installed  # noqa: E402
from train_program import synthetic_batch  # noqa: E402

CONTROL_FLOW_CASES = ["cond_sgd_2ps", "switch_case_sgd_3ps", "while_loop_sgd_3ps", "cond_in_while_sgd_2ps",
                      "while_array_sgd_2ps"]
TRAINED_CASES = [*CONTROL_FLOW_CASES, "lstm_sgd_2ps"]


def load(case: str) -> tuple[Program, Program, dict]:
    folder = PADDLE_PROGRAMS / case
    return (Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"),
            json.loads((folder / "case.json").read_text()))


# ------------------------------------------------------------------ distributed == local


@pytest.mark.parametrize("case", TRAINED_CASES)
def test_distributed_training_equals_local_training_in_float64(case, tmp_path):
    main, startup, info = load(case)
    pservers = len(info["pservers"].split(","))
    main_pb, startup_pb = save(tmp_path, as_float64(main), as_float64(startup))
    launch_training(tmp_path, main_pb, startup_pb, pservers=pservers, trainers=2, loss=info["loss"])
    init0, final0 = trained_params(tmp_path, 0)
    _, final1 = trained_params(tmp_path, 1)
    local = train_locally(tmp_path, main_pb, startup_pb, loss=info["loss"])
    assert local.keys() == final0.keys() == final1.keys() and local
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"{case} (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        if name in FUSED_BUFFERS:  # nothing reads it; the trainers' own (see FUSED_BUFFERS)
            continue
        assert final0[name].dtype == np.float64, name
        assert np.array_equal(final0[name], final1[name]), name
        assert np.abs(local[name] - init0[name]).max() > 0, f"{name} never changed: the comparison would prove nothing"
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=f"{case}: {name}")


# ------------------------------------------------------------------ against Paddle


def run_ours(main: Program, startup: Program, loss: str, steps: int):
    """(initial params, feeds per step, losses, final params) of `steps` local steps."""
    scope = Scope()
    exe = Executor(seed=0)
    exe.run(startup, scope=scope)
    names = [n for n, v in main.global_block().vars.items() if v.persistable and isinstance(scope.find_var(n), LoDTensor)]
    initial = {n: np.array(scope.find_var(n).array) for n in names}
    feeds, losses = [], []
    for k in range(steps):
        feed = synthetic_batch(main, 8, 0, k)
        feeds.append(feed)
        (value,) = exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
        losses.append(float(np.asarray(value).reshape(-1)[0]))
    return initial, feeds, losses, {n: np.array(scope.find_var(n).array) for n in names}


# (case, steps) each run by ours and by Paddle 2.6: one Paddle process for all (it takes seconds to import)
AGAINST_PADDLE = {"cond_sgd_2ps": 6, "switch_case_sgd_3ps": 6, "while_loop_sgd_3ps": 6, "while_array_sgd_2ps": 6,
                  "lstm_sgd_2ps": 6, "cond_in_while_sgd_2ps": 1}


@pytest.fixture(scope="module")
def against_paddle(tmp_path_factory) -> dict[str, tuple]:
    """case -> (initial params, feeds, our losses, our final params, Paddle's out.npz) of
    `AGAINST_PADDLE`'s float64 runs from the same params and feeds."""
    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    tmp = tmp_path_factory.mktemp("paddle_steps")
    ours, args = {}, []
    for case, steps in AGAINST_PADDLE.items():
        main, startup, info = load(case)
        main, startup = as_float64(main), as_float64(startup)
        initial, feeds, losses, final = run_ours(main, startup, info["loss"], steps)
        ours[case] = (initial, feeds, losses, final)
        main.save(tmp / f"{case}.main.pb")
        startup.save(tmp / f"{case}.startup.pb")
        given = {f"param/{n}": v for n, v in initial.items()}
        for k, feed in enumerate(feeds):
            given.update({f"step{k}/{n}": np.asarray(v.array if isinstance(v, LoDTensor) else v) for n, v in feed.items()})
        np.savez(tmp / f"{case}.in.npz", **given)
        args += [str(tmp / f"{case}.main.pb"), str(tmp / f"{case}.startup.pb"), str(tmp / f"{case}.in.npz"),
                 str(tmp / f"{case}.out.npz"), info["loss"], str(steps)]
    done = subprocess.run([str(python), str(TESTS / "paddle_run_steps.py"), *args], capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stderr[-3000:]
    return {case: (*ours[case], dict(np.load(tmp / f"{case}.out.npz"))) for case in AGAINST_PADDLE}


@pytest.mark.parametrize("case", ["cond_sgd_2ps", "switch_case_sgd_3ps", "while_loop_sgd_3ps", "while_array_sgd_2ps",
                                  "lstm_sgd_2ps"])
def test_training_steps_match_paddle_2_6(case, against_paddle):
    """Paddle's own executor on the same float64 programs, params and feeds: the loss of
    each of 6 steps and the params after them agree to 1e-10 (both branches of the cond
    and of the switch run within them)."""
    _, _, losses, final, theirs = against_paddle[case]
    assert len(losses) == 6
    np.testing.assert_allclose(losses, [float(theirs[f"loss/{k}"].reshape(-1)[0]) for k in range(6)], rtol=1e-10)
    for name, value in final.items():
        if name in FUSED_BUFFERS:
            continue
        np.testing.assert_allclose(value, theirs[f"param/{name}"], rtol=1e-10, atol=1e-13, err_msg=name)


# The LSTM's `coalesce_tensor` buffer: in Paddle its params are views into it, so it follows
# their updates; nothing reads it (the `rnn` op reads WeightList), and ours keeps the values
# the startup program packed (docs/control-flow.md).
FUSED_BUFFERS = {"lstm_0.w_0"}


def test_cond_in_while_forward_matches_paddle_and_its_grads_are_right_where_paddle_loses_them(against_paddle):
    """A cond inside a while_loop: the forward (the first step's loss) is Paddle's; the
    grads are not. A grad op of the branch writes the loop var's grad into the step scope
    (the var belongs to an enclosing block), and Paddle's `conditional_block_grad` copies
    out only what it finds in the branch's own scope: from the second-to-last step back,
    the loop var's grad is zero in Paddle, so `first_w` (used in step 0 only) gets no
    grad at all and Paddle never moves it. We look the grad up through the scopes and get
    what finite differences give (`test_grads_match_finite_differences`)."""
    initial, _, losses, final, theirs = against_paddle["cond_in_while_sgd_2ps"]
    np.testing.assert_allclose(losses[0], float(theirs["loss/0"].reshape(-1)[0]), rtol=1e-12)
    assert np.array_equal(theirs["param/first_w"], initial["first_w"])  # Paddle: no grad reached it
    assert np.abs(final["first_w"] - initial["first_w"]).max() > 1e-6


# Params whose grad flows back through `while_loop`'s loop var into the op before the loop:
# Paddle's `while` writes the loop var in place, so the grad op of the op that produced the
# loop's input (`tanh_grad` of `fc_0`) reads the loop's last output instead of its own:
# those grads are Paddle's (we run its program as written), a few % off the true ones.
ALIASED = {case: {"fc_0.w_0", "fc_0.b_0"} for case in ("while_loop_sgd_3ps", "cond_in_while_sgd_2ps", "while_array_sgd_2ps")}
# Paddle 2.6's backward of while_array_sgd_2ps drops a path: the loop var's output grad
# reaches while_grad renamed (`fc_0.tmp_2@GRAD@RENAME@block0@0`) and the grad body never
# reads it (no `assign` from it, unlike while_loop_sgd_3ps's), so only the tensor array's
# path reaches loop_w. We run the program as written: Paddle's result, to 1e-10.
PROGRAM_DROPS_A_PATH = {"while_array_sgd_2ps": {"loop_w"}}
# The cond's predicate is mean(fc_0.b_0) >= 0 and the bias starts at 0: a step down flips
# the branch (the loss is not differentiable there).
AT_A_BRANCH_POINT = {"cond_sgd_2ps": {"fc_0.b_0"}}


@pytest.mark.parametrize("case", CONTROL_FLOW_CASES)
def test_grads_match_finite_differences(case):
    """float64 central differences of the loss against the grads the program computes, for
    the first 4 elements of each param (both branches: cond's and switch's first step takes
    the true branch, the nested cond runs both in every pass)."""
    main, startup, info = load(case)
    main, startup = as_float64(main), as_float64(startup)
    exe = Executor(seed=0)
    scope = Scope()
    exe.run(startup, scope=scope)
    params = {n: np.array(scope.find_var(n).array) for n, v in main.global_block().vars.items()
              if v.persistable and n + "@GRAD" in main.global_block().vars}
    feed = synthetic_batch(main, 8, 0, 0)

    def run(fetch: list[str], name: str | None = None, value: np.ndarray | None = None) -> list[np.ndarray]:
        local = Scope()
        for n in main.global_block().vars:
            if main.global_block().var(n).persistable and scope.find_var(n) is not None:
                local.set_var(n, LoDTensor(np.array(scope.find_var(n).array)))
        if name is not None:
            local.set_var(name, LoDTensor(value))
        return [np.array(v) for v in exe.run(main, feed=feed, fetch_list=fetch, scope=local)]

    grads = dict(zip(params, run([n + "@GRAD" for n in params]), strict=True))
    checked = 0
    for name, value in params.items():
        if any(name in skip.get(case, ()) for skip in (ALIASED, AT_A_BRANCH_POINT, PROGRAM_DROPS_A_PATH)):
            continue
        for index in list(np.ndindex(value.shape))[:4]:
            plus, minus = value.copy(), value.copy()
            plus[index] += 1e-6
            minus[index] -= 1e-6
            numeric = (run([info["loss"]], name, plus)[0].item() - run([info["loss"]], name, minus)[0].item()) / 2e-6
            assert grads[name][index] == pytest.approx(numeric, rel=1e-5, abs=1e-9), (name, index)
            checked += 1
    assert checked >= 5


# ------------------------------------------------------------------ LSTM: coalesced params


def test_lstm_transpiles_where_paddles_transpiler_crashes():
    """Paddle's transpiler raises on the LSTM (expected.json keeps its error); ours places
    each of the coalesced weights on its own like any param and cuts the startup's
    `coalesce_tensor` per param: with `copy_data` it only hands each param its own value,
    so a pserver's startup keeps the params' own initializers and drops it."""
    case = "lstm_sgd_2ps"
    expected = json.loads((PADDLE_PROGRAMS / case / "expected.json").read_text())
    assert expected == {"paddle_transpiler_error": "KeyError: 'lstm_cell_0.w_1'"}
    result, _, _ = run_case(case)
    weights = ["lstm_cell_0.w_0", "lstm_cell_0.w_1", "lstm_cell_0.b_0", "lstm_cell_0.b_1"]
    placed = {p.param: p.endpoints for p in result.plan.params}
    assert set(weights) <= set(placed) and "lstm_0.w_0" not in placed
    assert len({ep for w in weights for ep in placed[w]}) == 2  # spread over both pservers
    origin = Program.load(PADDLE_PROGRAMS / case / "startup.pb").global_block()
    for endpoint, (main, startup) in result.pservers.items():
        ops = startup.global_block().ops
        assert "coalesce_tensor" not in [op.type for op in ops]
        for weight in weights:
            if endpoint in placed[weight]:
                (init,) = [op for op in ops if weight in op.output_names]
                (want,) = [op for op in origin.ops if op.type == "uniform_random" and weight in op.output_names]
                assert init.type == "uniform_random" and init.attr("shape") == want.attr("shape")
    # The trainer keeps the original startup (the fused buffer is packed there), then receives.
    types = [op.type for op in result.trainer_startup.global_block().ops]
    assert "coalesce_tensor" in types and types.index("coalesce_tensor") < types.index("recv")


def test_a_coalesce_tensor_that_sets_a_constant_becomes_fill_constants(tmp_path):
    main, startup, info = load("lstm_sgd_2ps")
    (op,) = [op for op in startup.global_block().ops if op.type == "coalesce_tensor"]
    op.set_attr("copy_data", False)
    op.set_attr("set_constant", True)
    op.set_attr("constant", 0.25)
    result = transpile(main, startup, pservers=info["pservers"], trainers=2, verify=True)
    fills = {}
    for _, pserver_startup in result.pservers.values():
        for init in pserver_startup.global_block().ops:
            (out,) = init.output_names
            fills.setdefault(out, []).append((init.type, init.attr("value", None)))
    for weight in ("lstm_cell_0.w_0", "lstm_cell_0.w_1", "lstm_cell_0.b_0", "lstm_cell_0.b_1"):
        assert fills[weight] == [("uniform_random", None), ("fill_constant", 0.25)], weight


@pytest.mark.parametrize("case", TRAINED_CASES)
def test_cli_dump_plan_and_transpile(case, tmp_path, capsys):
    folder = PADDLE_PROGRAMS / case
    info = json.loads((folder / "case.json").read_text())
    assert cli_main(["dump", str(folder / "main.pb")]) == 0
    assert "forward_block=" in capsys.readouterr().out or case == "lstm_sgd_2ps"
    common = [str(folder / "main.pb"), "--startup", str(folder / "startup.pb"), "--pservers", info["pservers"],
              "--trainers", "2"]
    assert cli_main(["plan", *common]) == 0
    assert cli_main(["transpile", *common, "--float64", "-o", str(tmp_path)]) == 0
    trainer = Program.load(tmp_path / "trainer.pb")
    assert trainer.num_blocks == Program.load(folder / "main.pb").num_blocks  # the sub-blocks stay on the trainer
    assert check(trainer) == []
