"""insert_recvs: a recv per param after the send barrier, a fetch barrier, a concat per cut param."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_sync_receives_every_block_then_joins_cut_params():
    main, startup = tiny()
    bundle = run_until("insert_recvs", main, startup, min_block_size=4)
    assert ops(bundle.trainer).split("op 10 ")[1] == """\
send_barrier X=[__control_var@0, __control_var@1] -> Out=[__control_var@2]
op 11 recv X=[__control_var@2] -> Out=[b]
op 12 recv X=[__control_var@2] -> Out=[w.block0, w.block1]
op 13 fetch_barrier X=[__control_var@2] -> Out=[b, w.block0, w.block1]
op 14 concat AxisTensor=[] X=[w.block0, w.block1] -> Out=[w]
"""
    assert bundle.trainer.global_block().var("w.block1").shape == (2, 2)


def test_async_recvs_wait_on_their_own_send():
    main, startup = tiny()
    bundle = run_until("insert_recvs", main, startup, sync_mode=False)
    assert ops(bundle.trainer).split("op 8 ")[1] == """\
send X=[w@GRAD] -> Out=[__control_var@1]
op 9 recv X=[__control_var@0] -> Out=[b]
op 10 recv X=[__control_var@1] -> Out=[w]
"""
