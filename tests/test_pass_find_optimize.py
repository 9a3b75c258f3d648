"""find_optimize: what leaves the trainer, as the original's ops; the original is frozen after."""

from __future__ import annotations

import pytest
from pass_support import run_until, tiny

from transpiler.ir import FrozenProgramError


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
