"""insert_sends: after the last writer of each grad, split it into its blocks and send them."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_sync_sends_per_trainer_grads_then_a_barrier():
    main, startup = tiny(embedding="distributed")
    bundle = run_until("insert_sends", main, startup)
    assert ops(bundle.trainer).split("op 8 ")[1] == """\
elementwise_add_grad Out@GRAD=[fc_0.tmp_1@GRAD] X=[fc_0.tmp_0] Y=[b] -> X@GRAD=[fc_0.tmp_0@GRAD] Y@GRAD=[b@GRAD.trainer_0]
op 9 send X=[b@GRAD.trainer_0] -> Out=[__control_var@0]
op 10 mul_grad Out@GRAD=[fc_0.tmp_0@GRAD] X=[embedding_0.tmp_0] Y=[w] -> X@GRAD=[embedding_0.tmp_0@GRAD] \
Y@GRAD=[w@GRAD.trainer_0]
op 11 send X=[w@GRAD.trainer_0] -> Out=[__control_var@1]
op 12 lookup_table_grad Ids=[ids] Out@GRAD=[embedding_0.tmp_0@GRAD] W=[emb] -> W@GRAD=[emb@GRAD]
op 13 split_ids Ids=[emb@GRAD] -> Out=[emb@GRAD.trainer_0.pserver_0, emb@GRAD.trainer_0.pserver_1]
op 14 send X=[emb@GRAD.trainer_0.pserver_0, emb@GRAD.trainer_0.pserver_1] -> Out=[__control_var@2]
op 15 send_barrier X=[__control_var@0, __control_var@1, __control_var@2] -> Out=[__control_var@3]
"""
    sends = bundle.trainer_sends
    assert sends.control == {"b": "__control_var@0", "w": "__control_var@1", "emb": "__control_var@2"}
    assert sends.barrier == "__control_var@3"


def test_async_splits_cut_grads_sends_the_step_counter_and_has_no_barrier():
    main, startup = tiny(lr_decay=True)
    bundle = run_until("insert_sends", main, startup, sync_mode=False, min_block_size=4)
    assert ops(bundle.trainer).split("op 5 ")[1] == """\
elementwise_add_grad Out@GRAD=[fc_0.tmp_1@GRAD] X=[fc_0.tmp_0] Y=[b] -> X@GRAD=[fc_0.tmp_0@GRAD] Y@GRAD=[b@GRAD]
op 6 send X=[b@GRAD] -> Out=[__control_var@0]
op 7 mul_grad Out@GRAD=[fc_0.tmp_0@GRAD] X=[x] Y=[w] -> X@GRAD=[] Y@GRAD=[w@GRAD]
op 8 split_byref X=[w@GRAD] -> Out=[w@GRAD.block0, w@GRAD.block1]
op 9 send X=[w@GRAD.block0, w@GRAD.block1] -> Out=[__control_var@1]
op 10 send X=[@LR_DECAY_COUNTER@.trainer_0] -> Out=[__control_var@2]
"""
    assert bundle.trainer_sends.barrier is None
