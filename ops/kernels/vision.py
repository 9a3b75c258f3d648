"""Vision kernels with Paddle 2.6's CPU semantics: `conv2d` / `depthwise_conv2d`,
`batch_norm`, `pool2d`, `flatten_contiguous_range`, and their grads.

Convolution is im2col + matmul: the windows are an `as_strided` view of the padded input
(no copy), gathered once into [N, groups, C/g*kh*kw, OH*OW] columns (none for a 1x1
stride-1 unpadded conv, where the columns are the input itself) and multiplied by the
filter as [groups, M/g, C/g*kh*kw] in one batched matmul: the output comes out NCHW
without a transpose. The grads are two more matmuls and a col2im that adds kh*kw shifted
slices. NHWC is NCHW with the input and output transposed. Pools run kh*kw shifted
slices too (adaptive pools loop over their output cells). Window arithmetic
(paddings, `SAME` / `VALID`, output sizes) is ops/catalogue/vision_ops.py's.

batch_norm keeps Paddle's conventions: the batch variance is biased (divided by N*H*W),
`SavedVariance` holds 1/sqrt(var + epsilon) (not the variance), the moving stats become
`Mean * momentum + batch_mean * (1 - momentum)` (`MomentumTensor` overrides the attr), and
the running stats are used instead of the batch's when `use_global_stats`, or `is_test`
without `trainable_statistics`.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ops.catalogue.opdef import ShapeError
from ops.catalogue.vision_ops import (
    channel_last,
    conv_geometry,
    conv_out_size,
    flatten_shape,
    pool_geometry,
)
from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register

def _layout(ctx: OpContext, attr: str) -> bool:
    try:
        return channel_last(str(ctx.attr(attr)), ctx.type)
    except ShapeError as exc:
        raise KernelError(str(exc)) from None


def _to_nchw(x: np.ndarray, last: bool) -> np.ndarray:
    return x.transpose(0, 3, 1, 2) if last else x


def _from_nchw(x: np.ndarray, last: bool) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if last else x


def _pad(x: np.ndarray, pads: list[tuple[int, int]], value: float = 0.0) -> np.ndarray:
    if not any(lo or hi for lo, hi in pads):
        return x
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        raise KernelError(f"negative paddings {pads} are not supported")
    (top, bottom), (left, right) = pads
    h, w = x.shape[2:]
    out = np.empty((*x.shape[:2], h + top + bottom, w + left + right), dtype=x.dtype)
    out[:, :, :top], out[:, :, top + h:] = value, value  # the borders only (np.pad is slower)
    out[:, :, top:top + h, :left], out[:, :, top:top + h, left + w:] = value, value
    out[:, :, top:top + h, left:left + w] = x
    return out


# ------------------------------------------------------------------ convolution


class _Conv:
    """One conv's geometry, worked out from its input and filter shapes (NCHW)."""

    def __init__(self, ctx: OpContext, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> None:
        if len(x_shape) != 4 or len(w_shape) != 4:
            raise KernelError(f"{ctx.type}: needs a 4-D input and filter, got {list(x_shape)} and {list(w_shape)}")
        self.n, self.c, self.h, self.w = x_shape
        self.m, cg, self.kh, self.kw = w_shape
        self.groups = int(ctx.attr("groups")) or 1
        if cg * self.groups != self.c or self.m % self.groups:
            raise KernelError(f"{ctx.type}: input {list(x_shape)} and filter {list(w_shape)} do not fit "
                              f"groups={self.groups}")
        try:
            strides, dilations, pads = conv_geometry(ctx.type, {k: ctx.attr(k) for k in (
                "strides", "dilations", "paddings", "padding_algorithm")}, (self.h, self.w), (self.kh, self.kw))
        except ShapeError as exc:
            raise KernelError(str(exc)) from None
        (self.sh, self.sw), (self.dh, self.dw), self.pads = strides, dilations, pads
        self.oh = conv_out_size(self.h, self.kh, pads[0], self.sh, self.dh)
        self.ow = conv_out_size(self.w, self.kw, pads[1], self.sw, self.dw)
        if self.oh <= 0 or self.ow <= 0:
            raise KernelError(f"{ctx.type}: input {list(x_shape)} is smaller than the filter's window")
        self.k = cg * self.kh * self.kw  # one column's length per group

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, no padding: the columns are the input itself."""
        return (self.kh == self.kw == self.sh == self.sw == 1) and not any(lo or hi for lo, hi in self.pads)

    def columns(self, x: np.ndarray) -> np.ndarray:
        """[N, groups, C/g*kh*kw, OH*OW]: each output pixel's window, channel-major."""
        g, l_ = self.groups, self.oh * self.ow
        if self.pointwise:
            return x.reshape(self.n, g, self.k, l_)
        xp = _pad(x, self.pads)
        sn, sc, sh, sw = xp.strides
        windows = as_strided(
            xp, (self.n, self.c, self.kh, self.kw, self.oh, self.ow),
            (sn, sc, sh * self.dh, sw * self.dw, sh * self.sh, sw * self.sw), writeable=False,
        )
        return windows.reshape(self.n, g, self.k, l_)  # the copy: im2col

    def filters(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(self.groups, self.m // self.groups, self.k)

    def col2im(self, cols: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The input grad from the columns' grads: each window position adds its slice."""
        if self.pointwise:
            return cols.reshape(self.n, self.c, self.h, self.w)
        (top, bottom), (left, right) = self.pads
        dxp = np.zeros((self.n, self.c, self.h + top + bottom, self.w + left + right), dtype=dtype)
        cols = cols.reshape(self.n, self.c, self.kh, self.kw, self.oh, self.ow)
        h_span, w_span = self.sh * (self.oh - 1) + 1, self.sw * (self.ow - 1) + 1
        for i in range(self.kh):
            for j in range(self.kw):
                hi, wj = i * self.dh, j * self.dw
                dxp[:, :, hi:hi + h_span:self.sh, wj:wj + w_span:self.sw] += cols[:, :, i, j]
        return dxp[:, :, top:top + self.h, left:left + self.w]


def _conv_inputs(ctx: OpContext) -> tuple[np.ndarray, np.ndarray, bool, _Conv]:
    last = _layout(ctx, "data_format")
    x = _to_nchw(ctx.input("Input"), last)
    w = ctx.input("Filter")
    return x, w, last, _Conv(ctx, x.shape, w.shape)


def conv2d(ctx: OpContext) -> None:
    if ctx.has_input("Bias") or ctx.has_input("ResidualData"):
        raise KernelError(f"{ctx.type}: the oneDNN-only Bias / ResidualData inputs are not supported")
    x, w, last, conv = _conv_inputs(ctx)
    out = np.matmul(conv.filters(w), conv.columns(x))  # [N, g, M/g, OH*OW]
    ctx.set_output("Output", _from_nchw(out.reshape(conv.n, conv.m, conv.oh, conv.ow), last))


def conv2d_grad(ctx: OpContext) -> None:
    x, w, last, conv = _conv_inputs(ctx)
    dout = _to_nchw(ctx.input("Output@GRAD"), last)
    dout = np.ascontiguousarray(dout).reshape(conv.n, conv.groups, conv.m // conv.groups, conv.oh * conv.ow)
    if ctx.has_output("Filter@GRAD"):
        cols = conv.columns(x)
        # the sum over the batch of dOut[n] @ cols[n]^T: one GEMM per example, then a sum of
        # N filter-sized arrays (einsum took 10x longer; one (N*OH*OW)-long GEMM needs a
        # transposed copy of the columns)
        dw = np.matmul(dout, cols.swapaxes(-1, -2)).sum(axis=0)
        ctx.set_output("Filter@GRAD", dw.reshape(w.shape).astype(w.dtype, copy=False))
    if ctx.has_output("Input@GRAD"):
        dcols = np.matmul(conv.filters(w).swapaxes(-1, -2), dout)  # [N, g, K, OH*OW]
        dx = conv.col2im(dcols, x.dtype)
        ctx.set_output("Input@GRAD", _from_nchw(np.ascontiguousarray(dx), last))


for _name in ("conv2d", "depthwise_conv2d"):
    register(_name)(conv2d)
    register(f"{_name}_grad")(conv2d_grad)


# ------------------------------------------------------------------ batch norm


class _Norm:
    """The axes a batch norm reduces over and how a per-channel vector broadcasts."""

    def __init__(self, ctx: OpContext, x: np.ndarray) -> None:
        if x.ndim < 2:
            raise KernelError(f"batch_norm: X must have at least 2 dims, got shape {list(x.shape)}")
        last = _layout(ctx, "data_layout")
        self.axis = x.ndim - 1 if last else 1
        self.axes = tuple(a for a in range(x.ndim) if a != self.axis)
        self.channels = x.shape[self.axis]
        self.shape = tuple(self.channels if a == self.axis else 1 for a in range(x.ndim))
        self.count = x.size // self.channels if self.channels else 0
        # [N, C, H*W] (channel first) or [N*H*W, C]: the reductions run over contiguous rows
        self.rows = (x.shape[0], self.channels, -1) if self.axis == 1 and x.ndim > 2 else (-1, self.channels)

    def b(self, v: np.ndarray) -> np.ndarray:
        return v.reshape(self.shape)

    def sum(self, v: np.ndarray) -> np.ndarray:
        """Per channel sum (numpy's sum over axes (0, 2, 3) of NCHW is ~3x slower)."""
        v = v.reshape(self.rows)
        return v.sum(axis=2).sum(axis=0) if v.ndim == 3 else v.sum(axis=0)

    def dot(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per channel sum of a * b, without the product's temporary."""
        a, b = a.reshape(self.rows), b.reshape(self.rows)
        return np.einsum("ncl,ncl->c", a, b) if a.ndim == 3 else np.einsum("lc,lc->c", a, b)


def _float_attr(ctx: OpContext, name: str, dtype: np.dtype):
    """A FLOAT attr as Paddle's kernel sees it: a float32 (then widened to the tensor's type)."""
    return dtype.type(np.float32(ctx.attr(name)))


def _global_stats(ctx: OpContext) -> bool:
    """Paddle's `test_mode = is_test && !trainable_statistics`; `use_global_stats` also."""
    return bool(ctx.attr("use_global_stats")) or (bool(ctx.attr("is_test")) and not ctx.attr("trainable_statistics"))


@register("batch_norm")
def batch_norm(ctx: OpContext) -> None:
    x = ctx.input("X")
    norm = _Norm(ctx, x)
    scale, bias = ctx.input("Scale"), ctx.input("Bias")
    mean, var = ctx.input("Mean"), ctx.input("Variance")
    eps = _float_attr(ctx, "epsilon", x.dtype)
    if _global_stats(ctx):
        inv_std = 1.0 / np.sqrt(var + eps)
        y = (x - norm.b(mean)) * norm.b(inv_std * scale) + norm.b(bias)
        ctx.set_output("Y", y.astype(x.dtype, copy=False))
        ctx.set_output("MeanOut", mean)
        ctx.set_output("VarianceOut", var)
        # Paddle allocates these and leaves them unset here (its grad reads MeanOut/VarianceOut).
        ctx.set_output("SavedMean", np.zeros_like(mean))
        ctx.set_output("SavedVariance", np.zeros_like(var))
        return
    if norm.count == 0:
        raise KernelError(f"batch_norm: X of shape {list(x.shape)} has no elements to take statistics of")
    if ctx.has_input("MomentumTensor"):
        momentum = x.dtype.type(ctx.scalar("MomentumTensor"))
    else:
        momentum = _float_attr(ctx, "momentum", x.dtype)
    batch_mean = norm.sum(x) / x.dtype.type(norm.count)
    centred = x - norm.b(batch_mean)
    batch_var = norm.dot(centred, centred) / x.dtype.type(norm.count)
    inv_std = 1.0 / np.sqrt(batch_var + eps)
    y = centred * norm.b(inv_std * scale) + norm.b(bias)
    one = x.dtype.type(1)
    ctx.set_output("Y", y.astype(x.dtype, copy=False))
    ctx.set_output("MeanOut", (mean * momentum + batch_mean * (one - momentum)).astype(mean.dtype, copy=False))
    ctx.set_output("VarianceOut", (var * momentum + batch_var * (one - momentum)).astype(var.dtype, copy=False))
    ctx.set_output("SavedMean", batch_mean.astype(x.dtype, copy=False))
    ctx.set_output("SavedVariance", inv_std.astype(x.dtype, copy=False))


@register("batch_norm_grad")
def batch_norm_grad(ctx: OpContext) -> None:
    x, dy = ctx.input("X"), ctx.input("Y@GRAD")
    norm = _Norm(ctx, x)
    scale = ctx.input("Scale")
    dbias = norm.sum(dy)
    # Paddle's grad kernel takes `is_test` alone as global stats (trainable_statistics or
    # not): it then differentiates through MeanOut / VarianceOut, the updated moving stats.
    if bool(ctx.attr("use_global_stats")) or bool(ctx.attr("is_test")):
        eps = _float_attr(ctx, "epsilon", x.dtype)
        mean = ctx.input("MeanOut")
        inv_std = 1.0 / np.sqrt(ctx.input("VarianceOut") + eps)
        dscale = norm.dot(dy, x - norm.b(mean)) * inv_std
        dx = dy * norm.b(scale * inv_std)
    else:
        # dx = scale * inv_std / m * (m * dy - dbias - xhat * dscale), xhat = (x - mean) * inv_std,
        # as three per-channel coefficients: dx = a * dy + b * (x - mean) + c
        mean, inv_std = ctx.input("SavedMean"), ctx.input("SavedVariance")
        centred = x - norm.b(mean)
        dscale = norm.dot(dy, centred) * inv_std
        m = x.dtype.type(norm.count)
        a = scale * inv_std
        dx = dy * norm.b(a)
        dx += centred * norm.b(-a * inv_std * dscale / m)
        dx += norm.b(-a * dbias / m)
    ctx.set_output("X@GRAD", dx.astype(x.dtype, copy=False))
    ctx.set_output("Scale@GRAD", dscale.astype(scale.dtype, copy=False))
    ctx.set_output("Bias@GRAD", dbias.astype(scale.dtype, copy=False))


# ------------------------------------------------------------------ pooling


class _Pool:
    """One pool2d's geometry (NCHW) from its input's shape."""

    def __init__(self, ctx: OpContext, shape: tuple[int, ...]) -> None:
        if len(shape) != 4:
            raise KernelError(f"pool2d: X must be 4-D, got shape {list(shape)}")
        self.kind = str(ctx.attr("pooling_type"))
        if self.kind not in ("max", "avg"):
            raise KernelError(f"pool2d: pooling_type {self.kind!r} is not max or avg")
        self.h, self.w = shape[2:]
        attrs = {k: ctx.attr(k) for k in ("ksize", "strides", "paddings", "padding_algorithm", "global_pooling",
                                          "adaptive", "ceil_mode")}
        try:
            ksize, strides, pads, out = pool_geometry(ctx.type, attrs, (self.h, self.w))
        except ShapeError as exc:
            raise KernelError(str(exc)) from None
        # Paddle's pool2d kernel passes adaptive=false to its max functor: a max pool2d with
        # `adaptive` slides a ksize window by `strides` from the corner, unpadded, to an
        # output of ksize cells (paddle.nn.functional.adaptive_max_pool2d builds another op,
        # max_pool2d_with_index, that pools adaptively). Its numbers are Paddle's, so ours too.
        self.adaptive = bool(attrs["adaptive"]) and not attrs["global_pooling"] and self.kind == "avg"
        (self.kh, self.kw), (self.sh, self.sw), self.pads, (self.oh, self.ow) = ksize, strides, pads, out
        if self.oh <= 0 or self.ow <= 0:
            raise KernelError(f"pool2d: input {list(shape)} gives an empty output {[self.oh, self.ow]}")
        self.exclusive = bool(ctx.attr("exclusive"))

    def windows(self) -> list[tuple[slice, slice]]:
        """Adaptive pooling: each output cell's rows and columns (Paddle's AdaptStart/EndIndex)."""
        rows = [slice(i * self.h // self.oh, -(-(i + 1) * self.h // self.oh)) for i in range(self.oh)]
        cols = [slice(j * self.w // self.ow, -(-(j + 1) * self.w // self.ow)) for j in range(self.ow)]
        return [(r, c) for r in rows for c in cols]

    def padded(self, x: np.ndarray, value: float) -> tuple[np.ndarray, int, int]:
        """X padded so every window lies inside: (padded, top, left)."""
        (top, _), (left, _) = self.pads
        bottom = max(0, (self.oh - 1) * self.sh + self.kh - top - self.h)
        right = max(0, (self.ow - 1) * self.sw + self.kw - left - self.w)
        return _pad(x, [(top, bottom), (left, right)], value), top, left

    def slices(self):
        """(i, j, rows, cols): the input cells window offset (i, j) covers for every output cell."""
        h_span, w_span = self.sh * (self.oh - 1) + 1, self.sw * (self.ow - 1) + 1
        for i in range(self.kh):
            for j in range(self.kw):
                yield slice(i, i + h_span, self.sh), slice(j, j + w_span, self.sw)

    def counts(self) -> np.ndarray:
        """What each output's average divides by, as Paddle's CPU kernel counts: the window
        cells inside the input (exclusive), else the cells inside the input and its leading
        padding, which Paddle also uses as the trailing one (so a `ceil_mode` window past
        the end counts less than kh*kw)."""
        (top, _), (left, _) = self.pads

        def cells(out: int, k: int, s: int, pad: int, size: int) -> np.ndarray:
            start = np.arange(out) * s - pad
            if self.exclusive:
                return np.minimum(start + k, size) - np.maximum(start, 0)
            return np.minimum(start + k, size + pad) - start

        return np.outer(cells(self.oh, self.kh, self.sh, top, self.h), cells(self.ow, self.kw, self.sw, left, self.w))

    @staticmethod
    def grad_scale(counts: np.ndarray | int, dtype: np.dtype) -> np.ndarray:
        """1 / count as Paddle's avg-pool grad applies it: computed in float32 (its
        `float scale`), whatever the tensor's type."""
        return (np.float32(1.0) / np.asarray(counts, dtype=np.float32)).astype(dtype)


def _pool_input(ctx: OpContext) -> tuple[np.ndarray, bool, _Pool]:
    last = _layout(ctx, "data_format")
    x = _to_nchw(ctx.input("X"), last)
    return x, last, _Pool(ctx, x.shape)


@register("pool2d")
def pool2d(ctx: OpContext) -> None:
    x, last, pool = _pool_input(ctx)
    n, c = x.shape[:2]
    if pool.adaptive:
        out = np.empty((n, c, pool.oh * pool.ow), dtype=x.dtype)
        for k, (rows, cols) in enumerate(pool.windows()):
            cell = x[:, :, rows, cols]
            out[:, :, k] = cell.max(axis=(2, 3)) if pool.kind == "max" else cell.mean(axis=(2, 3))
        ctx.set_output("Out", _from_nchw(out.reshape(n, c, pool.oh, pool.ow), last))
        return
    maximum = pool.kind == "max"
    xp, _, _ = pool.padded(x, -np.inf if maximum else 0.0)
    out = None
    for rows, cols in pool.slices():
        part = xp[:, :, rows, cols]
        if out is None:
            out = part.copy()
        elif maximum:
            np.maximum(out, part, out=out)
        else:
            out += part
    if not maximum:
        out /= pool.counts().astype(x.dtype)
    ctx.set_output("Out", _from_nchw(out, last))


@register("pool2d_grad")
def pool2d_grad(ctx: OpContext) -> None:
    """Max: each output's grad goes to the first cell of its window (row by row) holding
    the max, as Paddle's CPU kernel does. Avg: spread evenly over what the average divided by."""
    x, last, pool = _pool_input(ctx)
    out = _to_nchw(ctx.input("Out"), last)
    dout = _to_nchw(ctx.input("Out@GRAD"), last)
    maximum = pool.kind == "max"
    if pool.adaptive:
        dx = np.zeros_like(x)
        n, c = x.shape[:2]
        flat_out, flat_dout = out.reshape(n, c, -1), dout.reshape(n, c, -1)
        for k, (rows, cols) in enumerate(pool.windows()):
            cell = x[:, :, rows, cols]
            if maximum:
                size = cell.shape[2] * cell.shape[3]
                first = (cell.reshape(n, c, size) == flat_out[:, :, k, None]).argmax(axis=2)
                hit = np.zeros((n, c, size), dtype=x.dtype)
                np.put_along_axis(hit, first[:, :, None], flat_dout[:, :, k, None], axis=2)
                dx[:, :, rows, cols] += hit.reshape(cell.shape)
            else:
                share = flat_dout[:, :, k] * pool.grad_scale(cell.shape[2] * cell.shape[3], x.dtype)
                dx[:, :, rows, cols] += share[:, :, None, None]
        ctx.set_output("X@GRAD", _from_nchw(dx, last))
        return
    xp, top, left = pool.padded(x, -np.inf if maximum else 0.0)
    dxp = np.zeros(xp.shape, dtype=x.dtype)
    if maximum:
        found = np.zeros(out.shape, dtype=bool)
        for rows, cols in pool.slices():
            hit = (xp[:, :, rows, cols] == out) & ~found
            dxp[:, :, rows, cols] += np.where(hit, dout, 0)
            found |= hit
    else:
        share = dout * pool.grad_scale(pool.counts(), x.dtype)
        for rows, cols in pool.slices():
            dxp[:, :, rows, cols] += share
    dx = np.ascontiguousarray(dxp[:, :, top:top + pool.h, left:left + pool.w])
    ctx.set_output("X@GRAD", _from_nchw(dx, last))


# ------------------------------------------------------------------ flatten


@register("flatten_contiguous_range")
def flatten_contiguous_range(ctx: OpContext) -> None:
    x = ctx.input("X")
    try:
        shape = flatten_shape(x.shape, int(ctx.attr("start_axis")), int(ctx.attr("stop_axis")))
    except ShapeError as exc:
        raise KernelError(str(exc)) from None
    ctx.set_output("Out", x.reshape(shape), lod=ctx.lod("X"))
    ctx.set_output("XShape", np.zeros((0, *x.shape), dtype=x.dtype))


@register("flatten_contiguous_range_grad")
def flatten_contiguous_range_grad(ctx: OpContext) -> None:
    ctx.set_output("X@GRAD", ctx.input("Out@GRAD").reshape(ctx.input("XShape").shape[1:]))
