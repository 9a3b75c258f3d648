"""Sync training on several processes equals local training.

2 trainers each on their own half of every batch (`Role.shard`), M pservers, 20 steps,
all processes on loopback under `transpiler.runtime.launch`; then the untranspiled program
trains locally on the whole batches from the params the trainers received (what the
pservers initialised), and every parameter must match.

The bound is relative to the parameter's scale, `|dist - local| <= 1e-5 * max|local|`,
not element by element. The two runs add the same numbers in different orders (a
mean over 16 rows vs the mean of two means over 8; the trainers' grads summed on the
pserver), so every element carries float32 rounding (~1e-7 of the parameter's
scale); an element that happens to be near zero then shows a large *relative*
difference however small the absolute one is (SGD: up to ~3e-2 on elements ~1e-7).
The local reference runs the same script in a process of its own with one BLAS thread,
as the launched processes do: a multi-threaded matmul adds in yet another order.
Adam adds its own amplification: it divides each grad element by its running RMS, so
a rounding difference on a grad element near zero (a sum of terms that nearly cancel)
becomes a difference of ~lr times that element's *relative* error — its updates are
scale-free — and the MLP's first layer shows ~4e-6 of its scale (1.5e-5 element-wise
even on elements above a tenth of the scale). The measured figures, per parameter,
are printed with `pytest -s` and listed in the runtime's report.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from e2e_support import EXAMPLES, STEPS, differences, launch_training, save, train_locally, trained_params

from conftest import PADDLE_PROGRAMS
from transpiler.ir import Program
from transpiler.ir.precision import as_float64

RTOL = 1e-5
sys.path.insert(0, str(EXAMPLES))


def built(name: str):
    if name == "seed_fc3":
        import seed_fc3

        return seed_fc3.build()
    if name == "mlp":
        import mlp

        return mlp.build()
    from test_listen_and_serv_programs import net

    return net("exponential")  # x[64] → fc 256 → fc 1, SGD(exponential_decay(0.05, 2, 0.5, staircase))


CASES = {
    # name: (programs, pservers)
    "seed_fc3 (SGD)": (lambda: built("seed_fc3"), 2),
    "mlp (Adam, sliced)": (lambda: built("mlp"), 2),
    "lr decay on the pservers": (lambda: built("lr_decay"), 2),
    "fixture seed_fc3_sgd_3ps": (lambda: _fixture("seed_fc3_sgd_3ps"), 3),
    "fixture mlp_adam_2ps": (lambda: _fixture("mlp_adam_2ps"), 2),
    "fixture fluid18_lr_exp_decay_2ps": (lambda: _fixture("fluid18_lr_exp_decay_2ps"), 2),
}


def _fixture(case: str):
    folder = PADDLE_PROGRAMS / case
    return Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")


@pytest.mark.parametrize("case", list(CASES))
def test_sync_training_equals_local_training(case, tmp_path):
    make, pservers = CASES[case]
    main, startup = make()
    main_pb, startup_pb = save(tmp_path, main, startup)
    launch_training(tmp_path, main_pb, startup_pb, pservers=pservers)
    for i in range(pservers):  # a step is one SendBatch and one FetchBatch per trainer (+ the startup fetch, the exit)
        log = (tmp_path / "logs" / f"pserver.{i}.log").read_text()
        assert f"2.10 rpc/step/trainer over {STEPS} steps (FetchBatch 42, SendBatch 40, SendComplete 2)" in log, log
    init0, final0 = trained_params(tmp_path, 0)
    init1, final1 = trained_params(tmp_path, 1)
    for name in init0:  # both trainers start and end with the pservers' values
        assert np.array_equal(init0[name], init1[name]) and np.array_equal(final0[name], final1[name]), name
    local = train_locally(tmp_path, main_pb, startup_pb)
    assert local.keys() == final0.keys() and local
    for name, (elementwise, scaled) in sorted(differences(final0, local).items()):
        print(f"{case}: {name}: max rel diff element-wise {elementwise:.2e}, of the scale {scaled:.2e}")
    for name in local:
        moved = np.abs(local[name] - init0[name]).max()
        assert moved > 0, f"{name} never changed: the comparison would prove nothing"
        scale = float(np.abs(local[name]).max())
        np.testing.assert_allclose(final0[name], local[name], rtol=RTOL, atol=RTOL * scale, err_msg=f"{case}: {name}")


@pytest.mark.parametrize("case", list(CASES))
def test_in_float64_every_element_matches_to_1e_5(case, tmp_path):
    """With float64 the summation-order rounding shrinks to ~1e-16, so plain element-wise
    rtol=1e-5 (no scale term) holds for every case: what differs in float32 is rounding,
    not the algorithm (lr decay and Paddle's own programs included)."""
    make, pservers = CASES[case]
    main, startup = (as_float64(p) for p in make())
    main_pb, startup_pb = save(tmp_path, main, startup)
    launch_training(tmp_path, main_pb, startup_pb, pservers=pservers)
    init0, final0 = trained_params(tmp_path, 0)
    local = train_locally(tmp_path, main_pb, startup_pb)
    assert local.keys() == final0.keys() and local
    for name, (elementwise, _) in sorted(differences(final0, local).items()):
        print(f"{case} (float64): {name}: max rel diff element-wise {elementwise:.2e}")
    for name in local:
        assert final0[name].dtype == np.float64 and np.abs(local[name] - init0[name]).max() > 0, name
        np.testing.assert_allclose(final0[name], local[name], rtol=RTOL, atol=0, err_msg=f"{case}: {name}")
