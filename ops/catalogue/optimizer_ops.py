"""Optimizer ops as Fluid 1.8.5 registers them (role Optimize), and what the transpiler
must know of each: which slots hold the param, the grad and the learning rate, and which
accumulators are shaped like the param (and so are sliced with it on the pservers).

`OPS` holds every slot, attr and default; `OPTIMIZER_SLOTS` the slot roles. Since 1.7
`adam` updates `Beta1Pow` / `Beta2Pow` itself (outputs `Beta1PowOut` / `Beta2PowOut`).
An optimizer op missing from `OPTIMIZER_SLOTS` cannot be distributed: `optimizer_slots`
raises `UnknownOpError` naming it, never a silent default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ops.catalogue.opdef import Bool, Float, Long, op
from transpiler.errors import UnknownOpError
from transpiler.ir.types import OpRole

_OPT = OpRole.Optimize

OPS = (
    op("sgd", "Param LearningRate Grad", "ParamOut", role=_OPT),
    op(
        "momentum",
        "Param Grad Velocity LearningRate",
        "ParamOut VelocityOut",
        {"mu": Float(), "use_nesterov": Bool(False)},
        role=_OPT,
    ),
    op(
        "lars_momentum",
        # SquaredNorms (ours, optional): [|p|^2, |g|^2] of the whole param when a pserver
        # holds a block of it (transpiler/passes/pserver_norm_reduce.py); else the kernel's own.
        "Param Grad Velocity LearningRate SquaredNorms?",
        "ParamOut VelocityOut",
        {"mu": Float(), "lars_coeff": Float(0.001), "lars_weight_decay": Float(0.0005)},
        role=_OPT,
    ),
    op(
        "adam",
        "Param Grad LearningRate Moment1 Moment2 Beta1Pow Beta2Pow Beta1Tensor? Beta2Tensor?",
        "ParamOut Moment1Out Moment2Out Beta1PowOut Beta2PowOut",
        {
            "beta1": Float(0.9),
            "beta2": Float(0.999),
            "epsilon": Float(1e-8),
            "lazy_mode": Bool(False),
            "min_row_size_to_use_multithread": Long(1000),
        },
        role=_OPT,
    ),
    # Paddle 2.x's AdamW (adamw_op / phi adamw kernel): Adam with decoupled weight decay.
    # `apply_decay_param_fun` reaches the program as each op's `with_decay` (False: no
    # decay for that param), `lr_ratio` as its attr.
    op(
        "adamw",
        "Param Grad LearningRate Moment1 Moment2 Beta1Pow Beta2Pow MasterParam? SkipUpdate? Beta1Tensor? "
        "Beta2Tensor? EpsilonTensor?",
        "ParamOut Moment1Out Moment2Out Beta1PowOut Beta2PowOut MasterParamOut?",
        {
            "beta1": Float(0.9),
            "beta2": Float(0.999),
            "epsilon": Float(1e-8),
            "lr_ratio": Float(1.0),
            "coeff": Float(0.01),
            "with_decay": Bool(False),
            "lazy_mode": Bool(False),
            "min_row_size_to_use_multithread": Long(1000),
            "multi_precision": Bool(False),
            "use_global_beta_pow": Bool(False),
        },
        role=_OPT,
    ),
    # Paddle 2.x's LAMB (lamb_op): Adam's moments, then a layer-wise trust ratio |p| / |r|.
    # Ours: [|p|^2, |r|^2] of a block of a LAMB param, r its update direction (what `lamb`
    # computes before the trust ratio), for the pservers to sum (pserver_norm_reduce.py).
    op(
        "lamb_squared_norms",
        "Param Grad Moment1 Moment2 Beta1Pow Beta2Pow",
        "Out",
        {"weight_decay": Float(), "beta1": Float(0.9), "beta2": Float(0.999), "epsilon": Float(1e-6)},
        role=_OPT,
    ),
    op(
        "lamb",
        # SquaredNorms (ours, optional): [|p|^2, |r|^2] of the whole param (lamb_squared_norms
        # summed across the pservers holding its blocks); else the kernel's own.
        "Param Grad LearningRate Moment1 Moment2 Beta1Pow Beta2Pow MasterParam? SkipUpdate? SquaredNorms?",
        "ParamOut Moment1Out Moment2Out Beta1PowOut? Beta2PowOut? MasterParamOut?",
        {
            "weight_decay": Float(),
            "beta1": Float(0.9),
            "beta2": Float(0.999),
            "epsilon": Float(1e-6),
            "always_adapt": Bool(False),
            "multi_precision": Bool(False),
        },
        role=_OPT,
    ),
    op(
        "adamax",
        "Param Grad LearningRate Moment InfNorm Beta1Pow",
        "ParamOut MomentOut InfNormOut",
        {"beta1": Float(0.9), "beta2": Float(0.999), "epsilon": Float(1e-8)},
        role=_OPT,
    ),
    op("adagrad", "Param Grad Moment LearningRate", "ParamOut MomentOut", {"epsilon": Float(1e-6)}, role=_OPT),
    op(
        "decayed_adagrad",
        "Param Grad Moment LearningRate",
        "ParamOut MomentOut",
        {"decay": Float(0.95), "epsilon": Float(1e-6)},
        role=_OPT,
    ),
    op(
        "rmsprop",
        "Param MeanSquare MeanGrad? LearningRate Grad Moment",
        "ParamOut MomentOut MeanSquareOut MeanGradOut?",
        {"epsilon": Float(1e-10), "decay": Float(0.9), "momentum": Float(0.0), "centered": Bool(False)},
        role=_OPT,
    ),
    op(
        "ftrl",
        "Param SquaredAccumulator LinearAccumulator Grad LearningRate",
        "ParamOut SquaredAccumOut LinearAccumOut",
        {"l1": Float(0.0), "l2": Float(0.0), "lr_power": Float(-0.5)},
        role=_OPT,
    ),
)


@dataclass(frozen=True)
class OptimizerSlots:
    """Slot roles of one optimizer op type.

    `sliced` accumulators are param-shaped and are cut into the same blocks as the param;
    `unsliced` ones (Adam's beta powers, shape [1]) are copied whole to every pserver that
    holds a block of the param. `outputs` maps each updated input slot to the output slot
    that aliases it (`Param` → `ParamOut`, `Moment1` → `Moment1Out`, ...).

    With a sparse grad, Paddle's kernel updates the grad's rows only, or every row of the
    param (absent rows with a zero grad, their state decaying: `every_row`), except with
    the `lazy` attr set (Adam's `lazy_mode`): see `updates_every_row`.
    """

    param: str = "Param"
    grad: str = "Grad"
    learning_rate: str = "LearningRate"
    sliced: tuple[str, ...] = ()
    unsliced: tuple[str, ...] = ()
    outputs: MappingProxyType = field(default_factory=lambda: MappingProxyType({"Param": "ParamOut"}))
    sparse_grad: bool = False  # has an update rule for SelectedRows grads
    every_row: bool = False
    lazy: str | None = None
    # The update reads the L2 norm of the whole param (LARS's local lr, LAMB's trust
    # ratio): a block's norm is not the param's, so the transpiler keeps such a param whole
    # on one pserver (`transpiler/passes/slice_vars.py`)...
    whole_norm: bool = False
    # ...unless the pservers sum its norms across them (sync mode, nothing but L2 decay
    # ahead of the optimizer): the param is cut like any other, its update
    # reads the exchanged norms.
    exchanged_norms: bool = False

    def updates_every_row(self, attr: Callable[[str], Any]) -> bool:
        """Whether a sparse grad updates every row of the param; `attr(name)` reads the op's attr."""
        return self.every_row and not (self.lazy is not None and bool(attr(self.lazy)))

    @property
    def accumulators(self) -> tuple[str, ...]:
        return self.sliced + self.unsliced


def _slots(sliced=(), unsliced=(), outs=(), sparse=False, every_row=False, lazy=None,
           whole_norm=False, exchanged_norms=False) -> OptimizerSlots:
    outputs = {"Param": "ParamOut", **dict(outs)}
    return OptimizerSlots(
        sliced=tuple(sliced), unsliced=tuple(unsliced), outputs=MappingProxyType(outputs), sparse_grad=sparse,
        every_row=every_row, lazy=lazy, whole_norm=whole_norm, exchanged_norms=exchanged_norms,
    )


OPTIMIZER_SLOTS: MappingProxyType[str, OptimizerSlots] = MappingProxyType(
    {
        "sgd": _slots(sparse=True),
        "momentum": _slots(["Velocity"], outs=[("Velocity", "VelocityOut")], sparse=True, every_row=True),
        "lars_momentum": _slots(["Velocity"], outs=[("Velocity", "VelocityOut")], whole_norm=True,
                                exchanged_norms=True),
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
            every_row=True,
            lazy="lazy_mode",
        ),
        "adamw": _slots(
            ["Moment1", "Moment2"],
            ["Beta1Pow", "Beta2Pow"],
            outs=[
                ("Moment1", "Moment1Out"),
                ("Moment2", "Moment2Out"),
                ("Beta1Pow", "Beta1PowOut"),
                ("Beta2Pow", "Beta2PowOut"),
            ],
            sparse=True,
            every_row=True,
            lazy="lazy_mode",
        ),
        # LAMB's trust ratio needs the norms of the whole param and update: dense grads only.
        "lamb": _slots(
            ["Moment1", "Moment2"],
            ["Beta1Pow", "Beta2Pow"],
            outs=[
                ("Moment1", "Moment1Out"),
                ("Moment2", "Moment2Out"),
                ("Beta1Pow", "Beta1PowOut"),
                ("Beta2Pow", "Beta2PowOut"),
            ],
            whole_norm=True,
            exchanged_norms=True,
        ),
        "adamax": _slots(["Moment", "InfNorm"], ["Beta1Pow"], outs=[("Moment", "MomentOut"), ("InfNorm", "InfNormOut")]),
        "adagrad": _slots(["Moment"], outs=[("Moment", "MomentOut")], sparse=True),
        "decayed_adagrad": _slots(["Moment"], outs=[("Moment", "MomentOut")]),
        # Paddle 1.8 slices Moment and MeanSquare but not MeanGrad (`_get_optimizer_input_shape`
        # in distribute_transpiler.py); all three are param-shaped, so we slice all three.
        "rmsprop": _slots(
            ["Moment", "MeanSquare", "MeanGrad"],
            outs=[("Moment", "MomentOut"), ("MeanSquare", "MeanSquareOut"), ("MeanGrad", "MeanGradOut")],
            sparse=True,
            every_row=True,
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
