"""Initializers: ops *prepended* to the startup block, as Fluid's are.

Prepending is why a Fluid startup program lists the last-created var first (the
learning rate before the params, `fc_0.b_0` before `fc_0.w_0`). A seed of 0 takes the
startup program's `random_seed`, as in Fluid.
"""

from __future__ import annotations

import math
from typing import Any

from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import FLOAT_DTYPES, Program, Variable, append_op
from transpiler.ir import Block, Op


class Initializer:
    """Base class: `init(var, startup_block)` prepends the op that fills `var`."""

    def __call__(self, var: Variable, block: Block) -> Op:
        raise NotImplementedError

    @staticmethod
    def _seed(seed: int, block: Block) -> int:
        if seed == 0 and isinstance(block.program, Program):
            return int(block.program.random_seed)
        return seed


class ConstantInitializer(Initializer):
    def __init__(self, value: float = 0.0, force_cpu: bool = False) -> None:
        self._value = float(value)
        self._force_cpu = bool(force_cpu)

    def __call__(self, var: Variable, block: Block) -> Op:
        return append_op(
            block,
            "fill_constant",
            None,
            {"Out": [var.name]},
            {"shape": list(var.shape), "dtype": int(var.dtype), "value": self._value, "force_cpu": self._force_cpu},
            index=0,
            layer="ConstantInitializer",
        )


class UniformInitializer(Initializer):
    def __init__(self, low: float = -1.0, high: float = 1.0, seed: int = 0, diag_num: int = 0, diag_step: int = 0,
                 diag_val: float = 1.0) -> None:
        if low > high:
            raise BuildError("UniformInitializer", f"low {low} is greater than high {high}")
        self._low, self._high, self._seed_value = float(low), float(high), int(seed)
        self._diag = (int(diag_num), int(diag_step), float(diag_val))

    def __call__(self, var: Variable, block: Block) -> Op:
        _float_only("UniformInitializer", var)
        self._seed_value = self._seed(self._seed_value, block)
        diag_num, diag_step, diag_val = self._diag
        return append_op(
            block,
            "uniform_random",
            {},
            {"Out": [var.name]},
            {
                "shape": list(var.shape),
                "dtype": int(var.dtype),
                "min": self._low,
                "max": self._high,
                "seed": self._seed_value,
                "diag_num": diag_num,
                "diag_step": diag_step,
                "diag_val": diag_val,
            },
            index=0,
            layer="UniformInitializer",
        )


class NormalInitializer(Initializer):
    def __init__(self, loc: float = 0.0, scale: float = 1.0, seed: int = 0) -> None:
        self._mean, self._std, self._seed_value = float(loc), float(scale), int(seed)

    def __call__(self, var: Variable, block: Block) -> Op:
        _float_only("NormalInitializer", var)
        self._seed_value = self._seed(self._seed_value, block)
        return append_op(
            block,
            "gaussian_random",
            None,
            {"Out": [var.name]},
            {
                "shape": list(var.shape),
                "dtype": int(var.dtype),
                "mean": self._mean,
                "std": self._std,
                "seed": self._seed_value,
                "use_mkldnn": False,
            },
            index=0,
            layer="NormalInitializer",
        )


def compute_fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """Fluid's `_compute_fans`: rows/cols of a matrix, channels x receptive field beyond."""
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


class XavierInitializer(Initializer):
    """Glorot: uniform in ±sqrt(6 / (fan_in + fan_out)), or normal with std sqrt(2 / (fan_in + fan_out)).
    Fluid's default for weights (`fc`, `embedding`)."""

    def __init__(self, uniform: bool = True, fan_in: int | None = None, fan_out: int | None = None, seed: int = 0) -> None:
        self._uniform = bool(uniform)
        self._fan_in, self._fan_out = fan_in, fan_out
        self._seed_value = int(seed)

    def __call__(self, var: Variable, block: Block) -> Op:
        _float_only("XavierInitializer", var)
        f_in, f_out = compute_fans(var.shape)
        fan_in = f_in if self._fan_in is None else self._fan_in
        fan_out = f_out if self._fan_out is None else self._fan_out
        self._seed_value = self._seed(self._seed_value, block)
        if self._uniform:
            limit = math.sqrt(6.0 / float(fan_in + fan_out))
            return append_op(
                block,
                "uniform_random",
                {},
                {"Out": [var.name]},
                {"shape": list(var.shape), "dtype": int(var.dtype), "min": -limit, "max": limit, "seed": self._seed_value},
                index=0,
                layer="XavierInitializer",
            )
        std = math.sqrt(2.0 / float(fan_in + fan_out))
        return append_op(
            block,
            "gaussian_random",
            None,
            {"Out": [var.name]},
            {"shape": list(var.shape), "dtype": int(var.dtype), "mean": 0.0, "std": std, "seed": self._seed_value},
            index=0,
            layer="XavierInitializer",
        )


def _float_only(layer: str, var: Variable) -> None:
    if var.dtype not in FLOAT_DTYPES:
        raise BuildError(layer, f"cannot fill {var.name!r} ({var.dtype.short}) with random floats; give it a Constant initializer")


Constant = ConstantInitializer
Uniform = UniformInitializer
Normal = NormalInitializer
Xavier = XavierInitializer


def as_initializer(value: Any) -> Initializer:
    if not isinstance(value, Initializer):
        raise BuildError("ParamAttr", f"initializer must be an Initializer, got {type(value).__name__}")
    return value
