"""pserver_table_blocks: the distributed table's shard gets an update, a prefetch and a checkpoint block."""

from __future__ import annotations

from pass_support import ops, run_until, tiny

from transpiler.ir import VarKind


def test_the_shard_is_updated_prefetched_and_saved():
    main, startup = tiny(embedding="distributed")
    progs = run_until("pserver_table_blocks", main, startup).pservers["127.0.0.1:6175"]
    assert ops(progs.main, 2) == """\
op 0 sum X=[emb@GRAD.trainer_0.pserver_1, emb@GRAD.trainer_1.pserver_1] -> Out=[emb@GRAD]
op 1 scale ScaleTensor=[] X=[emb@GRAD] -> Out=[emb@GRAD]
op 2 sgd Grad=[emb@GRAD] LearningRate=[learning_rate_0] Param=[emb] -> ParamOut=[emb]
"""
    assert ops(progs.main, 3) == (
        "op 0 lookup_sparse_table Ids=[prefetch_compress_in_tmp_1] W=[emb] -> Out=[prefetch_compress_out_tmp_1]\n")
    assert ops(progs.main, 4) == "op 0 save X=[emb] ->\n"
    assert progs.grad_to_block[-1] == ("emb@GRAD", 2)
    assert progs.table_attrs == {"prefetch_var_name_to_block_id": ["prefetch_compress_in_tmp_1:3"],
                                 "checkpint_block_id": 4}
    assert progs.main.global_block().var("emb").shape == (5, 4)  # 10 rows, id % 2 == 1
    assert "kLookupTablePath" in progs.main.global_block().vars


def test_without_a_distributed_table_nothing_changes():
    main, startup = tiny(embedding="sparse")
    before = run_until("pserver_optimize_blocks", main, startup).pservers
    after = run_until("pserver_table_blocks", main, startup).pservers
    assert [p.main.num_blocks for p in after.values()] == [p.main.num_blocks for p in before.values()]


def test_a_table_trained_by_adam_has_its_moments_sharded_like_it_and_its_beta_powers_whole():
    main, startup = tiny(embedding="distributed", table_optimizer="adam")
    progs = run_until("pserver_table_blocks", main, startup).pservers["127.0.0.1:6175"]
    assert ops(progs.main, 2) == """\
op 0 sum X=[emb@GRAD.trainer_0.pserver_1, emb@GRAD.trainer_1.pserver_1] -> Out=[emb@GRAD]
op 1 scale ScaleTensor=[] X=[emb@GRAD] -> Out=[emb@GRAD]
op 2 adam Beta1Pow=[emb_beta1_pow_acc_0] Beta1Tensor=[] Beta2Pow=[emb_beta2_pow_acc_0] Beta2Tensor=[] \
Grad=[emb@GRAD] LearningRate=[learning_rate_0] Moment1=[emb_moment1_0] Moment2=[emb_moment2_0] Param=[emb] \
-> Beta1PowOut=[emb_beta1_pow_acc_0] Beta2PowOut=[emb_beta2_pow_acc_0] Moment1Out=[emb_moment1_0] \
Moment2Out=[emb_moment2_0] ParamOut=[emb]
"""
    globals_ = progs.main.global_block()
    for name in ("emb", "emb_moment1_0", "emb_moment2_0"):
        var = globals_.var(name)
        assert (var.kind, var.shape, var.persistable) == (VarKind.SELECTED_ROWS, (5, 4), True), name
    for name in ("emb_beta1_pow_acc_0", "emb_beta2_pow_acc_0"):
        assert (globals_.var(name).kind, globals_.var(name).shape) == (VarKind.LOD_TENSOR, (1,)), name
    assert ops(progs.main, 4) == "op 0 save X=[emb] ->\n"  # the table's checkpoint saves its rows, not its moments
