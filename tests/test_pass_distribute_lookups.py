"""distribute_lookups: a distributed table's lookups become split_ids → prefetch → merge_ids."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_the_lookup_becomes_a_prefetch_from_every_shard():
    main, startup = tiny(embedding="distributed")
    bundle = run_until("distribute_lookups", main, startup)
    assert ops(bundle.trainer).split("op 4 ")[0] == """\
op 0 split_ids Ids=[ids] -> Out=[prefetch_compress_in_tmp_0, prefetch_compress_in_tmp_1]
op 1 prefetch X=[prefetch_compress_in_tmp_0, prefetch_compress_in_tmp_1] -> Out=[prefetch_compress_out_tmp_0, \
prefetch_compress_out_tmp_1]
op 2 merge_ids Ids=[ids] Rows=[prefetch_compress_in_tmp_0, prefetch_compress_in_tmp_1] X=[prefetch_compress_out_tmp_0, \
prefetch_compress_out_tmp_1] -> Out=[embedding_0.tmp_0]
op 3 mul X=[embedding_0.tmp_0] Y=[w] -> Out=[fc_0.tmp_0]
"""
    assert "lookup_table " not in ops(bundle.trainer)
    assert bundle.trainer.global_block().ops[1].attr("epmap") == ("127.0.0.1:6174", "127.0.0.1:6175")


def test_a_remote_prefetch_sparse_table_is_read_by_one_distributed_lookup_table():
    main, startup = tiny(embedding="sparse", rows=8192)
    bundle = run_until("distribute_lookups", main, startup)
    assert ops(bundle.trainer).split("op 1 ")[0] == (
        "op 0 distributed_lookup_table Ids=[ids] W=[emb] -> Outputs=[embedding_0.tmp_0]\n")
    lookup = bundle.trainer.global_block().ops[0]
    assert lookup.attr("table_names") == ("emb.block0", "emb.block1") and lookup.attr("height_sections") == (5, 5)


def test_without_prefetched_tables_the_trainer_is_unchanged():
    main, startup = tiny()
    before = ops(run_until("drop_optimize", main, startup).trainer)
    assert ops(run_until("distribute_lookups", main, startup).trainer) == before
