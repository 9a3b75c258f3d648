"""`LayerHelper`: what every layer does the same way, as in Fluid.

It names the layer (`fc_0`), its temporaries (`fc_0.tmp_0`, ...) and its parameters
(`fc_0.w_0`, `fc_0.b_0`, unless a `ParamAttr` names them), creates parameters in both
programs (the initializer goes to the startup program), and appends ops through
`framework.append_op`, so every error it raises names the layer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from transpiler.frontend import unique_name
from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import (
    FLOAT_DTYPES,
    Parameter,
    Program,
    Variable,
    append_op,
    create_parameter,
    create_var,
    default_main_program,
    default_startup_program,
    fmt_shape,
    to_dtype,
)
from transpiler.frontend.initializer import Initializer
from transpiler.frontend.param_attr import ParamAttr
from transpiler.ir import DType, Op


class LayerHelper:
    def __init__(self, layer_type: str, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.layer_type = layer_type
        name = kwargs.get("name")
        self.name: str = name if name is not None else unique_name.generate(layer_type)

    @property
    def main_program(self) -> Program:
        return default_main_program()

    @property
    def startup_program(self) -> Program:
        return default_startup_program()

    def error(self, message: str) -> BuildError:
        return BuildError(self.name, message)

    # -- inputs
    def check_variable(self, value: Any, what: str) -> Variable:
        if not isinstance(value, Variable):
            raise self.error(f"{what} must be a Variable, got {type(value).__name__}")
        return value

    def multiple_input(self, key: str = "input") -> list[Variable]:
        value = self.kwargs.get(key)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise self.error(f"{key} is empty")
        return [self.check_variable(v, key) for v in values]

    def input_dtype(self, key: str = "input") -> DType:
        dtype = None
        for var in self.multiple_input(key):
            if dtype is None:
                dtype = var.dtype
            elif dtype != var.dtype:
                raise self.error(f"all inputs must have one dtype, got {dtype.short} and {var.dtype.short}")
        assert dtype is not None
        return dtype

    def check_float(self, var: Variable, what: str = "input") -> None:
        if var.dtype not in FLOAT_DTYPES:
            raise self.error(
                f"{what} {var.name!r} is {var.dtype.short} {fmt_shape(var.shape)}; {self.layer_type} needs a float input"
            )

    @property
    def param_attr(self) -> ParamAttr | bool:
        return ParamAttr._to_attr(self.kwargs.get("param_attr"))

    @property
    def bias_attr(self) -> ParamAttr | bool:
        return ParamAttr._to_attr(self.kwargs.get("bias_attr"))

    def multiple_param_attr(self, length: int) -> list[ParamAttr | bool]:
        attr = self.kwargs.get("param_attr")
        if isinstance(attr, (list, tuple)):
            attrs = [ParamAttr._to_attr(a) for a in attr]
            if len(attrs) != length:
                raise self.error(f"{len(attrs)} param_attrs for {length} inputs")
            return attrs
        one = ParamAttr._to_attr(attr)
        return [copy.deepcopy(one) for _ in range(length)]

    # -- vars
    def create_variable_for_type_inference(self, dtype: Any, stop_gradient: bool = False) -> Variable:
        return create_var(
            self.main_program.current_block(),
            unique_name.generate_with_ignorable_key(f"{self.name}.tmp"),
            dtype=dtype,
            persistable=False,
            stop_gradient=stop_gradient,
            layer=self.name,
        )

    def create_variable(self, *, name: str | None = None, dtype: Any = None, **kwargs: Any) -> Variable:
        return create_var(self.main_program.current_block(), name, dtype=dtype, layer=self.name, **kwargs)

    def create_global_variable(self, *, persistable: bool = False, **kwargs: Any) -> Variable:
        return create_var(self.main_program.global_block(), persistable=persistable, layer=self.name, **kwargs)

    def create_or_get_global_variable(self, name: str, **kwargs: Any) -> tuple[Variable, bool]:
        block = self.main_program.global_block()
        if block.has_var(name):
            return self.main_program.variable(name, block), False
        return self.create_global_variable(name=name, **kwargs), True

    def set_variable_initializer(self, var: Variable, initializer: Initializer) -> Op:
        """Declare `var` persistable in the startup program and prepend its initializer there."""
        block = self.startup_program.global_block()
        startup_var = create_var(
            block,
            var.name,
            shape=var.shape,
            dtype=var.dtype,
            kind=var.type,
            lod_level=var.lod_level,
            persistable=True,
            layer=self.name,
        )
        return initializer(startup_var, block)

    def create_parameter(
        self,
        attr: ParamAttr | bool | None,
        shape: Sequence[int],
        dtype: Any,
        is_bias: bool = False,
        default_initializer: Initializer | None = None,
    ) -> Parameter | None:
        attr = copy.deepcopy(ParamAttr._to_attr(attr))
        if attr is False:
            return None
        assert isinstance(attr, ParamAttr)
        dtype = to_dtype(dtype)
        if attr.name is None:
            attr.name = unique_name.generate(f"{self.name}.{'b' if is_bias else 'w'}")
        if default_initializer is None and attr.initializer is None:
            if dtype not in FLOAT_DTYPES:
                raise self.error(
                    f"parameter {attr.name!r} is {dtype.short}: the default initializer only fills float "
                    "parameters; give it an initializer"
                )
            if is_bias:
                attr._set_default_bias_initializer()
            else:
                attr._set_default_param_initializer()
        else:
            attr._set_default_initializer(default_initializer)
        shape = [int(d) for d in shape]
        startup = self.startup_program.global_block()
        with_init = attr._to_kwargs(with_initializer=True)
        name = with_init.pop("name")
        create_parameter(startup, name, shape=shape, dtype=dtype, layer=self.name, **with_init)
        plain = attr._to_kwargs()
        plain.pop("name")
        return create_parameter(self.main_program.global_block(), name, shape=shape, dtype=dtype, layer=self.name, **plain)

    # -- ops
    def append_op(self, op_type: str, inputs: dict | None = None, outputs: dict | None = None,
                  attrs: dict | None = None, *, index: int | None = None) -> Op:
        return append_op(self.main_program.current_block(), op_type, inputs, outputs, attrs, index=index, layer=self.name)

    def append_bias_op(self, input_var: Variable, dim_start: int = 1, dim_end: int | None = None) -> Variable:
        bias_attr = self.bias_attr
        if not bias_attr:
            return input_var
        size = list(input_var.shape[dim_start:dim_end])
        bias = self.create_parameter(bias_attr, size, input_var.dtype, is_bias=True)
        out = self.create_variable_for_type_inference(input_var.dtype)
        self.append_op("elementwise_add", {"X": [input_var], "Y": [bias]}, {"Out": [out]}, {"axis": dim_start})
        return out

    def append_activation(self, input_var: Variable) -> Variable:
        act = self.kwargs.get("act")
        if act is None:
            return input_var
        if not isinstance(act, str):
            raise self.error(f"act must be an op name such as 'relu', got {act!r}")
        attrs: dict[str, Any] = {}
        if self.kwargs.get("use_cudnn"):
            attrs["use_cudnn"] = True
        if "use_mkldnn" in self.kwargs:
            attrs["use_mkldnn"] = self.kwargs["use_mkldnn"]
        out = self.create_variable_for_type_inference(input_var.dtype)
        self.append_op(act, {"X": [input_var]}, {"Out": [out]}, attrs)
        return out

