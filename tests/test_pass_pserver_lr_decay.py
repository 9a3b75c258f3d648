"""pserver_lr_decay: every pserver program starts with a copy of the lr ops in block 1."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_each_pserver_gets_the_lr_ops_as_its_first_optimize_block():
    main, startup = tiny(lr_decay=True)
    bundle = run_until("pserver_lr_decay", main, startup)
    assert list(bundle.pservers) == ["127.0.0.1:6174", "127.0.0.1:6175"]
    for progs in bundle.pservers.values():
        assert (progs.lr_block, progs.optimize_blocks, progs.main.block(1).parent_idx) == (1, [1], 0)
        assert ops(progs.main, 1) == """\
op 0 increment X=[@LR_DECAY_COUNTER@] -> Out=[@LR_DECAY_COUNTER@]
op 1 cast X=[@LR_DECAY_COUNTER@] -> Out=[cast_0.tmp_0]
op 2 scale ScaleTensor=[] X=[cast_0.tmp_0] -> Out=[tmp_0]
op 3 fill_constant -> Out=[tmp_1]
op 4 elementwise_pow X=[tmp_1] Y=[tmp_0] -> Out=[tmp_2]
op 5 scale ScaleTensor=[] X=[tmp_2] -> Out=[tmp_3]
"""
        assert "@LR_DECAY_COUNTER@" in progs.main.global_block().vars


def test_without_lr_decay_the_programs_start_empty():
    main, startup = tiny()
    for progs in run_until("pserver_lr_decay", main, startup).pservers.values():
        assert (progs.main.num_blocks, progs.lr_block, progs.optimize_blocks) == (1, -1, [])
