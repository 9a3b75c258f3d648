"""Ops that create tensors: constants and the random initialisers of startup programs."""

from __future__ import annotations

from ops.catalogue import shapes
from ops.catalogue.opdef import Bool, Float, Int, Longs, Str, op

OPS = (
    op(
        "fill_constant",
        "ShapeTensor? ShapeTensorList*? ValueTensor?",
        "Out",
        {"dtype": Int(5), "shape": Longs([]), "value": Float(0.0), "str_value": Str(""), "force_cpu": Bool(False)},
        infer=shapes.from_attrs,
    ),
    op(
        "uniform_random",
        "ShapeTensor? ShapeTensorList*?",
        "Out",
        {
            "shape": Longs([]),
            "min": Float(-1.0),
            "max": Float(1.0),
            "seed": Int(0),
            "diag_num": Int(0),
            "diag_step": Int(0),
            "diag_val": Float(1.0),
            "dtype": Int(5),
        },
        infer=shapes.from_attrs,
    ),
    op(
        "gaussian_random",
        "",
        "Out",
        {"shape": Longs([]), "mean": Float(0.0), "std": Float(1.0), "seed": Int(0), "dtype": Int(5), "use_mkldnn": Bool(False)},
        infer=shapes.from_attrs,
    ),
)
