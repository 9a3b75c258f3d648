"""Sync training of Paddle-built transformers on 3 pservers x 2 trainers equals local training.

The fixtures are Paddle 2.6's own programs (tools/make_paddle_fixtures.py): a small
BERT-style encoder (`bert_small_adam_3ps_sync`, the BERT-base code at 2 layers, hidden 64)
and a GPT-2-style decoder (`gpt_adam_3ps_sync`: range / tril_triu / unsqueeze2 causal mask,
tied LM head), both with dropout 0.1 on, Adam, every param sliced over the 3 pservers by
our transpiler. Trained in float64 (`as_float64`) for STEPS steps at a global batch of
BATCH (each trainer BATCH / 2 rows, `Role.shard`), then the untranspiled program trains
locally on the whole batches from the params trainer 0 received, and every parameter must
match element by element: rtol RTOL, plus ATOL = 1e-12 absolute for one reason: the
attention's key-projection bias (`linear_1.b_0`, ...) has a grad that is exactly zero in
exact arithmetic (adding q.b_k to every score of a row leaves its softmax unchanged), so
its values are rounding noise (~1e-13) that Adam's scale-free update moves around; every
other element carries signal and meets the relative bound alone.

Dropout is what makes this a real test: its mask is drawn per element from the op's
per-step key and the element's index in the *global* batch (ops/kernels/transformer.py,
`BATCH_SHARD`), so the two trainers draw between them the mask local training draws. With
masks drawn per process instead, the params would differ at the 1e-3 level after a step.

BERT-base itself (`bert_adam_*`, 110M params) is not trained in float64: its params, Adam
moments and grads are ~3.5 GB per process copy, and a step at batch 2 x seq 128 takes
seconds per trainer on this 2-core machine shared by others; the small encoder has the same
op types (its program is the same Python code with smaller sizes). In float32 it is, on
request (`PSTRANSPILE_BERT_BASE=1`: ~2.5 min, ~12 GB): 3 pservers x 2 trainers, 2 steps at
batch 2, against local training and the permuted-batch rounding control of
test_e2e_sync.py (every param within CONTROL_FACTOR x the control; measured: at most 1.32x,
the zero-grad key biases moving ~100% of their scale in both runs, the weights 2.0e-3 of
their scale against a control of 2.4e-2).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from e2e_support import EXAMPLES, ONE_THREAD, REPO, launch_ok

from conftest import PADDLE_PROGRAMS
from transpiler.ir import Program
from transpiler.ir.precision import as_float64

STEPS, BATCH, PSERVERS, TRAINERS = 3, 4, 3, 2
CONTROL_FACTOR, ULPS = 4.0, 2e-7  # test_e2e_sync.py's float32 criterion
RTOL, ATOL = 1e-9, 1e-12
CASES = ["bert_small_adam_3ps_sync", "gpt_adam_3ps_sync"]


def _command(main_pb, startup_pb, save, *extra: str, steps: int = STEPS, batch: int = BATCH) -> list[str]:
    return [sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
            "--loss", "mean_0.tmp_0", "--steps", str(steps), "--batch", str(batch), "--seed", "0", "--save", str(save),
            *extra]


def _local(command: list[str], out) -> dict[str, np.ndarray]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_ROLE", "PADDLE_"))}
    env.update(ONE_THREAD, PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with np.load(out / "local.npz") as saved:
        return {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}


@pytest.mark.parametrize("case", CASES)
def test_sync_training_equals_local_training_float64(case, tmp_path):
    folder = PADDLE_PROGRAMS / case
    main, startup = (as_float64(Program.load(folder / f)) for f in ("main.pb", "startup.pb"))
    assert any(op.type == "dropout" and op.attr("dropout_prob") > 0 for op in main.global_block().ops)
    main.save(tmp_path / "main.pb")
    startup.save(tmp_path / "startup.pb")
    main_pb, startup_pb = tmp_path / "main.pb", tmp_path / "startup.pb"

    launch_ok(tmp_path, tuple(_command(main_pb, startup_pb, tmp_path / "params")), pservers=PSERVERS, trainers=TRAINERS,
              sync_mode=True, timeout=120.0)
    saved = [np.load(tmp_path / "params" / f"trainer_{i}.npz") for i in range(TRAINERS)]
    final = {k[len("final/"):]: saved[0][k] for k in saved[0].files if k.startswith("final/")}
    initial = {k[len("init/"):]: saved[0][k] for k in saved[0].files if k.startswith("init/")}
    for name in final:  # both trainers end with the pservers' values
        assert np.array_equal(final[name], saved[1][f"final/{name}"]), name

    local = _local(_command(main_pb, startup_pb, tmp_path / "local", "--init", str(tmp_path / "params" / "trainer_0.npz")),
                   tmp_path / "local")

    assert local.keys() == final.keys() and len(local) > 10
    worst = 0.0
    for name in sorted(local):
        assert final[name].dtype == np.float64, name
        assert np.abs(local[name] - initial[name]).max() > 0, f"{name} never changed: the comparison would prove nothing"
        diff = np.abs(final[name] - local[name])
        signal = np.abs(local[name]) > 1e-10  # (not the zero-grad biases' rounding noise)
        if signal.any():
            worst = max(worst, float((diff[signal] / np.abs(local[name][signal])).max()))
        np.testing.assert_allclose(final[name], local[name], rtol=RTOL, atol=ATOL, err_msg=f"{case}: {name}")
    print(f"{case}: {len(local)} params over {PSERVERS} pservers x {TRAINERS} trainers, {STEPS} steps at batch "
          f"{BATCH}: max element-wise relative difference dist vs local {worst:.2e}")


@pytest.mark.skipif(os.environ.get("PSTRANSPILE_BERT_BASE") != "1",
                    reason="BERT-base on 3 x 2 takes ~2.5 min and ~12 GB: set PSTRANSPILE_BERT_BASE=1")
def test_bert_base_sync_training_equals_local_training_float32(tmp_path):
    from e2e_support import scaled_difference

    folder = PADDLE_PROGRAMS / "bert_adam_2ps_noslice_sync"
    main_pb, startup_pb = folder / "main.pb", folder / "startup.pb"
    steps, batch = 2, 2
    launch_ok(tmp_path, tuple(_command(main_pb, startup_pb, tmp_path / "params", steps=steps, batch=batch)),
              pservers=PSERVERS, trainers=TRAINERS, sync_mode=True, timeout=900.0)
    with np.load(tmp_path / "params" / "trainer_0.npz") as saved:
        final = {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}
    init = ("--init", str(tmp_path / "params" / "trainer_0.npz"))
    local = _local(_command(main_pb, startup_pb, tmp_path / "local", *init, steps=steps, batch=batch), tmp_path / "local")
    permuted = _local(_command(main_pb, startup_pb, tmp_path / "permuted", *init, "--permute", steps=steps, batch=batch),
                      tmp_path / "permuted")
    assert local.keys() == final.keys() and len(local) == 200
    for name in sorted(local):
        dist, control = scaled_difference(final[name], local[name]), scaled_difference(permuted[name], local[name])
        print(f"bert_base: {name}: dist vs local {dist:.2e} of the scale, permuted-batch control {control:.2e}")
        assert dist <= CONTROL_FACTOR * control + ULPS, f"{name}: {dist:.2e} against a control of {control:.2e}"
