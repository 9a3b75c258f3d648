"""pserver_optimize_blocks: a block per param block: sum and scale the trainers' grads, then optimize."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_each_block_averages_the_trainers_grads_and_updates_its_slice():
    main, startup = tiny(lr_decay=True)
    progs = run_until("pserver_optimize_blocks", main, startup, min_block_size=4).pservers["127.0.0.1:6174"]
    assert ops(progs.main, 3) == """\
op 0 sum X=[w@GRAD.block1.trainer_0, w@GRAD.block1.trainer_1] -> Out=[w@GRAD.block1]
op 1 scale ScaleTensor=[] X=[w@GRAD.block1] -> Out=[w@GRAD.block1]
op 2 sgd Grad=[w@GRAD.block1] LearningRate=[tmp_3] Param=[w.block1] -> ParamOut=[w.block1]
"""
    assert progs.main.block(3).parent_idx == 1  # a child of the lr block, which runs first
    assert progs.optimize_blocks == [1, 2, 3]
    assert progs.grad_to_block == [("b@GRAD", 2), ("w@GRAD.block1", 3)]
    assert progs.received == ["b@GRAD.trainer_0", "b@GRAD.trainer_1", "w@GRAD.block1.trainer_0",
                              "w@GRAD.block1.trainer_1"]
    assert progs.main.global_block().var("w.block1").shape == (2, 2)


def test_one_trainer_sends_the_grad_the_block_reads():
    main, startup = tiny()
    progs = run_until("pserver_optimize_blocks", main, startup, trainers=1).pservers["127.0.0.1:6175"]
    assert ops(progs.main, 1) == "op 0 sgd Grad=[w@GRAD] LearningRate=[learning_rate_0] Param=[w] -> ParamOut=[w]\n"
    assert progs.received == ["w@GRAD"]
