"""Distributed sync training equals local training where an update needs a norm or a
decoupled decay: AdamW, LAMB and LARS on Paddle 2.6-built MLPs over 3 pservers x 2
trainers, float64, element-wise (tests/fixtures/paddle_programs/mlp_*_3ps, made by
tools/make_paddle_fixtures.py).

AdamW is element-wise: its param fc_0.w_0 is cut into 3 blocks, one per pserver, and each
block's update is local training's. LARS and LAMB read the whole param's norms: cut into
3 blocks too, the 3 pservers sum [|p|^2, |g|^2] (LARS) or [|p|^2, |r|^2] (LAMB, r its
update direction) of their blocks among themselves each step (pserver_allreduce_sum). In
async mode there is no such sum: the param is kept whole on one pserver."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from e2e_support import BATCH, SEED, STEPS, differences, launch_training, save, train_locally, trained_params

from conftest import PADDLE_PROGRAMS, TESTS
from ops.executor import Executor
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.api import as_float64, transpile
from transpiler.ir import Program

sys.path.insert(0, str(TESTS.parent / "examples"))
from train_program import synthetic_batch  # noqa: E402

NORM_CASES = ["mlp_adamw_3ps", "mlp_lamb_3ps", "mlp_lars_3ps", "mlp_lars_l2_3ps", "mlp_lars_clip_value_3ps"]


def load(case: str) -> tuple[Program, Program, dict]:
    folder = PADDLE_PROGRAMS / case
    return (Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"),
            json.loads((folder / "case.json").read_text()))


def exchange_lines(tmp_path) -> list[str]:
    """The pservers' exit lines about their cross-pserver sums: one sum per step each."""
    lines = [line for log in sorted((tmp_path / "logs").glob("*")) if log.is_file()
             for line in log.read_text(errors="replace").splitlines() if "cross-pserver sum(s)" in line]
    assert all(f": {STEPS} cross-pserver sum(s)" in line for line in lines), lines
    return lines


def plan_of(case: str, **options):
    main, startup, info = load(case)
    return transpile(main, startup, pservers=info["pservers"], trainers=info["trainers"], trainer_id=0,
                     **options).plan



def exact_and_local(tmp_path, main, startup, info, pservers):
    """Train `main` on `pservers` pservers x 2 trainers with clip_mode exact, then locally: trainer 0's
    initial and final params, trainer 1's final params, and local training's final params."""
    main_pb, startup_pb = save(tmp_path, main, startup)
    launch_training(tmp_path, main_pb, startup_pb, pservers=pservers, trainers=2, loss=info["loss"],
                    extra=("--clip-mode", "exact"))
    init0, final0 = trained_params(tmp_path, 0)
    _, final1 = trained_params(tmp_path, 1)
    return init0, final0, final1, train_locally(tmp_path, main_pb, startup_pb, loss=info["loss"])

def test_adamw_lars_and_lamb_slice_their_weight_in_sync_mode():
    for case in NORM_CASES[:-1]:  # not mlp_lars_clip_value_3ps (kept whole, below)
        assert len(plan_of(case).param("fc_0.w_0").blocks) == 3, case
    # async: no sum across the pservers, kept whole
    for case in ("mlp_lars_3ps", "mlp_lamb_3ps", "mlp_lars_l2_3ps", "mlp_lars_clip_value_3ps"):
        plan = plan_of(case, sync_mode=False)
        assert len(plan.param("fc_0.w_0").blocks) == 1, case
        assert len({ep for p in plan.params for ep in p.endpoints}) == 3  # whole params dealt round robin


def test_l2_decay_ahead_of_a_sliced_lars_runs_before_the_norms():
    """LARS with L2 decay (`scale` + `sum` ahead of each `lars_momentum`): fc_0.w_0 is cut
    in 3 all the same, and each pserver's first optimize block decays its grad block before
    summing its squares, so the norms are of the decayed grad, as local training's. With a
    by-value clip ahead instead (it writes a new var), the param is kept whole."""
    main, startup, info = load("mlp_lars_l2_3ps")
    result = transpile(main, startup, pservers=info["pservers"], trainers=2)
    assert len(result.plan.param("fc_0.w_0").blocks) == 3
    for endpoint, (ps_main, _) in result.pservers.items():
        listen = ps_main.global_block().ops[0]
        first = ps_main.block(int(listen.attr("optimize_blocks")[0]))
        types = [op.type for op in first.ops]
        decay = next(i for i, op in enumerate(first.ops)
                     if op.type == "scale" and op.input("X")[0].startswith("fc_0.w_0.block"))
        assert types[decay + 1] == "sum" and types.index("squared_l2_norm") > decay + 1, (endpoint, types)
        assert types[-1] == "pserver_allreduce_sum", endpoint
    assert len(plan_of("mlp_lars_clip_value_3ps").param("fc_0.w_0").blocks) == 1


def test_the_adamw_fixture_decays_weights_only():
    main, _, _ = load("mlp_adamw_3ps")
    decay = {op.input("Param")[0]: op.attr("with_decay") for op in main.global_block().ops if op.type == "adamw"}
    assert decay == {"fc_0.w_0": True, "fc_1.w_0": True, "fc_0.b_0": False, "fc_1.b_0": False}


@pytest.mark.parametrize("case", NORM_CASES)
def test_distributed_training_equals_local_training_in_float64(case, tmp_path):
    main, startup, info = load(case)
    main_pb, startup_pb = save(tmp_path, as_float64(main), as_float64(startup))
    launch_training(tmp_path, main_pb, startup_pb, pservers=3, trainers=2, loss=info["loss"])
    init0, final0 = trained_params(tmp_path, 0)
    _, final1 = trained_params(tmp_path, 1)
    local = train_locally(tmp_path, main_pb, startup_pb, loss=info["loss"])
    assert local.keys() == final0.keys() == final1.keys() and local
    # each of the 3 pservers summed fc_0.w_0's norms with the other two, every step (AdamW
    # needs no norm; LARS after a by-value clip keeps fc_0.w_0 whole on one pserver)
    if case not in ("mlp_adamw_3ps", "mlp_lars_clip_value_3ps"):
        assert len(exchange_lines(tmp_path)) == 3
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"{case} (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert final0[name].dtype == np.float64, name
        assert np.array_equal(final0[name], final1[name]), name
        assert np.abs(local[name] - init0[name]).max() > 0, f"{name} never changed: the comparison would prove nothing"
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=f"{case}: {name}")


# ------------------------------------------------------------------ clips on the pserver


def local_values(main: Program, startup: Program, init: dict[str, np.ndarray], fetch: list[str]) -> list[list]:
    """`fetch` at each of local training's steps (the e2e run's batches, from `init`)."""
    scope = Scope()
    exe = Executor(seed=0)
    exe.run(startup, scope=scope)
    for name, value in init.items():
        scope.set_var(name, LoDTensor(np.array(value)))
    out = []
    for k in range(STEPS):
        out.append([np.asarray(v) for v in exe.run(main, feed=synthetic_batch(main, BATCH, SEED, k),
                                                     fetch_list=fetch, scope=scope)])
    return out


def test_clip_by_value_on_the_averaged_grad_equals_local_training_in_float64(tmp_path):
    """clip_mode="exact": the `clip` ops run on the pservers after the grads are averaged
    (fc_0.w_0 in 3 blocks on 3 pservers); every step some elements of both weights' grads
    are clipped (of the biases', at some steps), and the result is local training's."""
    main, startup, info = load("mlp_clip_value_sgd_3ps")
    main, startup = as_float64(main), as_float64(startup)
    result = transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="exact")
    assert "clip" not in [op.type for op in result.trainer.global_block().ops]
    assert len(result.plan.param("fc_0.w_0").blocks) == 3
    pserver_ops = [op.type for main_ps, _ in result.pservers.values() for b in main_ps.blocks for op in b.ops]
    assert pserver_ops.count("clip") == 3 + 3  # fc_0.w_0's three blocks and the three other params
    init0, final0, final1, local = exact_and_local(tmp_path, main, startup, info, pservers=3)
    grads = [f"{name}@GRAD" for name in sorted(local)]
    bites = dict.fromkeys(grads, 0)
    for values in local_values(main, startup, init0, grads):
        for name, grad in zip(grads, values):
            bites[name] += bool(np.abs(grad).max() > 0.001)
    print(f"steps (of {STEPS}) where the clip bites: {bites}")
    assert bites["fc_0.w_0@GRAD"] == bites["fc_1.w_0@GRAD"] == STEPS
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"clip_value exact (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert np.array_equal(final0[name], final1[name]), name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=name)
    # The control: clipped on each trainer (clip_mode="trainer", Paddle 1.8's way), the same
    # job does not train to local training's params.
    main_pb, startup_pb = save(tmp_path, main, startup)  # the files exact_and_local trained on
    launch_training(tmp_path / "trainer", main_pb, startup_pb, pservers=3, trainers=2, loss=info["loss"],
                    extra=("--clip-mode", "trainer"))
    _, per_trainer = trained_params(tmp_path / "trainer", 0)
    worst = max(scaled for _, scaled in differences(per_trainer, local).values())
    print(f"clip_value trainer (float64): max |difference| / max |local| {worst:.2e}")
    assert worst > 1e-4


# ------------------------------------------------------------------ what clip_mode refuses


def test_clip_mode_defaults_and_refusals():
    from transpiler.config import DistributeTranspilerConfig
    from transpiler.errors import TranspileError

    main, startup, info = load("mlp_clip_global_sgd_3ps")
    exact = transpile(main, startup, pservers=info["pservers"], trainers=2)  # the default in sync mode
    assert "squared_l2_norm" not in [op.type for op in exact.trainer.global_block().ops]
    trainer_mode = transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="trainer")
    assert "squared_l2_norm" in [op.type for op in trainer_mode.trainer.global_block().ops]
    assert all("pserver_allreduce_sum" not in [op.type for b in ps.blocks for op in b.ops]
               for ps, _ in trainer_mode.pservers.values())
    with pytest.raises(TranspileError, match="needs sync mode"):
        transpile(main, startup, pservers=info["pservers"], trainers=2, sync_mode=False, clip_mode="exact")
    async_default = transpile(main, startup, pservers=info["pservers"], trainers=2, sync_mode=False)
    assert "squared_l2_norm" in [op.type for op in async_default.trainer.global_block().ops]  # async: per trainer
    with pytest.raises(TranspileError, match="clip_mode must be one of trainer, exact"):
        transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="pserver")
    main, startup, info = load("mlp_clip_value_sgd_3ps")
    config = DistributeTranspilerConfig()
    config.clip_mode = "exact"
    result = transpile(main, startup, pservers=info["pservers"], trainers=2, config=config)
    assert "clip" not in [op.type for op in result.trainer.global_block().ops]


def test_cli_clip_mode(tmp_path, capsys):
    from transpiler.cli import main as cli_main

    folder = PADDLE_PROGRAMS / "mlp_clip_global_sgd_3ps"
    pservers = "127.0.0.1:6170,127.0.0.1:6171,127.0.0.1:6172"
    assert cli_main(["transpile", str(folder / "main.pb"), "--pservers", pservers, "--trainers", "2",
                     "--clip-mode", "exact", "-o", str(tmp_path / "out"), "-q"]) == 0
    trainer = Program.load(tmp_path / "out" / "trainer.pb")
    assert "squared_l2_norm" not in [op.type for op in trainer.global_block().ops]
    capsys.readouterr()
    assert cli_main(["dump", str(tmp_path / "out" / "pserver_127.0.0.1_6171.pb")]) == 0
    assert "pserver_allreduce_sum X=[clip_global_norm_0@PARTIAL]" in capsys.readouterr().out
    assert cli_main(["plan", str(folder / "main.pb"), "--pservers", pservers, "--trainers", "2", "--async",
                     "--clip-mode", "exact"]) == 2
    assert "needs sync mode" in capsys.readouterr().err


# ------------------------------------------------------------------ the global norm across pservers


def test_global_norm_clip_across_pservers_equals_local_training_in_float64(tmp_path):
    """ClipGradByGlobalNorm(0.01), clip_mode="exact", fc_0.w_0 in 3 blocks on 3 pservers:
    the trainers send unclipped grads; each pserver averages, sums the squares of its
    blocks, exchanges the partial sum with the other two (pserver_allreduce_sum) and
    scales by the exact global norm. The norm is above 0.01 at every step (the clip
    bites), and the result is local training's; clipped per trainer, it is not."""
    main, startup, info = load("mlp_clip_global_sgd_3ps")
    main, startup = as_float64(main), as_float64(startup)
    result = transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="exact")
    trainer_ops = [op.type for op in result.trainer.global_block().ops]
    assert "squared_l2_norm" not in trainer_ops and "elementwise_mul" not in trainer_ops
    for endpoint, (ps_main, _) in result.pservers.items():
        listen = ps_main.global_block().ops[0]
        first = ps_main.block(int(listen.attr("optimize_blocks")[0]))
        assert "pserver_allreduce_sum" in [op.type for op in first.ops], endpoint  # run first, every round
    init0, final0, final1, local = exact_and_local(tmp_path, main, startup, info, pservers=3)
    costs = exchange_lines(tmp_path)
    print("\n".join(costs))
    assert len(costs) == 3
    norms = [float(values[0].reshape(-1)[0]) for values in local_values(main, startup, init0, ["sqrt_0.tmp_0"])]
    print(f"global norms (clip 0.01) over {STEPS} steps: min {min(norms):.3g}, max {max(norms):.3g}")
    assert min(norms) > 0.01
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"global norm exact (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert np.array_equal(final0[name], final1[name]), name
        assert np.abs(local[name] - init0[name]).max() > 0, name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=name)


def test_a_pserver_lost_mid_run_fails_the_exchange_quickly(tmp_path):
    """Pserver 1 SIGKILLed before step 5 of the global-norm job: the job fails within
    seconds (no pserver waits forever for its partial sum); where the exchange saw it
    first, the error names the op and the peer."""
    import time

    from transpiler.runtime.launch import LaunchConfig, launch

    folder = PADDLE_PROGRAMS / "mlp_clip_global_sgd_3ps"
    info = json.loads((folder / "case.json").read_text())
    command = (sys.executable, str(TESTS.parent / "examples" / "train_program.py"), "--main", str(folder / "main.pb"),
               "--startup", str(folder / "startup.pb"), "--loss", info["loss"], "--steps", "50",
               "--clip-mode", "exact", "--kill-at-step", "5", "--kill", "pserver:1", "--pid-dir", str(tmp_path / "pids"))
    config = LaunchConfig(command=command, pservers=3, trainers=2, sync_mode=True, env={"OPENBLAS_NUM_THREADS": "1"},
                          log_dir=tmp_path / "logs", rpc_timeout=10.0, status_every=600.0, exit_grace=10.0)
    start = time.monotonic()
    with open(tmp_path / "launch.txt", "w") as out:
        result = launch(config, out=out)
    elapsed = time.monotonic() - start
    assert not result.ok and "pserver.1" in str(result.failure)
    assert elapsed < 60, elapsed
    seen = [line for log in sorted((tmp_path / "logs").glob("*")) if log.is_file()
            for line in log.read_text(errors="replace").splitlines() if "partial sum" in line]
    print(f"failed after {elapsed:.1f} s: {result.failure}\n" + "\n".join(line[:300] for line in seen))
    assert all("pserver_allreduce_sum" in line or "peer pserver" in line for line in seen)


def test_fluid18_clip_by_norm_on_the_averaged_grad_equals_local_training_in_float64(tmp_path):
    """Fluid 1.8.5's set_gradient_clip(GradientClipByNorm(0.01)) with L2 decay, clip_mode
    "exact": each `clip_by_norm` runs on the pserver after averaging; fc_0.w_0 stays cut in
    2 blocks, the two pservers sum |g block|^2 to clip by the whole grad's norm; the norm is
    above 0.01 at every step for both weights (the biases' at some steps: the clip bites),
    and the result is local training's."""
    main, startup, info = load("fluid18_clip_norm_momentum_2ps")
    main, startup = as_float64(main), as_float64(startup)
    exact = transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="exact")
    assert len(exact.plan.param("fc_0.w_0").blocks) == 2
    assert "clip_by_norm" not in [op.type for op in exact.trainer.global_block().ops]
    init0, final0, final1, local = exact_and_local(tmp_path, main, startup, info, pservers=2)
    assert len(exchange_lines(tmp_path)) == 2  # both pservers summed fc_0.w_0's |g|^2, every step
    grads = [f"{name}@GRAD" for name in sorted(local)]
    bites = dict.fromkeys(grads, 0)
    for values in local_values(main, startup, init0, grads):
        for name, grad in zip(grads, values):
            bites[name] += bool(np.sqrt(np.sum(grad * grad)) > 0.01)
    print(f"steps (of {STEPS}) where the clip bites: {bites}")
    assert bites["fc_0.w_0@GRAD"] == bites["fc_1.w_0@GRAD"] == STEPS
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"fluid18 clip_by_norm exact (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert np.array_equal(final0[name], final1[name]), name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=name)


def test_two_global_norm_groups_across_pservers_equal_local_training_in_float64(tmp_path):
    """Two ClipGradByGlobalNorm groups (two SGDs, each with its own grad_clip, Paddle 2.6):
    fc_0's grads clipped by their norm at 0.01, fc_1's by theirs at 0.005, fc_0.w_0 in 3
    blocks on 3 pservers. Each pserver exchanges one partial sum per group (both groups on
    all 3, a zero where it holds none of a group's grads) and scales each group's grads by
    that group's exact norm. Both norms are above their clip at every step (both clips
    bite), and the result is local training's."""
    main, startup, info = load("mlp_clip_two_groups_sgd_3ps")
    main, startup = as_float64(main), as_float64(startup)
    result = transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="exact")
    trainer_ops = [op.type for op in result.trainer.global_block().ops]
    assert "squared_l2_norm" not in trainer_ops and "elementwise_mul" not in trainer_ops
    assert len(result.plan.param("fc_0.w_0").blocks) == 3
    for endpoint, (ps_main, _) in result.pservers.items():
        reduced = [op.input("X")[0] for b in ps_main.blocks for op in b.ops if op.type == "pserver_allreduce_sum"]
        assert reduced == ["clip_global_norm_0@PARTIAL", "clip_global_norm_1@PARTIAL"], endpoint
    clip_norms = {op.attr("str_value") for ps_main, _ in result.pservers.values() for b in ps_main.blocks
                        for op in b.ops if op.type == "fill_constant" and "@CLIP_NORM" in op.output("Out")[0]}
    assert clip_norms == {"0.005", "0.01"}
    init0, final0, final1, local = exact_and_local(tmp_path, main, startup, info, pservers=3)
    lines = [line for log in sorted((tmp_path / "logs").glob("*")) if log.is_file()
             for line in log.read_text(errors="replace").splitlines() if "cross-pserver sum(s)" in line]
    assert len(lines) == 3 and all(f": {2 * STEPS} cross-pserver sum(s)" in line for line in lines), lines
    norms = local_values(main, startup, init0, ["sqrt_0.tmp_0", "sqrt_1.tmp_0"])
    hidden = [float(v[0].reshape(-1)[0]) for v in norms]
    output = [float(v[1].reshape(-1)[0]) for v in norms]
    print(f"group norms over {STEPS} steps: hidden (clip 0.01) min {min(hidden):.3g}, "
          f"output (clip 0.005) min {min(output):.3g}")
    assert min(hidden) > 0.01 and min(output) > 0.005
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"two global-norm groups exact (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert np.array_equal(final0[name], final1[name]), name
        assert np.abs(local[name] - init0[name]).max() > 0, name
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=name)


def test_a_factor_scaling_grads_it_is_not_the_norm_of_is_refused():
    """The shape Paddle's append_gradient_clip_ops gives groups set by set_gradient_clip
    (every grad scaled by the last group's factor, the norm of that group's grads only):
    not a global-norm clip the pservers can compute, so refused, naming the grads."""
    from transpiler.errors import TranspileError

    main, startup, info = load("mlp_clip_two_groups_sgd_3ps")
    factors = [op.input("Y")[0] for op in main.global_block().ops if op.type == "elementwise_mul"]
    for op in main.global_block().ops:
        if op.type == "elementwise_mul":
            op.set_input("Y", [factors[-1]])
    with pytest.raises(TranspileError, match=r"is the norm of \['fc_1\.b_0@GRAD', 'fc_1\.w_0@GRAD'\] but scales"):
        transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="exact")
    assert transpile(main, startup, pservers=info["pservers"], trainers=2, clip_mode="trainer").trainer is not None
