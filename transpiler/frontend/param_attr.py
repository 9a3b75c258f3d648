"""`ParamAttr`: how a layer's parameter is named, initialised, regularised and clipped."""

from __future__ import annotations

import copy
from typing import Any

from transpiler.frontend.errors import BuildError
from transpiler.frontend.initializer import Constant, Initializer, Xavier


class ParamAttr:
    """Fluid's ParamAttr. `name=None` lets the layer name it (`fc_0.w_0`)."""

    def __init__(
        self,
        name: str | None = None,
        initializer: Initializer | None = None,
        learning_rate: float = 1.0,
        regularizer: Any = None,
        trainable: bool = True,
        gradient_clip: Any = None,
        do_model_average: bool = True,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise BuildError("ParamAttr", f"name must be a non-empty string, got {name!r}")
        if initializer is not None and not isinstance(initializer, Initializer):
            raise BuildError("ParamAttr", f"initializer must be an Initializer, got {type(initializer).__name__}")
        self.name = name
        self.initializer = initializer
        self.learning_rate = learning_rate
        self.regularizer = regularizer
        self.trainable = trainable
        self.gradient_clip = gradient_clip
        self.do_model_average = do_model_average

    def _set_default_initializer(self, initializer: Initializer | None) -> None:
        if initializer is None:
            if self.initializer is None:
                raise BuildError("ParamAttr", "no initializer and no default initializer")
            return
        if self.initializer is None:
            self.initializer = initializer

    def _set_default_param_initializer(self) -> None:
        self._set_default_initializer(Xavier())

    def _set_default_bias_initializer(self) -> None:
        self._set_default_initializer(Constant(0.0))

    @staticmethod
    def _to_attr(arg: Any) -> ParamAttr | bool:
        """None → default attr; a str → its name; an Initializer → its initializer; False → no param."""
        if arg is None:
            return ParamAttr()
        if isinstance(arg, (list, tuple)):
            raise BuildError("ParamAttr", "a list of ParamAttrs is only valid for multi-input layers")
        if isinstance(arg, ParamAttr):
            return arg
        if isinstance(arg, str):
            return ParamAttr(name=arg)
        if isinstance(arg, Initializer):
            return ParamAttr(initializer=arg)
        if arg is False:
            return False
        if arg is True:
            return ParamAttr()
        raise BuildError("ParamAttr", f"{arg!r} cannot be turned into a ParamAttr")

    def _to_kwargs(self, with_initializer: bool = False) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "name": self.name,
            "optimize_attr": {"learning_rate": self.learning_rate},
            "regularizer": self.regularizer,
            "trainable": self.trainable,
            "gradient_clip_attr": self.gradient_clip,
            "do_model_average": self.do_model_average,
        }
        if with_initializer:
            kwargs["initializer"] = self.initializer
        return kwargs

    def copy(self) -> ParamAttr:
        return copy.deepcopy(self)
