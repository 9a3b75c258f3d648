"""The pipeline runner checks each pass's declared contract (requires before, produces after)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pass_support import EPS, tiny

from transpiler.config import make_options
from transpiler.passes import PIPELINE, PipelineError, run_pipeline
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass

STEPS = {step.name: step for step in PIPELINE}


def _bundle() -> Bundle:
    main, startup = tiny()
    return Bundle(origin=main.clone(), origin_startup=startup.clone())


def _options():
    return make_options(None, pservers=EPS, trainers=2, trainer_id=0)


def test_every_pass_declares_a_name_and_a_contract_the_pipeline_order_meets():
    available = {"origin", "origin_startup"}
    for step in PIPELINE:
        assert isinstance(step, Pass) and step.name and callable(step.run)
        assert {name.partition(".")[0] for name in step.requires} <= available, step.name
        available |= {name.partition(".")[0] for name in step.produces}
    assert len(STEPS) == len(PIPELINE)


def test_a_pass_run_before_what_it_requires_is_rejected_by_name():
    with pytest.raises(PipelineError, match="pass slice_vars requires analysis, which no earlier pass produced"):
        run_pipeline(_bundle(), _options(), passes=[STEPS["slice_vars"], STEPS["find_optimize"]])


def test_the_pserver_passes_need_the_plan_first():
    steps = [STEPS["lower_async_lr_decay"], STEPS["find_optimize"], STEPS["pserver_lr_decay"],
             STEPS["pserver_optimize_blocks"]]
    with pytest.raises(PipelineError, match="pass pserver_optimize_blocks requires plan"):
        run_pipeline(_bundle(), _options(), passes=steps)


def test_a_pass_that_does_not_produce_what_it_declares_is_rejected():
    lazy = replace(STEPS["find_optimize"], run=lambda bundle, options: bundle)
    with pytest.raises(PipelineError, match="pass find_optimize declares it produces analysis, but left it unset"):
        run_pipeline(_bundle(), _options(), passes=[lazy])
