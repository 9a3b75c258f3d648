"""drop_unused_vars: vars only the optimize and lr ops used leave the trainer, after the sends."""

from __future__ import annotations

from pass_support import run_until, tiny

LR_VARS = {"@LR_DECAY_COUNTER@", "cast_0.tmp_0", "tmp_0", "tmp_1", "tmp_2", "tmp_3"}


def test_lr_vars_go_and_what_the_trainer_still_uses_stays():
    main, startup = tiny(lr_decay=True)
    before = set(run_until("insert_recvs", main, startup).trainer.global_block().vars)
    after = set(run_until("drop_unused_vars", main, startup).trainer.global_block().vars)
    assert before - after == LR_VARS
    assert {"w", "b", "b@GRAD.trainer_0", "x"} <= after


def test_the_async_step_counter_a_trainer_sends_is_kept():
    main, startup = tiny(lr_decay=True)
    kept = run_until("drop_unused_vars", main, startup, sync_mode=False).trainer.global_block().vars
    assert "@LR_DECAY_COUNTER@.trainer_0" in kept and "tmp_3" not in kept
