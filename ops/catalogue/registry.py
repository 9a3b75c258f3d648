"""The catalogue table: every family's entries, plus one derived entry per grad op type.

Grad op entries (`mul_grad`, `concat_grad`, ...) are derived from the forward entries'
`GradSpec`s, so a grad op's slots can never disagree with the maker that builds it.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from ops.catalogue import control_flow_ops, distributed_ops, loss_ops, math_ops, optimizer_ops, sequence_ops, tensor_ops
from ops.catalogue import recurrent_ops
from ops.catalogue import transformer_ops
from ops.catalogue.grad import GradSpec
from ops.catalogue.opdef import OpDef

FAMILIES: dict[str, tuple[OpDef, ...]] = {
    "math": math_ops.OPS,
    "tensor": tensor_ops.OPS,
    "loss": loss_ops.OPS,
    "sequence": sequence_ops.OPS,
    "control_flow": control_flow_ops.OPS,
    "optimizer": optimizer_ops.OPS,
    "distributed": distributed_ops.OPS,
    "recurrent": recurrent_ops.OPS,
    "transformer": transformer_ops.OPS,
}
GRAD_VAR_KINDS = {**sequence_ops.GRAD_VAR_KINDS}


def _build() -> MappingProxyType[str, OpDef]:
    table: dict[str, OpDef] = {}
    for family, defs in FAMILIES.items():
        for entry in defs:
            if entry.type in table:
                raise RuntimeError(f"op catalogue: {entry.type!r} is defined twice")
            table[entry.type] = replace(entry, family=family)
    for entry in list(table.values()):
        if isinstance(entry.grad, GradSpec) and entry.grad.type not in table:
            derived = entry.grad.grad_def(entry)
            table[derived.type] = replace(
                derived, family=f"{entry.family}/grad", infer_var_kind=GRAD_VAR_KINDS.get(derived.type)
            )
    return MappingProxyType(dict(sorted(table.items())))


CATALOGUE: MappingProxyType[str, OpDef] = _build()
