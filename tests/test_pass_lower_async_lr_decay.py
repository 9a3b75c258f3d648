"""lower_async_lr_decay: in async mode the step counter becomes a sum of per-trainer counters."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_async_mode_sums_per_trainer_counters_that_start_at_one():
    main, startup = tiny(lr_decay=True)
    bundle = run_until("lower_async_lr_decay", main, startup, sync_mode=False)
    assert ops(main).splitlines()[0] == "op 0 increment X=[@LR_DECAY_COUNTER@] -> Out=[@LR_DECAY_COUNTER@]"
    assert ops(bundle.origin).splitlines()[0] == (
        "op 0 sum X=[@LR_DECAY_COUNTER@.trainer_0, @LR_DECAY_COUNTER@.trainer_1] -> Out=[@LR_DECAY_COUNTER@]")
    assert ops(bundle.origin_startup) == """\
op 0 fill_constant -> Out=[@LR_DECAY_COUNTER@.trainer_0]
op 1 fill_constant -> Out=[@LR_DECAY_COUNTER@.trainer_1]
op 2 fill_constant -> Out=[@LR_DECAY_COUNTER@]
op 3 fill_constant -> Out=[b]
op 4 uniform_random ShapeTensor=[] ShapeTensorList=[] -> Out=[w]
"""
    values = [op.attr("value") for op in bundle.origin_startup.global_block().ops[:3]]
    assert values == [1.0, 1.0, -2.0]  # the shared counter starts at -trainers
    assert bundle.lowered_lr_counter == "@LR_DECAY_COUNTER@"
    assert bundle.origin.global_block().has_var("@LR_DECAY_COUNTER@.trainer_1")


def test_sync_mode_and_programs_without_lr_decay_are_left_alone():
    main, startup = tiny(lr_decay=True)
    bundle = run_until("lower_async_lr_decay", main, startup, sync_mode=True)
    assert ops(bundle.origin) == ops(main) and bundle.lowered_lr_counter is None
    main, startup = tiny()
    bundle = run_until("lower_async_lr_decay", main, startup, sync_mode=False)
    assert ops(bundle.origin) == ops(main) and ops(bundle.origin_startup) == ops(startup)
