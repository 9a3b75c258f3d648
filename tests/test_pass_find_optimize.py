"""find_optimize: what leaves the trainer, as the original's ops; the original is frozen after."""

from __future__ import annotations

import pytest
from pass_support import run_until, tiny

from ops.catalogue import make_op
from transpiler.errors import TranspileError
from transpiler.ir import FrozenProgramError, OpRole


def test_the_analysis_names_optimize_and_lr_ops_and_each_params_grad_producer():
    main, startup = tiny(lr_decay=True)
    bundle = run_until("find_optimize", main, startup)
    assert bundle.analysis.to_text() == """\
# ps-transpiler analysis v1
optimize_ops [13:sgd, 14:sgd]
lr_ops [0:increment, 4:cast, 5:scale, 6:fill_constant, 7:elementwise_pow, 8:scale]
lr_counter @LR_DECAY_COUNTER@ updated_by=0:increment
param b grad=b@GRAD optimizer=13:sgd grad_producer=11:elementwise_add_grad ops=[13:sgd]
param w grad=w@GRAD optimizer=14:sgd grad_producer=12:mul_grad ops=[14:sgd]
"""
    chain = bundle.analysis.chains[1]
    assert chain.optimizer.block is bundle.origin.global_block()  # ops of the original, not positions


def test_after_the_async_lowering_the_counter_is_updated_by_the_sum():
    main, startup = tiny(lr_decay=True)
    text = run_until("find_optimize", main, startup, sync_mode=False).analysis.to_text()
    assert "lr_ops [0:sum, 4:cast" in text and "lr_counter @LR_DECAY_COUNTER@ updated_by=0:sum" in text


def test_embedding_tables_are_found_and_the_distributed_one_is_split_off():
    main, startup = tiny(embedding="distributed")
    text = run_until("find_optimize", main, startup).analysis.to_text()
    assert "table emb lookup_table lookups=[0:lookup_table] padding_idx=-1 distributed\n" in text
    assert "distributed_table emb grad=emb@GRAD optimizer=" in text and "param emb " not in text


def test_the_analysed_original_is_frozen():
    main, startup = tiny()
    bundle = run_until("find_optimize", main, startup)
    with pytest.raises(FrozenProgramError):
        bundle.origin.global_block().remove_op(bundle.analysis.chains[0].optimizer)
    with pytest.raises(FrozenProgramError):
        bundle.origin_startup.global_block().create_var("z")
    main.global_block().create_var("z")  # the user's program is not the bundle's copy


def test_a_distributed_table_keeps_its_own_optimizer():
    main, startup = tiny(embedding="distributed", table_optimizer="adam")
    text = run_until("find_optimize", main, startup).analysis.to_text()
    assert "distributed_table emb grad=emb@GRAD optimizer=9:adam grad_producer=8:lookup_table_grad ops=[9:adam] sparse\n" in text


def test_a_distributed_table_refuses_other_optimize_ops_and_a_decay_of_every_row():
    main, startup = tiny(embedding="distributed", table_optimizer="adam")
    adam = next(op for op in main.global_block().ops if op.type == "adam")
    clip = make_op("clip", {"X": ["emb@GRAD"]}, {"Out": ["emb@GRAD"]}, {"min": -1.0, "max": 1.0},
                   role=OpRole.Optimize, role_vars=("emb", "emb@GRAD"))
    main.global_block().insert_before(adam, clip)
    with pytest.raises(TranspileError, match=r"updated by its optimizer op alone \(adam\); it also has optimize ops 9:clip"):
        run_until("find_optimize", main, startup)

    main, startup = tiny(embedding="distributed", table_optimizer="momentum")
    next(op for op in main.global_block().ops if op.type == "momentum").set_attr("regularization_method", "l2_decay")
    with pytest.raises(TranspileError, match="momentum with regularization_method='l2_decay' decays rows"):
        run_until("find_optimize", main, startup)

    main, startup = tiny(embedding="distributed", table_optimizer="decayed_adagrad")
    with pytest.raises(TranspileError, match="decayed_adagrad cannot apply the sparse grad 'emb@GRAD'"):
        run_until("find_optimize", main, startup)


def test_a_table_whose_every_row_optimizer_starts_from_non_zero_state_is_refused():
    main, startup = tiny(embedding="distributed", table_optimizer="momentum")
    init = next(op for op in startup.global_block().ops if op.output_names == ["emb_velocity_0"])
    init.set_attr("value", 0.5)
    with pytest.raises(TranspileError, match="momentum updates every row, and its accumulator 'emb_velocity_0' "
                                             "starts at 0.5"):
        run_until("find_optimize", main, startup)
    init.set_attr("value", 0.0)
    assert run_until("find_optimize", main, startup).analysis.distributed_table.optimizer.type == "momentum"


def test_adamw_on_a_distributed_table_trains_as_adam_and_refuses_a_decay():
    """A table AdamW decays would lose rows no shard holds; one it does not decay is Adam
    at lr * lr_ratio, row by row (test_kernels_table_optimizers.py), and LAMB / LARS, which
    need the whole table's norm and a dense grad, are refused by name."""
    main, startup = tiny(embedding="distributed", table_optimizer="adam")
    adam = next(op for op in main.global_block().ops if op.type == "adam" and op.input("Param") == ("emb",))
    adam.type = "adamw"
    adam.set_attr("with_decay", True)
    adam.set_attr("coeff", 0.01)
    with pytest.raises(TranspileError, match=r"distributed table 'emb': adamw with weight decay \(with_decay, "
                                             r"coeff=0.01\) decays every row"):
        run_until("find_optimize", main, startup)
    adam.set_attr("with_decay", False)
    assert run_until("find_optimize", main, startup).analysis.distributed_table.optimizer.type == "adamw"
    adam.type = "lamb"
    with pytest.raises(TranspileError, match="lamb cannot apply the sparse grad 'emb@GRAD'"):
        run_until("find_optimize", main, startup)
