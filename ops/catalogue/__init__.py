"""The op catalogue: what each op is (slots, attrs, role, grad maker, shape rule).

    from ops import catalogue
    catalogue.get("mul")          # OpDef | None
    catalogue.require("send")     # OpDef, or UnknownOpError naming the op
    catalogue.make_op("send", {"X": [g]}, {"Out": [dummy]}, {"epmap": [ep]})

Entries are tables in one module per family (math_ops, tensor_ops, loss_ops,
sequence_ops, control_flow_ops, optimizer_ops, distributed_ops); grad op entries are
derived from the forward entries' grad specs (registry.py). `optimizer_ops.OPTIMIZER_SLOTS`
is the transpiler's view of the optimizer ops. An op the catalogue does not know still
loads, dumps, verifies and passes through the transpiler untouched; only building or
differentiating it raises.
"""

from ops.catalogue.build import fill_attrs, get, make_attrs, make_op, op_types, require, typed_attr
from ops.catalogue.grad import GradContext, GradSpec
from ops.catalogue.opdef import (
    GRAD_UNSUPPORTED,
    REQUIRED,
    AttrSpec,
    OpDef,
    OpSpecError,
    ShapeContext,
    ShapeError,
    SlotDef,
    TensorInfo,
)
from ops.catalogue.optimizer_ops import OPTIMIZER_SLOTS, OptimizerSlots, is_optimizer, optimizer_slots
from ops.catalogue.registry import CATALOGUE

__all__ = [
    "CATALOGUE",
    "GRAD_UNSUPPORTED",
    "OPTIMIZER_SLOTS",
    "REQUIRED",
    "AttrSpec",
    "GradContext",
    "GradSpec",
    "OpDef",
    "OpSpecError",
    "OptimizerSlots",
    "ShapeContext",
    "ShapeError",
    "SlotDef",
    "TensorInfo",
    "fill_attrs",
    "get",
    "is_optimizer",
    "make_attrs",
    "make_op",
    "op_types",
    "optimizer_slots",
    "require",
    "typed_attr",
]
