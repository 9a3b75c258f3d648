"""Per-pserver checkpoint dirs that only their own pserver can read (`ops.rpc.own_dirs`):
a StatefulSet with a volume per pserver.

Every process of the job runs under `tests/isolation_support.py`: its own mount
namespace, with an empty read-only tmpfs over every checkpoint dir of the template but its
own (pserver i: `disk<i>`; trainer 0: `diskjob`, its scratch dir; trainer 1: none). A
read of another process's dir finds nothing, a write fails. Under that, on Paddle-built
fixtures in float64, a job checkpoints, is killed (kill -9), restarts (`launch
--max-restarts`), and a job restored by hand (`--restore` the template: `Session(restore=)`,
the pservers' `serve_program(restore=)`) after trainer 0 died between two pservers'
commits: every final param and optimizer state is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from isolation_support import available
from recovery_support import BY_NAME, differing, final_state, log_of, run_job, trainer_finals

REPO = Path(__file__).resolve().parents[1]
WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no mount namespaces here: {WHY_NOT}")
STEPS, EVERY = 6, 2


def isolated(template: Path, pservers: int) -> tuple[str, ...]:
    return (sys.executable, str(REPO / "tests" / "isolation_support.py"), "--template", str(template),
            "--pservers", str(pservers), "--")


def logs(out: Path) -> list[Path]:
    return sorted((out / "logs").rglob("*.log"))


def assert_isolated(out: Path, template: Path, processes: int) -> None:
    """Every process of every attempt said, before it started, that it saw only its own dir."""
    seen = [line for log in logs(out) for line in log.read_text().splitlines() if line.startswith("isolation: ")]
    assert len(seen) == processes, seen
    assert all("other dir(s) hidden" in line for line in seen)
    for i in range(2):
        assert any(f"pserver sees only {str(template).replace('{pserver}', str(i))};" in line for line in seen)


@pytest.mark.parametrize(("case", "victim"), [("mlp_adam_2ps", "pserver:1"), ("ctr_v1_dist_sgd_2ps", "pserver:0")])
def test_isolated_pservers_checkpoint_and_recover_from_a_kill_bit_identical(tmp_path, case, victim):
    fixture = BY_NAME[case]
    reference = run_job(fixture, tmp_path / "reference", STEPS, EVERY, float64=True)
    assert reference.ok, log_of(reference, tmp_path / "reference")
    template = tmp_path / "disk{pserver}" / "ckpt"
    out = tmp_path / "killed"
    killed = run_job(fixture, out, STEPS, EVERY, "--chaos", f"3:{victim}", "--pid-dir", str(tmp_path / "pids"),
                     float64=True, max_restarts=1, checkpoint_dir=template, wrap=isolated(template, fixture.pservers))
    assert killed.ok and len(killed.restarts) == 1, log_of(killed, out)
    assert "SIGKILL" in killed.restarts[0]
    assert_isolated(out, template, 2 * (fixture.pservers + fixture.trainers))
    for i in range(fixture.pservers):  # the restart restored each pserver from its own part, agreed over RPC
        text = (out / "logs" / "restart-1" / f"pserver.{i}.log").read_text()
        assert "restored" in text and "from ckpt-2 in its own dir" in text and "agreed with trainer 0" in text, text
        own = tmp_path / f"disk{i}" / "ckpt" / "ckpt-6"
        assert (own / f"ps{i}" / "PART.json").is_file() and (own / "MANIFEST.json").is_file()
        assert sorted(p.name for p in own.iterdir()) == ["MANIFEST.json", f"ps{i}"]  # no other part in a pserver's dir
    step, want = final_state(tmp_path / "reference" / "ckpt")
    again, got = final_state(template)  # read here, by a process that sees every dir (the job manifest's locations)
    assert step == again == STEPS and want
    assert not differing(want, got), differing(want, got)
    assert {a.dtype.name for a in want.values() if a.dtype.kind == "f"} == {"float64"}
    assert not differing(trainer_finals(tmp_path / "reference"), trainer_finals(out))


def test_a_restore_by_hand_agrees_the_step_after_trainer_0_died_between_two_commits(tmp_path):
    """Trainer 0 died after pserver 0 kept ckpt-4's manifest copy and before pserver 1 did
    (and before its own job manifest): the pservers alone know ckpt-4 is complete. A job
    started by hand with `--restore` the template agrees ckpt-4 over RPC (pserver 1 then
    keeps the copy too) and ends bit-identical to an uninterrupted run."""
    fixture = BY_NAME["mlp_adam_2ps"]
    reference = run_job(fixture, tmp_path / "reference", STEPS, EVERY, float64=True)
    assert reference.ok, log_of(reference, tmp_path / "reference")
    template = tmp_path / "disk{pserver}" / "ckpt"
    wrap = isolated(template, 2)
    first = run_job(fixture, tmp_path / "first", 4, EVERY, float64=True, checkpoint_dir=template, wrap=wrap)
    assert first.ok, log_of(first, tmp_path / "first")
    (tmp_path / "disk1" / "ckpt" / "ckpt-4" / "MANIFEST.json").unlink()  # as trainer 0's death left them
    (tmp_path / "disk1" / "ckpt" / "latest").write_text("ckpt-2\n")
    shutil.rmtree(tmp_path / "diskjob")
    resumed = run_job(fixture, tmp_path / "resumed", STEPS, EVERY, "--restore", str(template), float64=True,
                      checkpoint_dir=template, wrap=wrap)
    assert resumed.ok, log_of(resumed, tmp_path / "resumed")
    assert_isolated(tmp_path / "resumed", template, 4)
    for i in range(2):
        assert "from ckpt-4 in its own dir" in (tmp_path / "resumed" / "logs" / f"pserver.{i}.log").read_text()
    copies = [json.loads((tmp_path / f"disk{i}" / "ckpt" / "ckpt-4" / "MANIFEST.json").read_text()) for i in range(2)]
    assert copies[0] == copies[1] and copies[0]["step"] == 4
    step, want = final_state(tmp_path / "reference" / "ckpt")
    again, got = final_state(template)
    assert step == again == STEPS and not differing(want, got), differing(want, got)
    assert not differing(trainer_finals(tmp_path / "reference"), trainer_finals(tmp_path / "resumed"))
    # The isolation is real: in pserver 0's view its own dir's copy of the manifest names
    # pserver 1's part, which is hidden from it, so a fetch fails; this process, seeing every
    # dir, fetches the same checkpoint.
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ENDPOINTS": "a:1,b:2",
           "PADDLE_CURRENT_ENDPOINT": "a:1"}
    fetch = [sys.executable, "-m", "transpiler", "fetch", "--full", "--checkpoint", str(tmp_path / "disk0" / "ckpt"), "-o"]
    seen_by_ps0 = subprocess.run([*wrap, *fetch, str(tmp_path / "ps0_fetch")], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
    assert seen_by_ps0.returncode == 2 and "isolation: pserver sees only" in seen_by_ps0.stderr, seen_by_ps0.stderr
    assert ": part ps1 is " in seen_by_ps0.stderr, seen_by_ps0.stderr  # neither at its location nor gathered
    whole = subprocess.run([*fetch, str(tmp_path / "fetched")], env=env, capture_output=True, text=True, timeout=120,
                           check=False)
    assert whole.returncode == 0, whole.stderr
