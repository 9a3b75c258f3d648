"""Built with the builder, the networks of the `fluid18_*` fixtures give the programs Fluid
1.8.5 wrote, and Paddle's own test networks give the op lists 1.8.5's transpiler gave them.

Compared: blocks and parents; per op its type, slots (names and args, in order) and
every attr with its wire type (FLOAT values as float32), except `op_callstack` and
`op_namescope`, which only say where Python built the op; per var its kind, dtype,
shape, LoD level and flags.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.frontend import fluid18_networks as nets
from transpiler.ir import AttrType, OpRole, Program

NOISE = {"op_callstack", "op_namescope"}


def _attr(attr):
    value = attr.value
    if attr.type == AttrType.FLOAT:
        value = float(np.float32(value))
    elif attr.type == AttrType.FLOATS:
        value = tuple(float(np.float32(v)) for v in value)
    return attr.type.name, value


def structure(program: Program) -> list:
    out = []
    for block in program.blocks:
        out.append(("block", block.idx, block.parent_idx, block.forward_block_idx))
        for i, op in enumerate(block.ops):
            attrs = sorted((k, _attr(a)) for k, a in op.attrs.items() if k not in NOISE)
            out.append(("op", block.idx, i, op.type, list(op.inputs.items()), list(op.outputs.items()), attrs))
        for name, var in sorted(block.vars.items()):
            flags = (var.persistable, var.need_check_feed, var.stop_gradient, var.is_parameter)
            out.append(("var", block.idx, name, var.kind.name, var.dtype, var.shape, var.lod_level, flags))
    return out


FIXTURE_CASES = {
    "fluid18_basic_sgd_2ps": nets.basic_model,
    "fluid18_lr_exp_decay_2ps": nets.lr_decay_model,
    "fluid18_lr_piecewise_2ps": nets.lr_decay_conditional_model,
    "fluid18_ctr_dist_sgd_2ps": nets.ctr_dist_model,
}


@pytest.mark.parametrize("case", sorted(FIXTURE_CASES))
def test_builder_rebuilds_the_fluid18_fixture(case):
    main, startup = FIXTURE_CASES[case]()
    for name, built in (("main", main), ("startup", startup)):
        fixture = Program.load(PADDLE_PROGRAMS / case / f"{name}.pb")
        want, got = structure(fixture), structure(built)
        diffs = [(w, g) for w, g in zip(want, got, strict=False) if w != g]
        assert not diffs and len(want) == len(got), f"{case}/{name}: first difference {diffs[:1]}"
        assert built.version == fixture.version == 1008005


# ------------------------------------------------------- Fluid 1.8.5's transpiled op lists

# Ops Paddle's transpiler adds to the trainer program (and the param `concat` after the fetch).
DIST_OPS = {"send", "recv", "send_barrier", "fetch_barrier", "split_byref", "split_selected_rows", "split_ids",
            "prefetch", "merge_ids", "distributed_lookup_table"}


def trainer_ops_before_transpile(trainer_ops: list[str]) -> list[str]:
    ops = list(trainer_ops)
    if "fetch_barrier" in ops or "recv" in ops:
        tail = max(i for i, t in enumerate(ops) if t in ("fetch_barrier", "recv"))
        ops = ops[: tail + 1] + [t for t in ops[tail + 1:] if t != "concat"]
    return [t for t in ops if t not in DIST_OPS]


BASIC_TRAINER = ['mul', 'elementwise_add', 'elementwise_sub', 'square', 'mean', 'fill_constant', 'mean_grad',
                 'square_grad', 'elementwise_sub_grad', 'elementwise_add_grad', 'send', 'mul_grad', 'split_byref',
                 'send', 'send_barrier', 'recv', 'recv', 'fetch_barrier', 'concat']
PIECEWISE_LR_BLOCK = ["increment", "cast", "fill_constant", "fill_constant", "less_than", "logical_not",
                      "conditional_block", "fill_constant", "fill_constant", "less_than", "logical_not", "logical_and",
                      "logical_and", "conditional_block", "fill_constant", "conditional_block"]
PIECEWISE4_LR_BLOCK = ["increment", "cast", "fill_constant", "fill_constant", "less_than", "logical_not",
                       "conditional_block", "fill_constant", "fill_constant", "less_than", "logical_not", "logical_and",
                       "logical_and", "conditional_block", "fill_constant", "fill_constant", "less_than", "logical_not",
                       "logical_and", "logical_and", "conditional_block", "fill_constant", "fill_constant", "less_than",
                       "logical_not", "logical_and", "logical_and", "conditional_block", "fill_constant",
                       "conditional_block"]
EXP_LR_BLOCK = ['increment', 'cast', 'scale', 'floor', 'fill_constant', 'elementwise_pow', 'scale']
TABLE_TRAINER_A = ['lookup_table', 'sequence_pool', 'lookup_table', 'sequence_pool', 'lookup_table', 'sequence_pool',
                   'concat', 'mul', 'elementwise_add', 'cross_entropy2', 'mean', 'fill_constant', 'mean_grad',
                   'cross_entropy_grad2', 'elementwise_add_grad', 'send', 'mul_grad', 'send', 'concat_grad',
                   'sequence_pool_grad', 'lookup_table_grad', 'split_selected_rows', 'send', 'sequence_pool_grad',
                   'lookup_table_grad', 'sequence_pool_grad', 'lookup_table_grad', 'sum', 'split_selected_rows', 'send',
                   'send_barrier', 'recv', 'recv', 'fetch_barrier']

# network -> (trainer ops 1.8.5 built (test_dist_transpiler.py's cases on the 1.8.5 wheel), lr-decay block, optimize ops per param,
#             trainer sub-blocks)
FACTS = {
    "basic_model": (BASIC_TRAINER, [], {"fc_b": ["sgd"], "fc_w": ["sgd"]}, []),
    "lr_decay_model": (BASIC_TRAINER, EXP_LR_BLOCK, {"fc_b": ["sgd"], "fc_w": ["sgd"]}, []),
    "lr_decay_conditional_model": (BASIC_TRAINER, PIECEWISE_LR_BLOCK, {"fc_b": ["sgd"], "fc_w": ["sgd"]}, [["assign"]] * 3),
    "l2_decay_with_piecewise_model": (
        ['mul', 'elementwise_add', 'elementwise_sub', 'square', 'mean', 'fill_constant', 'mean_grad', 'square_grad',
         'elementwise_sub_grad', 'elementwise_add_grad', 'mul_grad', 'send', 'split_byref', 'send', 'send_barrier',
         'recv', 'recv', 'fetch_barrier', 'concat'],
        PIECEWISE4_LR_BLOCK,
        {"fc_b": ["scale", "sum", "momentum"], "fc_w": ["scale", "sum", "momentum"]},
        [["assign"]] * 5,
    ),
    "async_decay_model": (
        ['mul', 'elementwise_add', 'elementwise_sub', 'square', 'mean', 'fill_constant', 'mean_grad', 'square_grad',
         'elementwise_sub_grad', 'elementwise_add_grad', 'send', 'mul_grad', 'split_byref', 'send', 'send', 'recv',
         'recv', 'concat'],
        EXP_LR_BLOCK,
        {"fc_b": ["sgd"], "fc_w": ["sgd"]},
        [],
    ),
    "empty_pserver_model": (
        ['mul', 'elementwise_sub', 'square', 'mean', 'fill_constant', 'mean_grad', 'square_grad', 'elementwise_sub_grad',
         'mul_grad', 'send', 'send_barrier', 'recv', 'fetch_barrier'],
        [],
        {"fc_w": ["sgd"]},
        [],
    ),
    # TestL2Decay, as the test expects its pserver blocks: clip on both params (older Fluid's behaviour).
    "l2_decay_model_clip_all": (BASIC_TRAINER, [], {"fc_b": ["clip", "sgd"], "fc_w": ["clip", "scale", "sum", "sgd"]}, []),
    # TestL2Decay as release/1.8's test file (PR #23224) means it (clip only fc_w), trainer as 1.8.5 builds it.
    "l2_decay_model": (BASIC_TRAINER, [], {"fc_b": ["sgd"], "fc_w": ["clip", "scale", "sum", "sgd"]}, []),
    # TestLocalLookupTable's trainer list in release/1.4-1.6's test file (it keeps the lookup_table ops), Adam on every param.
    "network_with_table_local": (
        TABLE_TRAINER_A, [], {p: ["adam"] for p in ("fc_b", "fc_w", "profile_emb", "shared_w")}, []
    ),
    # TestDistLookupTable: the distributed table is updated by sgd (pserver block 3 `['sum', 'sgd']`), the rest by adam.
    "network_with_table_dist": (
        TABLE_TRAINER_A, [], {"fc_b": ["adam"], "fc_w": ["adam"], "profile_emb": ["adam"], "shared_w": ["sgd"]}, []
    ),
}
BUILDERS = {
    **{name: getattr(nets, name) for name in FACTS if hasattr(nets, name)},
    "l2_decay_model_clip_all": lambda: nets.l2_decay_model(clip_all=True),
    "network_with_table_local": lambda: nets.network_with_table(is_sparse=True, is_distributed=False),
    "network_with_table_dist": lambda: nets.network_with_table(is_sparse=True, is_distributed=True),
}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_test_network_matches_the_facts(name):
    trainer, lr_block, per_param, sub_blocks = FACTS[name]
    main, _ = BUILDERS[name]()
    ops = main.global_block().ops
    plain = [op.type for op in ops if not op.role & (OpRole.Optimize | OpRole.LRSched)]
    assert plain == trainer_ops_before_transpile(trainer)
    assert [op.type for op in ops if op.role & OpRole.LRSched] == lr_block
    optimize: dict[str, list[str]] = {}
    for op in ops:
        if op.role & OpRole.Optimize and not op.role & OpRole.LRSched:
            optimize.setdefault(op.role_vars[0], []).append(op.type)
    assert optimize == per_param
    assert [[op.type for op in block.ops] for block in main.blocks[1:]] == sub_blocks
    assert all(block.parent_idx == 0 for block in main.blocks[1:])


def test_network_with_table_shapes_and_names():
    """`network_with_table`: three slots (the third reuses `brand_ids`), tables [1000, 64], fc_w [192, 2] (as 1.8.5 built it)."""
    main, startup = nets.network_with_table(is_sparse=True, is_distributed=True)
    block = main.global_block()
    assert [n for n, v in block.vars.items() if v.lod_level == 1 and v.dtype.name == "INT64"] == ["title_ids", "brand_ids"]
    assert block.var("shared_w").shape == (1000, 64) and block.var("profile_emb").shape == (1000, 64)
    assert block.var("fc_w").shape == (192, 2)
    assert block.var("shared_w@GRAD").kind.name == "SELECTED_ROWS"
    lookups = [op for op in block.ops if op.type == "lookup_table"]
    assert [(op.attr("is_distributed"), op.attr("remote_prefetch")) for op in lookups] == [
        (True, False), (True, False), (False, True)
    ]
    names = set(startup.global_block().vars)
    assert {"fc_b_moment1_0", "fc_b_beta1_pow_acc_0", "profile_emb_moment2_0"} <= names
    assert not any(n.startswith("shared_w_") for n in names)  # the distributed table has no Adam state
