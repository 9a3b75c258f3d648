"""Vision ops (what ResNet is made of): `conv2d` / `depthwise_conv2d`, `batch_norm`,
`pool2d`, `flatten_contiguous_range`, with Paddle 2.6's slots, attrs and grad makers.

The window arithmetic (`window_paddings`, `conv_out_size`, `pool_out_size`) is Paddle's
`UpdatePaddingAndDilation` / `UpdatePadding` and its output-size formulas, kept here once:
the shape rules below and the kernels (ops/kernels/vision.py) both use it.

Paddle 2.6 attrs this module declares beyond Fluid 1.8's (`padding_algorithm`,
`data_format`, `use_addto`, ...) are those Paddle 2.6 writes into its programs (the ResNet-50
fixture shows them all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ops.catalogue.grad import GradSpec
from ops.catalogue.opdef import Bool, Float, Int, Ints, ShapeContext, ShapeError, Str, TensorInfo, op
from ops.catalogue.shapes import Result, fmt

PADDING_ALGORITHMS = ("EXPLICIT", "SAME", "VALID")
CHANNEL_FIRST = ("NCHW", "AnyLayout")  # Paddle reads AnyLayout as NCHW
CHANNEL_LAST = ("NHWC",)


def channel_last(layout: str, op_type: str) -> bool:
    """True for NHWC; NCHW (and AnyLayout) is channel first; anything else is refused."""
    if layout in CHANNEL_LAST:
        return True
    if layout in CHANNEL_FIRST:
        return False
    raise ShapeError(f"{op_type}: data format {layout!r} is not NCHW or NHWC")


def window_paddings(
    op_type: str,
    paddings: Sequence[int],
    algorithm: str,
    in_sizes: Sequence[int],
    ksizes: Sequence[int],
    strides: Sequence[int],
) -> list[tuple[int, int]]:
    """Per spatial dim (before, after), as Paddle's UpdatePadding works them out: 2 values
    are symmetric, 4 are [top, bottom, left, right]; `SAME` pads so that out = ceil(in /
    stride) (the odd pixel after), `VALID` pads nothing."""
    if algorithm not in PADDING_ALGORITHMS:
        raise ShapeError(f"{op_type}: padding_algorithm {algorithm!r} is not one of {', '.join(PADDING_ALGORITHMS)}")
    dims = len(in_sizes)
    if algorithm == "VALID":
        return [(0, 0)] * dims
    if algorithm == "SAME":
        out = []
        for size, k, s in zip(in_sizes, ksizes, strides, strict=True):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0) if size >= 0 else 0
            out.append((total // 2, total - total // 2))
        return out
    pads = [int(p) for p in paddings]
    if len(pads) == dims:
        return [(p, p) for p in pads]
    if len(pads) == 2 * dims:
        return [(pads[2 * i], pads[2 * i + 1]) for i in range(dims)]
    raise ShapeError(f"{op_type}: paddings {pads} must hold {dims} or {2 * dims} values")


def conv_out_size(size: int, k: int, pads: tuple[int, int], stride: int, dilation: int) -> int:
    if size < 0:
        return -1
    return (size + pads[0] + pads[1] - (dilation * (k - 1) + 1)) // stride + 1


def pool_out_size(size: int, k: int, pads: tuple[int, int], stride: int, ceil_mode: bool) -> int:
    if size < 0:
        return -1
    span = size - k + pads[0] + pads[1]
    return (span + stride - 1) // stride + 1 if ceil_mode else span // stride + 1


def conv_geometry(op_type: str, attrs, in_sizes: Sequence[int], ksizes: Sequence[int]):
    """(strides, dilations, paddings) of a conv: `SAME` sets every dilation to 1, as Paddle does."""
    strides = [int(s) for s in attrs["strides"]]
    dilations = [int(d) for d in attrs["dilations"]]
    algorithm = str(attrs["padding_algorithm"])
    pads = window_paddings(op_type, attrs["paddings"], algorithm, in_sizes, ksizes, strides)
    if algorithm == "SAME":
        dilations = [1] * len(dilations)
    return strides, dilations, pads


def pool_geometry(op_type: str, attrs, in_sizes: Sequence[int]):
    """(ksize, strides, paddings, out sizes) of a pool2d; global pooling takes the whole
    plane, adaptive pooling's ksize is its output size (both pad nothing)."""
    ksize = [int(k) for k in attrs["ksize"]]
    strides = [int(s) for s in attrs["strides"]]
    if attrs["global_pooling"]:
        return list(in_sizes), strides, [(0, 0)] * len(in_sizes), [1] * len(in_sizes)
    if attrs["adaptive"]:
        return ksize, strides, [(0, 0)] * len(in_sizes), ksize
    pads = window_paddings(op_type, attrs["paddings"], str(attrs["padding_algorithm"]), in_sizes, ksize, strides)
    ceil_mode = bool(attrs["ceil_mode"])
    out = [pool_out_size(n, k, p, s, ceil_mode) for n, k, p, s in zip(in_sizes, ksize, pads, strides, strict=True)]
    return ksize, strides, pads, out


# ------------------------------------------------------------------ shape rules


def _spatial(ctx: ShapeContext, x: TensorInfo, layout_attr: str) -> tuple[bool, list[int]]:
    if len(x.shape) != 4:
        raise ShapeError(f"{ctx.op_type}: input must be 4-D, got {fmt(x.shape)}")
    last = channel_last(str(ctx.attr(layout_attr)), ctx.op_type)
    return last, list(x.shape[1:3] if last else x.shape[2:4])


def conv2d_shape(ctx: ShapeContext) -> Result:
    x, w = ctx.x("Input"), ctx.x("Filter")
    last, sizes = _spatial(ctx, x, "data_format")
    if len(w.shape) != 4:
        raise ShapeError(f"{ctx.op_type}: Filter must be 4-D [out, in/groups, kh, kw], got {fmt(w.shape)}")
    channels = x.shape[3] if last else x.shape[1]
    groups = int(ctx.attr("groups"))
    if channels > 0 and w.shape[1] * groups != channels:
        raise ShapeError(f"{ctx.op_type}: input {fmt(x.shape)} has {channels} channels; Filter {fmt(w.shape)} "
                         f"with groups={groups} expects {w.shape[1] * groups}")
    strides, dilations, pads = conv_geometry(ctx.op_type, ctx.attrs, sizes, w.shape[2:])
    out = [conv_out_size(n, k, p, s, d) for n, k, p, s, d in zip(sizes, w.shape[2:], pads, strides, dilations,
                                                                   strict=True)]
    shape = (x.shape[0], *out, w.shape[0]) if last else (x.shape[0], w.shape[0], *out)
    return {"Output": [TensorInfo(x.dtype, shape)]}


def pool2d_shape(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    last, sizes = _spatial(ctx, x, "data_format")
    _, _, _, out = pool_geometry(ctx.op_type, ctx.attrs, sizes)
    shape = (x.shape[0], *out, x.shape[3]) if last else (*x.shape[:2], *out)
    return {"Out": [TensorInfo(x.dtype, shape)]}


def batch_norm_shape(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    if len(x.shape) < 2:
        raise ShapeError(f"batch_norm: X must have at least 2 dims, got {fmt(x.shape)}")
    last = channel_last(str(ctx.attr("data_layout")), ctx.op_type)
    channels = x.shape[-1] if last else x.shape[1]
    stat = TensorInfo(x.dtype, (channels,))
    return {"Y": [TensorInfo(x.dtype, x.shape, x.lod_level)], "MeanOut": [stat], "VarianceOut": [stat],
            "SavedMean": [stat], "SavedVariance": [stat]}


def flatten_axes(ndim: int, start: int, stop: int) -> tuple[int, int]:
    """start/stop axes made non-negative (a 0-d input flattens to [1])."""
    if ndim == 0:
        return 0, 0
    start, stop = start + ndim if start < 0 else start, stop + ndim if stop < 0 else stop
    if not 0 <= start <= stop < ndim:
        raise ShapeError(f"flatten_contiguous_range: start_axis {start} / stop_axis {stop} do not fit {ndim} dims")
    return start, stop


def flatten_shape(shape: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    start, stop = flatten_axes(len(shape), start, stop)
    if not shape:
        return (1,)
    middle = shape[start:stop + 1]
    merged = -1 if any(d < 0 for d in middle) else math.prod(middle)
    return (*shape[:start], merged, *shape[stop + 1:])


def flatten_rule(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    out = flatten_shape(x.shape, int(ctx.attr("start_axis")), int(ctx.attr("stop_axis")))
    return {"Out": [TensorInfo(x.dtype, out, x.lod_level)], "XShape": [TensorInfo(x.dtype, (0, *x.shape))]}


# ------------------------------------------------------------------ the table

_CONV_ATTRS = {
    "strides": Ints([1, 1]),
    "paddings": Ints([0, 0]),
    "padding_algorithm": Str("EXPLICIT"),
    "groups": Int(1),
    "dilations": Ints([1, 1]),
    "data_format": Str("NCHW"),
    "use_cudnn": Bool(False),
    "use_mkldnn": Bool(False),
    "use_addto": Bool(False),
    "force_fp32_output": Bool(False),
    "workspace_size_MB": Int(512),
    "exhaustive_search": Bool(False),
    "is_test": Bool(False),
}


def _conv(name: str):
    grad = GradSpec(f"{name}_grad", inputs=("Input", "Filter"), out_grads=("Output",), in_grads=("Input", "Filter"))
    return op(name, "Input Filter Bias? ResidualData?", "Output", _CONV_ATTRS, grad=grad, infer=conv2d_shape)


OPS = (
    _conv("conv2d"),
    _conv("depthwise_conv2d"),
    op(
        "batch_norm",
        "X Scale Bias Mean Variance MomentumTensor?",
        "Y MeanOut VarianceOut SavedMean! SavedVariance! ReserveSpace?!",
        {
            "momentum": Float(0.9),
            "epsilon": Float(1e-5),
            "data_layout": Str("NCHW"),
            "is_test": Bool(False),
            "use_global_stats": Bool(False),
            "trainable_statistics": Bool(False),
            "fuse_with_relu": Bool(False),
            "use_mkldnn": Bool(False),
        },
        grad=GradSpec(
            "batch_norm_grad",
            inputs=("X", "Scale", "Bias"),
            outputs=("MeanOut", "VarianceOut", "SavedMean", "SavedVariance", "ReserveSpace"),
            out_grads=("Y",),
            in_grads=("X", "Scale", "Bias"),
        ),
        infer=batch_norm_shape,
    ),
    op(
        "pool2d",
        "X",
        "Out",
        {
            "pooling_type": Str(),
            "ksize": Ints(),
            "global_pooling": Bool(False),
            "strides": Ints([1, 1]),
            "paddings": Ints([0, 0]),
            "exclusive": Bool(True),
            "adaptive": Bool(False),
            "ceil_mode": Bool(False),
            "data_format": Str("NCHW"),
            "padding_algorithm": Str("EXPLICIT"),
            "use_cudnn": Bool(False),
            "use_mkldnn": Bool(False),
            "use_quantizer": Bool(False),
            "mkldnn_data_type": Str("float32"),
            "is_test": Bool(False),
        },
        grad=GradSpec("pool2d_grad", inputs=("X",), outputs=("Out",)),
        infer=pool2d_shape,
    ),
    op(
        "flatten_contiguous_range",
        "X",
        "Out XShape?!",
        {"start_axis": Int(1), "stop_axis": Int(1)},
        grad=GradSpec("flatten_contiguous_range_grad", outputs=("XShape",)),
        infer=flatten_rule,
    ),
)
