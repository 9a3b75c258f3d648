"""pserver_startup: each pserver initialises exactly its blocks, with block shapes."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_initialisers_are_cut_to_the_blocks_on_the_pserver():
    main, startup = tiny()
    bundle = run_until("pserver_startup", main, startup, min_block_size=4)
    first, second = (bundle.pservers[ep].startup for ep in ("127.0.0.1:6174", "127.0.0.1:6175"))
    assert ops(first) == """\
op 0 fill_constant -> Out=[learning_rate_0]
op 1 fill_constant -> Out=[b]
op 2 uniform_random ShapeTensor=[] ShapeTensorList=[] -> Out=[w.block1]
"""
    assert ops(second) == """\
op 0 fill_constant -> Out=[learning_rate_0]
op 1 uniform_random ShapeTensor=[] ShapeTensorList=[] -> Out=[w.block0]
"""
    assert second.global_block().ops[1].attr("shape") == (2, 2)
    assert startup.global_block().ops[2].attr("shape") == (4, 2)  # the user's startup is untouched


def test_a_distributed_tables_moments_start_as_shards_of_zeros_and_its_beta_powers_whole():
    main, startup = tiny(embedding="distributed", table_optimizer="adam")
    progs = run_until("pserver_startup", main, startup).pservers["127.0.0.1:6174"]
    state = [op for op in progs.startup.global_block().ops if op.output_names[0].startswith("emb")]
    assert [(op.type, op.output_names[0], list(op.attr("shape")), op.attr("value", None)) for op in state] == [
        ("fill_constant", "emb_beta2_pow_acc_0", [1], 0.999),
        ("fill_constant", "emb_beta1_pow_acc_0", [1], 0.9),
        ("fill_constant", "emb_moment2_0", [5, 4], 0.0),
        ("fill_constant", "emb_moment1_0", [5, 4], 0.0),
        ("uniform_random", "emb", [5, 4], None),
    ]
