"""Chaos: seeded kill -9 of pservers AND trainers, twice in one job, some during a
checkpoint's write, on Paddle-built programs (float64), restarted by `launch
--max-restarts` from the newest complete checkpoint each time. Every run must end with
every param and every optimizer accumulator, learning rate and table row bit-identical
to an uninterrupted run (the final checkpoints compared var by var). Programs with a
distributed table run one trainer (with two, which preallocated row an id gets depends
on the order the trainers' prefetches arrive).

Each run: one pserver and one trainer killed at two steps, one of the kills 0-30 ms into
a checkpoint's write. Runs: `PSTRANSPILE_CHAOS_RUNS` (default 2, round-robin over `CHAOS_FIXTURES`), seed
`PSTRANSPILE_CHAOS_SEED` (default 23); `pytest -s` prints each run. docs/recovery.md
records a long run's figures. `PSTRANSPILE_CHAOS_OWN_DIRS=1`: every job checkpoints into
per-pserver dirs (`disk{pserver}/ckpt`) and every process runs seeing only its own
(`tests/isolation_support.py`; skipped where mount namespaces are not available).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from isolation_support import available, prefix
from recovery_support import (
    BY_NAME,
    CHAOS_FIXTURES,
    ChaosRun,
    differing,
    draw_kills,
    final_state,
    landed_mid_checkpoint,
    log_of,
    reference_run,
    restart_origins,
    run_job,
)

STEPS, EVERY = 6, 2


def test_seeded_kills_of_pservers_and_trainers_recover_bit_identical(tmp_path, tmp_path_factory):
    runs = int(os.environ.get("PSTRANSPILE_CHAOS_RUNS", "2"))
    own_dirs = os.environ.get("PSTRANSPILE_CHAOS_OWN_DIRS") == "1"
    if own_dirs and (why := available()) is not None:
        pytest.skip(f"PSTRANSPILE_CHAOS_OWN_DIRS needs mount namespaces: {why}")
    rng = np.random.default_rng(int(os.environ.get("PSTRANSPILE_CHAOS_SEED", "23")))
    references: dict[str, dict[str, np.ndarray]] = {}
    results: list[ChaosRun] = []
    for i in range(runs):
        fixture = BY_NAME[CHAOS_FIXTURES[i % len(CHAOS_FIXTURES)]]
        if fixture.case not in references:
            references[fixture.case] = final_state(reference_run(tmp_path_factory, fixture, STEPS, EVERY, float64=True)
                                                   / "ckpt")[1]
        kills = draw_kills(rng, fixture, STEPS, EVERY)
        out = tmp_path / f"run{i}"
        args = ("--chaos", ",".join(kills), "--pid-dir", str(out / "pids"))
        ckpt = out / "disk{pserver}" / "ckpt" if own_dirs else out / "ckpt"
        wrap = prefix(ckpt, fixture.pservers) if own_dirs else ()
        result = run_job(fixture, out, STEPS, EVERY, *args, float64=True, max_restarts=len(kills), checkpoint_dir=ckpt,
                         wrap=wrap)
        run = ChaosRun(fixture.case, kills, result.ok, restart_origins(out))
        if result.ok:
            step, state = final_state(ckpt)
            bad = tuple(differing(references[fixture.case], state)) + (() if step == STEPS else (f"step {step}",))
            run = ChaosRun(fixture.case, kills, True, run.restarts, not bad, bad)
        results.append(run)
        print(f"run {i}: {run.line()}")
        assert run.identical, f"run {i}: {run.line()}\n" + (log_of(result, out) if not result.ok else "")
        fired = len(list((out / "pids").glob("killed.*")))
        # every kill landed, once; two may land in one attempt (a checkpoint kill's timer and the next step's kill)
        assert fired == len(kills) and 1 <= len(run.restarts) <= len(kills), (fired, run.restarts, kills)
    mid = [m for r in results for m in landed_mid_checkpoint(r.kills, r.restarts)]
    print(f"{len(results)} runs, {sum(len(r.kills) for r in results)} kills ({len(mid)} during a checkpoint's write, "
          f"{sum(mid)} of them before it completed), {sum(r.identical for r in results)} recovered bit-identical")
