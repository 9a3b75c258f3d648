"""Distributed sync training equals local training where an update needs a norm or a
decoupled decay: AdamW, LAMB and LARS on Paddle 2.6-built MLPs over 3 pservers x 2
trainers, float64, element-wise (tests/fixtures/paddle_programs/mlp_*_3ps, made by
tools/make_paddle_fixtures.py).

AdamW is element-wise: its param fc_0.w_0 is cut into 3 blocks, one per pserver, and each
block's update is local training's. LARS and LAMB read the whole param's norm: the
transpiler keeps such a param whole on one pserver (`OptimizerSlots.whole_norm`), so the
norm it computes is the param's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from e2e_support import differences, launch_training, save, train_locally, trained_params

from conftest import PADDLE_PROGRAMS
from transpiler.api import as_float64, transpile
from transpiler.ir import Program

NORM_CASES = ["mlp_adamw_3ps", "mlp_lamb_3ps", "mlp_lars_3ps"]


def load(case: str) -> tuple[Program, Program, dict]:
    folder = PADDLE_PROGRAMS / case
    return (Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"),
            json.loads((folder / "case.json").read_text()))


def plan_of(case: str):
    main, startup, info = load(case)
    return transpile(main, startup, pservers=info["pservers"], trainers=info["trainers"], trainer_id=0).plan


def test_adamw_slices_its_weight_and_lars_lamb_keep_theirs_whole():
    assert len(plan_of("mlp_adamw_3ps").param("fc_0.w_0").blocks) == 3
    for case in ("mlp_lamb_3ps", "mlp_lars_3ps"):
        plan = plan_of(case)
        assert len(plan.param("fc_0.w_0").blocks) == 1, case
        # every pserver still gets work: the whole params are dealt round robin
        assert len({ep for p in plan.params for ep in p.endpoints}) == 3, case


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
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"{case} (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert final0[name].dtype == np.float64, name
        assert np.array_equal(final0[name], final1[name]), name
        assert np.abs(local[name] - init0[name]).max() > 0, f"{name} never changed: the comparison would prove nothing"
        np.testing.assert_allclose(final0[name], local[name], rtol=1e-9, atol=0, err_msg=f"{case}: {name}")
