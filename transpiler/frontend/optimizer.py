"""Optimizers: `SGD`, `Momentum`, `Adam`, `Adagrad` with Fluid 1.8's `minimize(loss)`.

`minimize` = `append_backward` + `apply_gradients`: the (param, grad) pairs sorted by
param name, each grad clipped (`grad_clip` or the param's clip) and regularised
(`regularization` or the param's regularizer), then per param one optimizer op with
`op_role = Optimize` and `op_role_var = [param, grad]`. Accumulators
(`<param>_velocity_0`, `_moment1_0`, `_moment2_0`, `_beta1_pow_acc_0`,
`_beta2_pow_acc_0`, `_moment_0`) are persistable vars filled by `fill_constant`s in the
startup program; a float learning rate becomes the persistable `learning_rate_<n>`,
a Variable (an lr schedule) is used as it is.

The distributed lookup table is updated by a plain `sgd` whatever the optimizer, as in
Fluid 1.x; `optimizer.distributed_table_optimizer = Adam(...)` (or the optimizer itself)
updates it with that optimizer's op and accumulators instead, without clip or
regularisation (the transpiler trains it so on the pservers).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from transpiler.frontend import unique_name
from transpiler.frontend.backward import append_backward
from transpiler.frontend.clip import GradientClipBase, append_gradient_clip_ops
from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import (
    FLOAT_DTYPES,
    Parameter,
    Program,
    Variable,
    default_main_program,
    device_guard,
    fmt_shape,
    program_guard,
)
from transpiler.frontend.initializer import Constant
from transpiler.frontend.layer_helper import LayerHelper
from transpiler.frontend.regularizer import WeightDecayRegularizer, append_regularization_ops
from transpiler.ir import Block, DType, Op, VarKind


def find_distributed_lookup_table(program: Program) -> str | None:
    """The one table `lookup_table` ops read with `is_distributed` (Fluid supports one)."""
    table = None
    for op in program.global_block().ops:
        if op.type != "lookup_table":
            continue
        name = op.input("W")[0]
        if op.attr("is_distributed", False):
            if table is not None and table != name:
                raise BuildError("distributed lookup table", f"found tables {table!r} and {name!r}; only one is supported")
            table = name
    for op in program.global_block().ops:
        if op.type == "lookup_table" and not op.attr("is_distributed", False) and op.input("W")[0] == table:
            raise BuildError(
                "distributed lookup table", f"table {table!r} is looked up both with and without is_distributed"
            )
    return table


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Optimizer:
    """Base class. Subclasses set `type`, create accumulators and append their op."""

    type = ""
    # Fluid's public names for the subclasses, used in error messages.
    display_name = "Optimizer"
    # Fluid 1.x updates the distributed lookup table with `sgd`; an optimizer here replaces it.
    distributed_table_optimizer: Optimizer | None = None

    def __init__(
        self,
        learning_rate: float | Variable,
        parameter_list: Sequence[Any] | None = None,
        regularization: WeightDecayRegularizer | None = None,
        grad_clip: GradientClipBase | None = None,
        name: str | None = None,
    ) -> None:
        if not (_number(learning_rate) or isinstance(learning_rate, Variable)):
            raise self._error(f"learning_rate must be a float or a Variable, got {learning_rate!r}")
        if _number(learning_rate) and learning_rate < 0:
            raise self._error(f"learning_rate must not be negative, got {learning_rate}")
        if regularization is not None and not isinstance(regularization, WeightDecayRegularizer):
            raise self._error(f"regularization must be a regularizer such as L2Decay(1e-4), got {regularization!r}")
        if grad_clip is not None and not isinstance(grad_clip, GradientClipBase):
            raise self._error(f"grad_clip must be a GradientClip* object, got {grad_clip!r}")
        self._learning_rate = float(learning_rate) if _number(learning_rate) else learning_rate
        self._parameter_list = list(parameter_list) if parameter_list is not None else None
        self.regularization = regularization
        self._grad_clip = grad_clip
        self._name = name
        self._dtype: DType | None = None
        self._learning_rate_map: dict[Program, Variable] = {}
        if isinstance(learning_rate, Variable):
            self._learning_rate_map[learning_rate.program] = learning_rate
        self._accumulators: dict[str, dict[str, Variable]] = {}
        self.helper: LayerHelper | None = None

    @classmethod
    def _error(cls, message: str) -> BuildError:
        return BuildError(cls.display_name, message)

    @classmethod
    def _reject_unknown(cls, unknown: dict[str, Any]) -> None:
        if unknown:
            known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "unknown")]
            bad = ", ".join(sorted(unknown))
            raise cls._error(f"unknown argument(s) {bad} (it takes {', '.join(known)})")

    # -- learning rate
    def _global_learning_rate(self, program: Program | None = None) -> Variable | None:
        return self._learning_rate_map.get(program or default_main_program())

    def _create_global_learning_rate(self) -> None:
        if self._global_learning_rate() is not None:
            return
        if not isinstance(self._learning_rate, float):
            raise self._error(
                f"the learning-rate Variable {self._learning_rate.name!r} belongs to another program than the loss"
            )
        from transpiler.frontend import layers

        var = layers.create_global_var(
            name=unique_name.generate("learning_rate"),
            shape=[1],
            value=self._learning_rate,
            dtype=self._dtype or DType.FP32,
            persistable=True,
        )
        self._learning_rate_map[default_main_program()] = var

    def _create_param_lr(self, param: Parameter) -> Variable:
        lr = self._global_learning_rate()
        assert lr is not None
        param_lr = param.optimize_attr.get("learning_rate", 1.0)
        if isinstance(param_lr, Variable):
            return param_lr
        if param_lr == 1.0:
            return lr
        with default_main_program()._lr_schedule_guard(is_with_opt=True):
            return lr * float(param_lr)

    # -- accumulators
    def _add_accumulator(
        self,
        name: str,
        param: Parameter,
        dtype: Any = None,
        fill_value: float = 0.0,
        shape: Sequence[int] | None = None,
        kind: VarKind | None = None,
        device: str | None = None,
    ) -> Variable:
        if self._name is not None:
            name = f"{self._name}_{name}"
        table = self._accumulators.setdefault(name, {})
        if param.name in table:
            raise self._error(f"accumulator {name} already exists for parameter {param.name!r}")
        assert self.helper is not None
        var = self.helper.create_global_variable(
            name=unique_name.generate(f"{param.name}_{name}"),
            persistable=True,
            dtype=dtype or param.dtype,
            kind=kind or param.type,
            shape=list(param.shape if shape is None else shape),
        )
        with device_guard(device):
            self.helper.set_variable_initializer(var, Constant(value=float(fill_value)))
        table[param.name] = var
        return var

    def _get_accumulator(self, name: str, param: Parameter) -> Variable:
        if self._name is not None:
            name = f"{self._name}_{name}"
        try:
            return self._accumulators[name][param.name]
        except KeyError:
            raise self._error(f"no accumulator {name} for parameter {param.name!r}") from None

    def _create_accumulators(self, block: Block, parameters: list[Parameter]) -> None:
        pass

    def _append_optimize_op(self, block: Block, param_and_grad: tuple[Parameter, Variable]) -> Op:
        raise NotImplementedError

    def _append_op(self, block: Block, inputs: dict, outputs: dict, attrs: dict | None = None) -> Op:
        assert self.helper is not None
        from transpiler.frontend.framework import append_op

        return append_op(block, self.type, inputs, outputs, attrs or {}, layer=self.display_name)

    # -- the passes
    def backward(
        self,
        loss: Variable,
        startup_program: Program | None = None,
        parameter_list: Sequence[Any] | None = None,
        no_grad_set: Any = None,
    ) -> list[tuple[Parameter, Variable]]:
        if not isinstance(loss, Variable):
            raise self._error(f"minimize needs the loss Variable, got {type(loss).__name__}")
        if loss.shape != (1,):
            raise self._error(
                f"the loss {loss.name!r} has shape {fmt_shape(loss.shape)}; it must be [1] (take layers.mean of it)"
            )
        if loss.dtype not in FLOAT_DTYPES:
            raise self._error(f"the loss {loss.name!r} is {loss.dtype.short}; only a float loss can be minimised")
        program = loss.program
        no_grad = {p.name for p in program.all_parameters() if not p.trainable}
        for item in no_grad_set or ():
            no_grad.add(item.name if isinstance(item, Variable) else str(item))
        self._dtype = loss.dtype
        params = parameter_list if parameter_list is not None else self._parameter_list
        with program_guard(program, startup_program):
            return append_backward(loss, params, sorted(no_grad))

    def apply_gradients(self, params_grads: Sequence[tuple[Parameter, Variable | None]]) -> list[Op]:
        params_grads = sorted(params_grads, key=lambda pg: pg[0].name)
        params_grads, table_ops = self._process_distribute_lookuptable(params_grads)
        if self._grad_clip is not None:
            params_grads = self._grad_clip(params_grads)
        else:
            params_grads = append_gradient_clip_ops(params_grads)
        params_grads = append_regularization_ops(params_grads, self.regularization)
        ops = self._create_optimization_pass(params_grads)
        return [*ops, *table_ops]

    def _process_distribute_lookuptable(self, params_grads):
        """Fluid 1.x updates the distributed lookup table with a plain `sgd` whatever the
        optimizer (or here with `distributed_table_optimizer`), without clip or
        regularisation, and builds that op first."""
        program = default_main_program()
        table = find_distributed_lookup_table(program)
        if table is None:
            return list(params_grads), []
        rest = [(p, g) for p, g in params_grads if p.name != table]
        found = [(p, g) for p, g in params_grads if p.name == table and g is not None]
        if not found:
            return rest, []
        param, grad = found[0]
        if self.distributed_table_optimizer is not None:
            return rest, self.distributed_table_optimizer._create_optimization_pass([(param, grad)])
        with program._optimized_guard([param, grad]):
            self._create_global_learning_rate()
            from transpiler.frontend.framework import append_op

            op = append_op(
                program.global_block(),
                "sgd",
                {"Param": [param], "Grad": [grad], "LearningRate": [self._create_param_lr(param)]},
                {"ParamOut": [param]},
                layer=self.display_name,
            )
        return rest, [op]

    def apply_optimize(self, loss: Variable, startup_program: Program | None, params_grads) -> list[Op]:
        with program_guard(loss.program, startup_program):
            return self.apply_gradients(params_grads)

    def _create_optimization_pass(self, params_grads) -> list[Op]:
        program = default_main_program()
        block = program.global_block()
        start = len(block)
        self.helper = LayerHelper(type(self).__name__)
        self._create_accumulators(block, [p for p, _ in params_grads if p.trainable])
        self._create_global_learning_rate()
        for param, grad in params_grads:
            if grad is None or not param.trainable:
                continue
            with program._optimized_guard([param, grad]):
                self._append_optimize_op(block, (param, grad))
        return list(block.ops[start:])

    def minimize(
        self,
        loss: Variable,
        startup_program: Program | None = None,
        parameter_list: Sequence[Any] | None = None,
        no_grad_set: Any = None,
        **unknown: Any,
    ) -> tuple[list[Op], list[tuple[Parameter, Variable]]]:
        if unknown:
            raise self._error(
                f"minimize() got unknown argument(s) {', '.join(sorted(unknown))} "
                "(it takes loss, startup_program, parameter_list, no_grad_set; pass grad_clip to the optimizer)"
            )
        params_grads = self.backward(loss, startup_program, parameter_list, no_grad_set)
        return self.apply_optimize(loss, startup_program, params_grads), params_grads


class _StateOptimizer(Optimizer):
    """An optimizer op with `Param`, `Grad`, `LearningRate` and param-shaped state.

    `state` lists each accumulator as (name, input slot, output slot), in the order Fluid
    creates them (which is the order of their initializers in the startup program);
    `_op_attrs` gives the op's attrs, `_fill_value` an accumulator's initial value.
    """

    state: tuple[tuple[str, str, str], ...] = ()

    def _op_attrs(self) -> dict:
        return {}

    def _fill_value(self, accumulator: str) -> float:
        return 0.0

    def _create_accumulators(self, block, parameters):
        for param in parameters:
            for name, _, _ in self.state:
                self._add_accumulator(name, param, fill_value=self._fill_value(name))

    def _append_optimize_op(self, block, param_and_grad):
        param, grad = param_and_grad
        inputs = {"Param": [param], "Grad": [grad], "LearningRate": [self._create_param_lr(param)]}
        outputs = {"ParamOut": [param]}
        for name, in_slot, out_slot in self.state:
            accumulator = self._get_accumulator(name, param)
            inputs[in_slot] = [accumulator]
            outputs[out_slot] = [accumulator]
        return self._append_op(block, inputs, outputs, self._op_attrs())


class SGDOptimizer(_StateOptimizer):
    """`param -= lr * grad`."""

    type = "sgd"
    display_name = "SGD"

    def __init__(self, learning_rate, parameter_list=None, regularization=None, grad_clip=None, name=None, **unknown):
        self._reject_unknown(unknown)
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)


class MomentumOptimizer(_StateOptimizer):
    """`velocity = mu * velocity + grad; param -= lr * velocity` (or Nesterov)."""

    type = "momentum"
    display_name = "Momentum"
    state = (("velocity", "Velocity", "VelocityOut"),)

    def __init__(self, learning_rate, momentum, parameter_list=None, use_nesterov=False, regularization=None,
                 grad_clip=None, name=None, **unknown):
        self._reject_unknown(unknown)
        if not _number(momentum):
            raise self._error(f"momentum must be a number, got {momentum!r}")
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)
        self._momentum = float(momentum)
        self._use_nesterov = bool(use_nesterov)

    def _op_attrs(self) -> dict:
        return {"mu": self._momentum, "use_nesterov": self._use_nesterov}


class AdamOptimizer(Optimizer):
    """Adam; since Fluid 1.7 the `adam` op updates the beta powers itself (no `scale` ops)."""

    type = "adam"
    display_name = "Adam"
    _moment1_acc_str = "moment1"
    _moment2_acc_str = "moment2"
    _beta1_pow_acc_str = "beta1_pow_acc"
    _beta2_pow_acc_str = "beta2_pow_acc"

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, parameter_list=None,
                 regularization=None, grad_clip=None, name=None, lazy_mode=False, **unknown):
        self._reject_unknown(unknown)
        for key, value in (("beta1", beta1), ("beta2", beta2), ("epsilon", epsilon)):
            if not (_number(value) or isinstance(value, Variable)):
                raise self._error(f"{key} must be a number or a Variable, got {value!r}")
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)
        self._beta1, self._beta2, self._epsilon = beta1, beta2, float(epsilon)
        self._lazy_mode = bool(lazy_mode)

    def _create_accumulators(self, block, parameters):
        for param in parameters:
            self._add_accumulator(self._moment1_acc_str, param)
            self._add_accumulator(self._moment2_acc_str, param)
            beta1 = 0.9 if isinstance(self._beta1, Variable) else self._beta1
            beta2 = 0.999 if isinstance(self._beta2, Variable) else self._beta2
            self._add_accumulator(self._beta1_pow_acc_str, param, fill_value=beta1, shape=[1],
                                  kind=VarKind.LOD_TENSOR, device="cpu")
            self._add_accumulator(self._beta2_pow_acc_str, param, fill_value=beta2, shape=[1],
                                  kind=VarKind.LOD_TENSOR, device="cpu")

    def _append_optimize_op(self, block, param_and_grad):
        param, grad = param_and_grad
        acc = {key: self._get_accumulator(key, param) for key in (
            self._moment1_acc_str, self._moment2_acc_str, self._beta1_pow_acc_str, self._beta2_pow_acc_str)}
        inputs: dict[str, Any] = {
            "Param": [param],
            "Grad": [grad],
            "LearningRate": [self._create_param_lr(param)],
            "Moment1": [acc[self._moment1_acc_str]],
            "Moment2": [acc[self._moment2_acc_str]],
            "Beta1Pow": [acc[self._beta1_pow_acc_str]],
            "Beta2Pow": [acc[self._beta2_pow_acc_str]],
        }
        outputs = {
            "ParamOut": [param],
            "Moment1Out": [acc[self._moment1_acc_str]],
            "Moment2Out": [acc[self._moment2_acc_str]],
            "Beta1PowOut": [acc[self._beta1_pow_acc_str]],
            "Beta2PowOut": [acc[self._beta2_pow_acc_str]],
        }
        attrs: dict[str, Any] = {"epsilon": self._epsilon, "lazy_mode": self._lazy_mode, "min_row_size_to_use_multithread": 1000}
        for key, slot, value in (("beta1", "Beta1Tensor", self._beta1), ("beta2", "Beta2Tensor", self._beta2)):
            if isinstance(value, Variable):
                inputs[slot] = [value]
            else:
                attrs[key] = float(value)
        return self._append_op(block, inputs, outputs, attrs)


class AdagradOptimizer(_StateOptimizer):
    """`moment += grad²; param -= lr * grad / (sqrt(moment) + epsilon)`."""

    type = "adagrad"
    display_name = "Adagrad"
    state = (("moment", "Moment", "MomentOut"),)

    def __init__(self, learning_rate, epsilon=1.0e-6, parameter_list=None, regularization=None, grad_clip=None,
                 name=None, initial_accumulator_value=0.0, **unknown):
        self._reject_unknown(unknown)
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)
        self._epsilon = float(epsilon)
        self.initial_accumulator_value = float(initial_accumulator_value)

    def _fill_value(self, accumulator: str) -> float:
        return self.initial_accumulator_value

    def _op_attrs(self) -> dict:
        return {"epsilon": self._epsilon}


class DecayedAdagradOptimizer(_StateOptimizer):
    """`moment = decay * moment + (1 - decay) * grad²; param -= lr * grad / (sqrt(moment) + epsilon)`."""

    type = "decayed_adagrad"
    display_name = "DecayedAdagrad"
    state = (("moment", "Moment", "MomentOut"),)

    def __init__(self, learning_rate, decay=0.95, epsilon=1.0e-6, parameter_list=None, regularization=None,
                 grad_clip=None, name=None, **unknown):
        self._reject_unknown(unknown)
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)
        self._decay = float(decay)
        self._epsilon = float(epsilon)

    def _op_attrs(self) -> dict:
        return {"decay": self._decay, "epsilon": self._epsilon}


class FtrlOptimizer(_StateOptimizer):
    """Follow The Regularized Leader, with `squared` and `linear` accumulators."""

    type = "ftrl"
    display_name = "Ftrl"
    state = (("squared", "SquaredAccumulator", "SquaredAccumOut"), ("linear", "LinearAccumulator", "LinearAccumOut"))

    def __init__(self, learning_rate, l1=0.0, l2=0.0, lr_power=-0.5, parameter_list=None, regularization=None,
                 grad_clip=None, name=None, **unknown):
        self._reject_unknown(unknown)
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)
        self._l1, self._l2, self._lr_power = float(l1), float(l2), float(lr_power)

    def _op_attrs(self) -> dict:
        return {"l1": self._l1, "l2": self._l2, "lr_power": self._lr_power}


class RMSPropOptimizer(_StateOptimizer):
    """RMSProp with `momentum`, `mean_square` and `mean_grad` accumulators (all param-shaped)."""

    type = "rmsprop"
    display_name = "RMSProp"
    state = (("momentum", "Moment", "MomentOut"), ("mean_square", "MeanSquare", "MeanSquareOut"),
             ("mean_grad", "MeanGrad", "MeanGradOut"))

    def __init__(self, learning_rate, rho=0.95, epsilon=1.0e-6, momentum=0.0, centered=False, parameter_list=None,
                 regularization=None, grad_clip=None, name=None, **unknown):
        self._reject_unknown(unknown)
        super().__init__(learning_rate, parameter_list, regularization, grad_clip, name)
        self._rho, self._epsilon, self._momentum = float(rho), float(epsilon), float(momentum)
        self._centered = bool(centered)

    def _op_attrs(self) -> dict:
        return {"decay": self._rho, "epsilon": self._epsilon, "momentum": self._momentum, "centered": self._centered}


SGD = SGDOptimizer
Momentum = MomentumOptimizer
Adam = AdamOptimizer
Adagrad = AdagradOptimizer
DecayedAdagrad = DecayedAdagradOptimizer
Ftrl = FtrlOptimizer
RMSProp = RMSPropOptimizer

__all__ = [
    "DecayedAdagrad",
    "DecayedAdagradOptimizer",
    "Ftrl",
    "FtrlOptimizer",
    "RMSProp",
    "RMSPropOptimizer",
    "SGD",
    "Adagrad",
    "AdagradOptimizer",
    "Adam",
    "AdamOptimizer",
    "Momentum",
    "MomentumOptimizer",
    "Optimizer",
    "SGDOptimizer",
]
