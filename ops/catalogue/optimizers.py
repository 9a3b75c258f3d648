"""What the transpiler must know of each optimizer op: which slots hold the param, the
grad and the learning rate, and which accumulators are shaped like the param (and so are
sliced with it on the pservers).

An optimizer op missing from this table cannot be distributed: `optimizer_slots` raises
`UnknownOpError` naming it, never a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from transpiler.errors import UnknownOpError


@dataclass(frozen=True)
class OptimizerSlots:
    """Slot roles of one optimizer op type.

    `sliced` accumulators are param-shaped and are cut into the same blocks as the param;
    `unsliced` ones (Adam's beta powers, shape [1]) are copied whole to every pserver that
    holds a block of the param. `outputs` maps each updated input slot to the output slot
    that aliases it (`Param` → `ParamOut`, `Moment1` → `Moment1Out`, ...).
    """

    param: str = "Param"
    grad: str = "Grad"
    learning_rate: str = "LearningRate"
    sliced: tuple[str, ...] = ()
    unsliced: tuple[str, ...] = ()
    outputs: MappingProxyType = field(default_factory=lambda: MappingProxyType({"Param": "ParamOut"}))
    sparse_grad: bool = False  # has an update rule for SelectedRows grads

    @property
    def accumulators(self) -> tuple[str, ...]:
        return self.sliced + self.unsliced


def _slots(sliced=(), unsliced=(), outs=(), sparse=False) -> OptimizerSlots:
    outputs = {"Param": "ParamOut", **dict(outs)}
    return OptimizerSlots(
        sliced=tuple(sliced), unsliced=tuple(unsliced), outputs=MappingProxyType(outputs), sparse_grad=sparse
    )


OPTIMIZER_SLOTS: MappingProxyType[str, OptimizerSlots] = MappingProxyType(
    {
        "sgd": _slots(sparse=True),
        "momentum": _slots(["Velocity"], outs=[("Velocity", "VelocityOut")], sparse=True),
        "lars_momentum": _slots(["Velocity"], outs=[("Velocity", "VelocityOut")]),
        "adam": _slots(
            ["Moment1", "Moment2"],
            ["Beta1Pow", "Beta2Pow"],
            outs=[
                ("Moment1", "Moment1Out"),
                ("Moment2", "Moment2Out"),
                ("Beta1Pow", "Beta1PowOut"),
                ("Beta2Pow", "Beta2PowOut"),
            ],
            sparse=True,
        ),
        "adamax": _slots(["Moment", "InfNorm"], ["Beta1Pow"], outs=[("Moment", "MomentOut"), ("InfNorm", "InfNormOut")]),
        "adagrad": _slots(["Moment"], outs=[("Moment", "MomentOut")], sparse=True),
        "decayed_adagrad": _slots(["Moment"], outs=[("Moment", "MomentOut")]),
        # Paddle slices Moment and MeanSquare but not MeanGrad (facts §10.6); all three are
        # param-shaped, so we slice all three.
        "rmsprop": _slots(
            ["Moment", "MeanSquare", "MeanGrad"],
            outs=[("Moment", "MomentOut"), ("MeanSquare", "MeanSquareOut"), ("MeanGrad", "MeanGradOut")],
            sparse=True,
        ),
        "ftrl": _slots(
            ["SquaredAccumulator", "LinearAccumulator"],
            outs=[("SquaredAccumulator", "SquaredAccumOut"), ("LinearAccumulator", "LinearAccumOut")],
            sparse=True,
        ),
    }
)


def is_optimizer(op_type: str) -> bool:
    return op_type in OPTIMIZER_SLOTS


def optimizer_slots(op_type: str) -> OptimizerSlots:
    try:
        return OPTIMIZER_SLOTS[op_type]
    except KeyError:
        known = ", ".join(sorted(OPTIMIZER_SLOTS))
        raise UnknownOpError(
            f"optimizer op {op_type!r} is not in the catalogue (known: {known}); it cannot be distributed"
        ) from None
