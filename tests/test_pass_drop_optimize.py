"""drop_optimize: the trainer is the original without optimize and lr-decay ops."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_optimize_and_lr_ops_leave_the_trainer_and_the_original_keeps_them():
    main, startup = tiny(lr_decay=True)
    bundle = run_until("drop_optimize", main, startup)
    assert ops(bundle.trainer) == """\
op 0 mul X=[x] Y=[w] -> Out=[fc_0.tmp_0]
op 1 elementwise_add X=[fc_0.tmp_0] Y=[b] -> Out=[fc_0.tmp_1]
op 2 mean X=[fc_0.tmp_1] -> Out=[mean_0.tmp_0]
op 3 fill_constant -> Out=[mean_0.tmp_0@GRAD]
op 4 mean_grad Out@GRAD=[mean_0.tmp_0@GRAD] X=[fc_0.tmp_1] -> X@GRAD=[fc_0.tmp_1@GRAD]
op 5 elementwise_add_grad Out@GRAD=[fc_0.tmp_1@GRAD] X=[fc_0.tmp_0] Y=[b] -> X@GRAD=[fc_0.tmp_0@GRAD] Y@GRAD=[b@GRAD]
op 6 mul_grad Out@GRAD=[fc_0.tmp_0@GRAD] X=[x] Y=[w] -> X@GRAD=[] Y@GRAD=[w@GRAD]
"""
    assert len(bundle.origin.global_block()) == 15
    producer = bundle.analysis.chains[1].grad_producer  # the clone map finds the analysed op in the trainer
    assert bundle.trainer_ops.op(producer) is bundle.trainer.global_block().ops[6]
