"""The ops the transpiler emits, with Fluid 1.8.5's registered signatures (the OpProtos
of the paddlepaddle 1.8.5 wheel; defaults as an op built without attrs gets them).

Attr types are exactly Paddle's: `sections` is LONGS on `send` but INTS on
`split_byref`; `height_sections` LONGS; endpoint lists STRINGS. Default roles are what
Paddle's transpiler gives these ops: RPC for the ones that talk to a pserver, Dist for
the trainer-side splits; pserver-side ops keep Forward.
"""

from __future__ import annotations

from ops.catalogue import shapes
from ops.catalogue.opdef import BlocksAttr, Bool, Int, Ints, Long, Longs, Str, Strs, op
from transpiler.ir.types import OpRole

_RPC, _DIST = OpRole.RPC, OpRole.Dist
_DEFAULT_EP = ["127.0.0.1:6164"]

OPS = (
    op(
        "send",
        "X*",
        "Out*",
        {
            "trainer_id": Int(0),
            "epmap": Strs(_DEFAULT_EP),
            "sections": Longs([]),
            "send_varnames": Strs([]),
            "num": Int(0),
            "merge_add": Bool(False),
            "use_send_handler": Bool(True),
        },
        role=_RPC,
    ),
    op(
        "recv",
        "X*",
        "Out*",
        {
            "epmap": Strs([]),
            "trainer_id": Int(0),
            "with_barrier": Bool(True),
            "varnames": Strs([]),
            "recv_varnames": Strs([]),
            "do_not_run": Int(0),
        },
        role=_RPC,
    ),
    op(
        "send_barrier",
        "X*",
        "Out*",
        {"trainer_id": Int(0), "endpoints": Strs(_DEFAULT_EP), "half_async": Bool(False)},
        role=_RPC,
    ),
    op("fetch_barrier", "X*?", "Out*", {"trainer_id": Int(0), "endpoints": Strs(_DEFAULT_EP)}, role=_RPC),
    op("split_byref", "X", "Out*", {"sections": Ints([]), "num": Int(0)}, role=_DIST),
    # Fluid's `split` (math op, here for the trainer's column cut of a 2-D partition's grad)
    op("split", "X AxisTensor? SectionsTensorList*?", "Out*", {"axis": Int(0), "num": Int(0), "sections": Ints([])}),
    op("split_selected_rows", "X", "Out*", {"height_sections": Longs([])}, role=_DIST),
    # ours, not Fluid's: a SelectedRows cut by column ranges of its value (same rows in every
    # piece), the trainer's cut of a sparse grad into 2-D partitions (transpiler.partition)
    op("split_selected_rows_by_columns", "X", "Out*", {"sections": Ints([])}, role=_DIST),
    op("split_ids", "Ids*", "Out*", role=_RPC),
    op("merge_ids", "Ids* Rows* X*", "Out*", role=_RPC),
    op("prefetch", "X*", "Out*", {"trainer_id": Int(0), "epmap": Strs(_DEFAULT_EP)}, role=_RPC),
    op(
        "lookup_sparse_table",
        "W Ids",
        "Out",
        {"padding_idx": Long(-1), "auto_grown_table": Bool(True), "is_test": Bool(False)},
    ),
    op(
        "distributed_lookup_table",
        "Ids* W",
        "Outputs*",
        {
            "table_names": Strs([]),
            "height_sections": Longs([]),
            "endpoints": Strs([]),
            "trainer_id": Int(0),
            "lookup_table_version": Str("lookup_table"),
            "padding_idx": Long(-1),
            "dtype": Int(5),
        },
        role=_RPC,
    ),
    op("fake_init", "", "Out", {"shape": Longs([])}),
    op(
        "listen_and_serv",
        "X*?",
        "",
        {
            "endpoint": Str("127.0.0.1:6164"),
            "optimize_blocks": BlocksAttr([]),
            "grad_to_block_id": Strs([]),
            "sparse_grad_to_param": Strs([]),
            "prefetch_var_name_to_block_id": Strs([]),
            "distributed_mode": Int(0),
            "Fanin": Int(1),
            "pserver_id": Int(-1),
            "lr_decay_block_id": Int(-1),
            "checkpint_block_id": Int(-1),
            "dc_asgd": Bool(False),
            "rpc_get_thread_num": Int(1),
            "rpc_send_thread_num": Int(1),
            "rpc_prefetch_thread_num": Int(1),
        },
    ),
    op("checkpoint_notify", "", "", {"epmap": Strs([]), "dir": Str(""), "lookup_table": Str(""), "trainer_id": Int(0)}, role=_RPC),
    op("ref_by_trainer_id", "X* TrainerId", "Out"),
    op("save", "X", "", {"overwrite": Bool(True), "save_as_fp16": Bool(False), "file_path": Str()}),
    # Ours: a pserver's partial sum (a [1] tensor) added with every other pserver's, in
    # pserver order (ops/rpc/reduce.py); the exact global norm of a clip
    # (transpiler/passes/pserver_norm_reduce.py).
    op(
        "pserver_allreduce_sum",
        "X",
        "Out",
        {"endpoints": Strs([]), "endpoint": Str("")},
        role=OpRole.Optimize,
        infer=shapes.unary,
    ),
)
