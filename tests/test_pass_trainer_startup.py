"""trainer_startup: the trainer's startup receives its params from the pservers."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_params_are_received_after_their_initialisers_and_cut_ones_joined():
    main, startup = tiny()
    assert ops(startup).startswith("op 0 fill_constant -> Out=[learning_rate_0]\n")
    bundle = run_until("trainer_startup", main, startup, min_block_size=4)
    assert ops(bundle.trainer_startup) == """\
op 0 fill_constant -> Out=[b]
op 1 uniform_random ShapeTensor=[] ShapeTensorList=[] -> Out=[w]
op 2 recv X=[] -> Out=[b]
op 3 recv X=[] -> Out=[w.block0, w.block1]
op 4 fetch_barrier X=[] -> Out=[__control_var@3]
op 5 concat AxisTensor=[] X=[w.block0, w.block1] -> Out=[w]
"""  # the learning rate is optimizer state: it lives on the pservers


def test_a_distributed_table_is_fake_initialised_not_received():
    main, startup = tiny(embedding="distributed")
    text = ops(run_until("trainer_startup", main, startup).trainer_startup)
    assert text.endswith("op 5 fake_init -> Out=[emb]\n") and "Out=[emb]" not in text.split("op 5")[0]


def test_a_distributed_tables_optimizer_state_is_not_initialised_on_the_trainer():
    main, startup = tiny(embedding="distributed", table_optimizer="adam")
    trainer_startup = run_until("trainer_startup", main, startup).trainer_startup
    assert not [name for name in trainer_startup.global_block().vars if name.startswith("emb_")]
    assert "fake_init -> Out=[emb]" in ops(trainer_startup)
