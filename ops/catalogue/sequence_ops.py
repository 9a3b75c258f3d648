"""Embedding lookups and sequence (LoD) ops.

`lookup_table` is Fluid 1.x's embedding (ids end in a 1); Paddle 2.x's
`nn.embedding` builds `lookup_table_v2` instead. With `is_sparse` the table's grad is
a SelectedRows var, which is what the transpiler splits by rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ops.catalogue import shapes
from ops.catalogue.grad import GradSpec
from ops.catalogue.opdef import Bool, Float, Int, Long, Longs, Str, Strs, op
from transpiler.ir import Op
from transpiler.ir.types import VarKind

_LOOKUP_ATTRS = {
    "is_sparse": Bool(False),
    "is_distributed": Bool(False),
    "padding_idx": Long(-1),
    "grad_inplace": Bool(False),
    "remote_prefetch": Bool(False),
    "trainer_id": Int(0),
    "height_sections": Longs([]),
    "epmap": Strs([]),
    "table_names": Strs([]),
}


def sparse_table_grad(op_: Op, kind_of: Callable[[str], VarKind | None]) -> Mapping[str, VarKind]:
    """`W@GRAD` of a sparse lookup is SelectedRows (Paddle's `LookupTableOpGradVarTypeInference`)."""
    kind = VarKind.SELECTED_ROWS if op_.attr("is_sparse", False) else VarKind.LOD_TENSOR
    return {name: kind for name in op_.output("W@GRAD")}


def _lookup(name: str, infer) -> tuple:
    grad = GradSpec(f"{name}_grad", inputs=("W", "Ids"), in_grads=("W",))
    return op(name, "W Ids", "Out", _LOOKUP_ATTRS, grad=grad, infer=infer)


OPS = (
    _lookup("lookup_table", shapes.lookup_table),
    _lookup("lookup_table_v2", shapes.lookup_table_v2),
    op(
        "sequence_pool",
        "X",
        "Out MaxIndex!",
        {"is_test": Bool(False), "pooltype": Str("AVERAGE"), "pad_value": Float(0.0)},
        grad=GradSpec("sequence_pool_grad", inputs=("X",), outputs_if=(("MaxIndex", "pooltype", "MAX"),)),
        infer=shapes.sequence_pool,
    ),
)

# Var-kind rules of grad ops (their entries are derived from the grad specs above).
GRAD_VAR_KINDS = {"lookup_table_grad": sparse_table_grad, "lookup_table_v2_grad": sparse_table_grad}
