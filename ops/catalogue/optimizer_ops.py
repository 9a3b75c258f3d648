"""Optimizer ops as Fluid 1.8.5 registers them (role Optimize).

`optimizers.OPTIMIZER_SLOTS` says which of these slots the transpiler slices; this
module says everything else (every slot, attrs and defaults). Since 1.7 `adam`
updates `Beta1Pow` / `Beta2Pow` itself (outputs `Beta1PowOut` / `Beta2PowOut`).
"""

from __future__ import annotations

from ops.catalogue.opdef import Bool, Float, Long, op
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
        "Param Grad Velocity LearningRate",
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
