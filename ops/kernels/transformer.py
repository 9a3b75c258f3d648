"""Kernels of Paddle 2.x transformer models (BERT, GPT): `matmul_v2`, ... with their grads.

Semantics are Paddle 2.6's CPU kernels (phi); `tests/test_kernels_transformer.py` checks
each against Paddle 2.6 itself on the same inputs. Kernels keep their inputs' dtype.
"""

from __future__ import annotations

import numpy as np

from ops.catalogue.opdef import ShapeError
from ops.catalogue.transformer_ops import unsqueeze_dims
from ops.kernels.context import BATCH_SHARD, KernelError, OpContext  # BATCH_SHARD: the env key dropout reads
from ops.kernels.registry import register

# ---------------------------------------------------------------------- matmul_v2


def _t(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, -1, -2)


def _sum_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a grad over the batch dims `shape` was broadcast along (leading dims it lacks,
    and its size-1 dims that grew)."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad.reshape(shape)


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`a @ b` for a >= 2-D `a` and a 2-D `b`: one GEMM over the stacked rows (numpy's
    matmul would loop over the batch); otherwise numpy's batched matmul."""
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous:
        return (a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])
    return np.matmul(a, b)


def _check_matmul(ctx: OpContext, x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim == 0 or y.ndim == 0:
        raise KernelError(f"{ctx.type}: X {list(x.shape)} and Y {list(y.shape)} must have at least one dim")
    a, b = _operands(ctx, x, y)
    if a.shape[-1] != b.shape[-2]:
        raise KernelError(
            f"{ctx.type}: X {list(x.shape)} (trans_x={bool(ctx.attr('trans_x'))}) and Y {list(y.shape)} "
            f"(trans_y={bool(ctx.attr('trans_y'))}) cannot multiply: {a.shape[-1]} vs {b.shape[-2]}"
        )


def _operands(ctx: OpContext, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X and Y as >= 2-D matrices after `trans_*` (Paddle: a 1-D X is [1, K], a 1-D Y is
    [K, 1], and `trans_*` of a 1-D operand is ignored)."""
    a = x[np.newaxis, :] if x.ndim == 1 else (_t(x) if ctx.attr("trans_x") else x)
    b = y[:, np.newaxis] if y.ndim == 1 else (_t(y) if ctx.attr("trans_y") else y)
    return a, b


@register("matmul_v2")
def matmul_v2(ctx: OpContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    _check_matmul(ctx, x, y)
    a, b = _operands(ctx, x, y)
    try:
        out = _mm(a, b)
    except ValueError as exc:  # batch dims that do not broadcast
        raise KernelError(f"matmul_v2: X {list(x.shape)} and Y {list(y.shape)}: {exc}") from None
    if y.ndim == 1:
        out = out[..., 0]
    if x.ndim == 1:
        out = out[..., 0, :] if y.ndim > 1 else out[..., 0]
    ctx.set_output("Out", np.asarray(out, dtype=np.result_type(x, y), order="C"))  # keeps a 0-d Out 0-d


@register("matmul_v2_grad")
def matmul_v2_grad(ctx: OpContext) -> None:
    """dA = dOut @ B^T, dB = A^T @ dOut on the >= 2-D operands, then the transposes undone,
    the broadcast batch dims summed and the 1-D operands' dims dropped again."""
    x, y, dout = ctx.input("X"), ctx.input("Y"), ctx.input("Out@GRAD")
    _check_matmul(ctx, x, y)
    a, b = _operands(ctx, x, y)
    d = dout
    if x.ndim == 1:
        d = d[..., np.newaxis, :] if y.ndim > 1 else d[..., np.newaxis]
    if y.ndim == 1:
        d = d[..., np.newaxis]
    if ctx.has_output("X@GRAD"):
        da = _mm(d, _t(b))
        if x.ndim == 1:
            dx = _sum_to(da, (1, x.shape[0])).reshape(x.shape)
        else:
            dx = _sum_to(_t(da) if ctx.attr("trans_x") else da, x.shape)
        ctx.set_output("X@GRAD", np.asarray(dx, dtype=x.dtype, order="C"))
    if ctx.has_output("Y@GRAD"):
        if y.ndim <= 2:  # Y is shared by the whole batch: one GEMM over the stacked rows
            db = a.reshape(-1, a.shape[-1]).T @ d.reshape(-1, d.shape[-1])
        else:
            db = np.matmul(_t(a), d)
        if y.ndim == 1:
            dy = _sum_to(db, (y.shape[0], 1)).reshape(y.shape)
        else:
            dy = _sum_to(_t(db) if ctx.attr("trans_y") else db, y.shape)
        ctx.set_output("Y@GRAD", np.asarray(dy, dtype=y.dtype, order="C"))


# --------------------------------------------------------------------- layer_norm


def _rows(ctx: OpContext, x: np.ndarray) -> tuple[int, int]:
    axis = int(ctx.attr("begin_norm_axis"))
    if not 0 < axis < x.ndim:
        raise KernelError(f"{ctx.type}: begin_norm_axis={axis} does not fit X {list(x.shape)}")
    left = int(np.prod(x.shape[:axis], dtype=np.int64))
    return left, x.size // left if left else 0


def _norm_params(ctx: OpContext, right: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    scale, bias = ctx.optional_input("Scale"), ctx.optional_input("Bias")
    for name, value in (("Scale", scale), ("Bias", bias)):
        if value is not None and value.size != right:
            raise KernelError(f"{ctx.type}: {name} has {value.size} elements, X rows have {right}")
    return (None if scale is None else scale.reshape(-1)), (None if bias is None else bias.reshape(-1))


@register("layer_norm")
def layer_norm(ctx: OpContext) -> None:
    """Paddle's: each row of X flattened at `begin_norm_axis` normalised by its mean and
    biased variance, then `* Scale + Bias`; Mean and Variance (shaped like X's dims before
    `begin_norm_axis`, as Paddle 2.6's kernel writes them) kept for the grad."""
    x = ctx.input("X")
    left, right = _rows(ctx, x)
    scale, bias = _norm_params(ctx, right)
    x2 = x.reshape(left, right)
    mean = x2.mean(axis=1, keepdims=True)
    centred = x2 - mean
    var = np.square(centred).mean(axis=1, keepdims=True)
    y = centred / np.sqrt(var + x.dtype.type(ctx.attr("epsilon")))
    if scale is not None:
        y *= scale
    if bias is not None:
        y += bias
    ctx.set_output("Y", y.reshape(x.shape).astype(x.dtype, copy=False), lod=ctx.lod("X"))
    stats = x.shape[: int(ctx.attr("begin_norm_axis"))]  # Paddle 2.6's kernel: X's leading dims
    ctx.set_output("Mean", mean.reshape(stats))
    ctx.set_output("Variance", var.reshape(stats))


@register("layer_norm_grad")
def layer_norm_grad(ctx: OpContext) -> None:
    x, dy = ctx.input("X"), ctx.input("Y@GRAD")
    left, right = _rows(ctx, x)
    scale, _ = _norm_params(ctx, right)
    x2, dy2 = x.reshape(left, right), dy.reshape(left, right)
    mean, var = ctx.optional_input("Mean"), ctx.optional_input("Variance")
    if mean is None or var is None:
        mean = x2.mean(axis=1)
        var = np.square(x2 - mean[:, None]).mean(axis=1)
    std = np.sqrt(var.reshape(left, 1) + x.dtype.type(ctx.attr("epsilon")))
    xhat = (x2 - mean.reshape(left, 1)) / std
    if ctx.has_output("Scale@GRAD"):
        ctx.set_output("Scale@GRAD", (dy2 * xhat).sum(axis=0).astype(dy.dtype, copy=False))
    if ctx.has_output("Bias@GRAD"):
        ctx.set_output("Bias@GRAD", dy2.sum(axis=0))
    if ctx.has_output("X@GRAD"):
        dxhat = dy2 * scale if scale is not None else dy2
        dx = (dxhat - dxhat.mean(axis=1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=1, keepdims=True)) / std
        ctx.set_output("X@GRAD", dx.reshape(x.shape).astype(dy.dtype, copy=False), lod=ctx.lod("X"))


# ------------------------------------------------------------------------ dropout

_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finaliser (a bijection of uint64 with good avalanche): a seed to a key."""
    mask = 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def dropout_uniforms(key: int, shape: tuple[int, ...], first_row: int = 0) -> np.ndarray:
    """Uniform [0, 1) numbers for the elements of a `shape` tensor holding rows
    `first_row, first_row + 1, ...` (dim 0) of a larger batch: element `i` of that batch
    (flat index) is double `i` of the Philox4x64 stream keyed by `key` (counter-based:
    numpy's `Philox` makes the 4 doubles of counter `c + 1` after counter `c`), so a
    process holding any slice of the batch draws that slice's numbers, in C."""
    size = int(np.prod(shape, dtype=np.int64))
    row = size // shape[0] if shape and shape[0] else size
    start = first_row * row
    counter = np.array([start // 4, 0, 0, 0], dtype=np.uint64)
    bits = np.random.Philox(counter=counter, key=np.array([key & 0xFFFF_FFFF_FFFF_FFFF, 0x5EED], dtype=np.uint64))
    generator = np.random.Generator(bits)
    skip = start % 4
    if skip:
        generator.random(skip)
    return generator.random(size).reshape(shape)


def _dropout_key(ctx: OpContext) -> int:
    """The Seed input, else the `seed` attr under `fix_seed` (the same mask every run, as
    Paddle), else one draw from the executor's stream for this op (a pure function of the
    executor seed, the op's output name and the run count: the same in every process)."""
    if ctx.has_input("Seed"):
        seed = int(ctx.scalar("Seed"))
    elif ctx.attr("fix_seed"):
        seed = int(ctx.attr("seed"))
    else:
        return int(ctx.run.rng(ctx.output_names("Out")[0], 0).integers(0, 1 << 63))
    return _mix64((seed & 0xFFFF_FFFF_FFFF_FFFF) ^ _GOLDEN)


def _first_row(ctx: OpContext, x: np.ndarray) -> int:
    trainer, trainers = ctx.env.get(BATCH_SHARD, (0, 1))
    return int(trainer) * (x.shape[0] if x.ndim else 1) if trainers > 1 else 0


def _keep_factor(ctx: OpContext, dtype: np.dtype) -> np.generic:
    """Paddle's `static_cast<T>(1.0f - dropout_prob)` (float arithmetic, then T)."""
    return np.dtype(dtype).type(np.float32(1.0) - np.float32(ctx.attr("dropout_prob")))


def _implementation(ctx: OpContext) -> bool:
    """True for upscale_in_train, False for downgrade_in_infer."""
    impl = ctx.attr("dropout_implementation")
    if impl not in ("upscale_in_train", "downgrade_in_infer"):
        raise KernelError(f"{ctx.type}: unknown dropout_implementation {impl!r}")
    return impl == "upscale_in_train"


@register("dropout")
def dropout(ctx: OpContext) -> None:
    """Paddle 2.6's: in training an element is dropped with probability `dropout_prob`
    (Mask 0, uint8) and a kept one is divided by 1 - p under upscale_in_train; under
    `is_test` upscale_in_train passes X through and downgrade_in_infer scales by 1 - p."""
    x = ctx.input("X")
    upscale = _implementation(ctx)
    p = float(np.float32(ctx.attr("dropout_prob")))
    if not 0.0 <= p <= 1.0:
        raise KernelError(f"dropout: dropout_prob must be in [0, 1], got {p}")
    if ctx.attr("is_test"):
        ctx.set_output("Out", x if upscale else x * _keep_factor(ctx, x.dtype), lod=ctx.lod("X"))
        return
    mask = (dropout_uniforms(_dropout_key(ctx), x.shape, _first_row(ctx, x)) >= p).view(np.uint8)
    if upscale and p == 1.0:
        out = np.zeros_like(x)
    else:  # x / (1 - p) (or x) times the 0/1 mask: a dropped element is 0 (-0 for a negative x)
        out = np.divide(x, _keep_factor(ctx, x.dtype)) if upscale else x.copy()
        np.multiply(out, mask, out=out, casting="unsafe")
    ctx.set_output("Out", out, lod=ctx.lod("X"))
    ctx.set_output("Mask", mask)


@register("dropout_grad")
def dropout_grad(ctx: OpContext) -> None:
    dout = ctx.input("Out@GRAD")
    upscale = _implementation(ctx)
    if ctx.attr("is_test"):
        dx = dout if upscale else dout * _keep_factor(ctx, dout.dtype)
    else:
        mask = ctx.input("Mask")
        if mask.shape != dout.shape:
            raise KernelError(f"dropout_grad: Mask {list(mask.shape)} and Out@GRAD {list(dout.shape)} differ")
        if upscale:
            p = float(np.float32(ctx.attr("dropout_prob")))
            dx = np.zeros_like(dout) if p == 1.0 else dout * mask.astype(dout.dtype) / _keep_factor(ctx, dout.dtype)
        else:
            dx = dout * mask.astype(dout.dtype)
    ctx.set_output("X@GRAD", np.asarray(dx, dtype=dout.dtype), lod=ctx.lod("Out@GRAD"))


# --------------------------------------------------------------------------- gelu

_ERF: list = []  # (erf, is_ufunc), found at the first gelu: importing scipy.special costs every process ~0.4 s


def _erf_function() -> tuple:
    """scipy's erf (vectorised C) when scipy is installed; else math.erf per element (~40x
    slower, the same values to 1 ulp)."""
    if not _ERF:
        try:
            from scipy.special import erf  # noqa: PLC0415 - lazy: only programs with gelu need it

            _ERF.append((erf, True))
        except ImportError:  # pragma: no cover - scipy comes with the examples' scikit-learn
            import math  # noqa: PLC0415

            _ERF.append((np.vectorize(math.erf, otypes=[np.float64]), False))
    return _ERF[0]


_SQRT1_2 = 0.70710678118654752440
_2_SQRTPI = 1.12837916709551257390
_GELU_C = 0.044715


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    """erf(x / sqrt 2) as a new array of X's dtype."""
    erf, ufunc = _erf_function()
    scaled = x * x.dtype.type(_SQRT1_2)
    return np.asarray(erf(scaled, out=scaled) if ufunc else erf(scaled), dtype=x.dtype)


@register("gelu")
def gelu(ctx: OpContext) -> None:
    """`x * 0.5 * (1 + erf(x / sqrt 2))`, or with `approximate` the tanh form
    `x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))` (Paddle's GeluFunctor)."""
    x = ctx.input("X")
    t = x.dtype.type
    if ctx.attr("approximate"):
        inner = np.tanh(t(_2_SQRTPI * _SQRT1_2) * (x + t(_GELU_C) * x * x * x))
        out = x * t(0.5) * (t(1) + inner)
    else:  # in place: (1 + erf(x / sqrt 2)) * x * 0.5 (scaling by 0.5 is exact: the same value)
        out = _gelu_erf(x)
        out += t(1)
        out *= x
        out *= t(0.5)
    ctx.set_output("Out", out.astype(x.dtype, copy=False), lod=ctx.lod("X"))


@register("gelu_grad")
def gelu_grad(ctx: OpContext) -> None:
    x, dout = ctx.input("X"), ctx.input("Out@GRAD")
    t = x.dtype.type
    if ctx.attr("approximate"):
        alpha = t(_2_SQRTPI * _SQRT1_2)
        beta = t(_2_SQRTPI * _SQRT1_2 * _GELU_C * 3)
        x2 = x * x
        th = np.tanh(alpha * (x * (t(_GELU_C) * x2 + t(1))))
        dx = dout * t(0.5) * (t(1) + th + (t(1) - th * th) * (x * (alpha + beta * x2)))
    else:  # 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi), in place
        dx = _gelu_erf(x)
        dx += t(1)
        dx *= t(0.5)
        second = x * x
        second *= t(-0.5)
        np.exp(second, out=second)
        second *= x
        second *= t(0.5 * _2_SQRTPI * _SQRT1_2)
        dx += second
        dx *= dout
    ctx.set_output("X@GRAD", dx.astype(dout.dtype, copy=False), lod=ctx.lod("X"))


# -------------------------------------------------------------------------- slice


def _int_list(ctx: OpContext, tensor_slot: str, list_slot: str, attr: str) -> list[int]:
    if ctx.has_input(tensor_slot):
        return [int(v) for v in ctx.input(tensor_slot).reshape(-1)]
    if ctx.has_input(list_slot):
        return [int(a.reshape(-1)[0]) for a in ctx.inputs(list_slot)]
    return [int(v) for v in ctx.attr(attr)]


def _slice_index(ctx: OpContext, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], list[int]]:
    """The index of Input's slice and the slice's shape before `decrease_axis`
    (Paddle's `CheckAndUpdateSliceAttrs`: negative bounds count from the end, clamped)."""
    axes = [int(a) for a in ctx.attr("axes")]
    starts = _int_list(ctx, "StartsTensor", "StartsTensorList", "starts")
    ends = _int_list(ctx, "EndsTensor", "EndsTensorList", "ends")
    if not len(axes) == len(starts) == len(ends):
        raise KernelError(f"{ctx.type}: axes {axes}, starts {starts} and ends {ends} differ in length")
    index = [slice(None)] * len(shape)
    dims = list(shape)
    for axis, start, end in zip(axes, starts, ends, strict=True):
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis < len(shape):
            raise KernelError(f"{ctx.type}: axis {axis} is out of range for Input {list(shape)}")
        dim = shape[axis]
        start = min(dim, max(0, start + dim if start < 0 else start))
        end = max(0, min(dim, end + dim if end < 0 else end))
        if end < start:
            raise KernelError(f"{ctx.type}: on axis {axis} (size {dim}) end {end} is before start {start}")
        index[axis] = slice(start, end)
        dims[axis] = end - start
    return tuple(index), dims


def _decreased(ctx: OpContext, dims: list[int]) -> list[int]:
    decrease = {int(a) + len(dims) if int(a) < 0 else int(a) for a in ctx.attr("decrease_axis")}
    for a in decrease:
        if not 0 <= a < len(dims) or dims[a] != 1:
            raise KernelError(f"{ctx.type}: decrease_axis {a} must name a dim of size 1, the slice is {dims}")
    return [d for i, d in enumerate(dims) if i not in decrease]


@register("slice")
def slice_kernel(ctx: OpContext) -> None:
    x = ctx.input("Input")
    index, dims = _slice_index(ctx, x.shape)
    out = np.ascontiguousarray(x[index]).reshape(_decreased(ctx, dims))
    ctx.set_output("Out", out)


@register("slice_grad")
def slice_grad(ctx: OpContext) -> None:
    x, dout = ctx.input("Input"), ctx.input("Out@GRAD")
    index, dims = _slice_index(ctx, x.shape)
    dx = np.zeros(x.shape, dtype=dout.dtype)
    dx[index] = dout.reshape(dims)
    ctx.set_output("Input@GRAD", dx, lod=ctx.lod("Input"))


# ---------------------------------------------------------- range, tril_triu, unsqueeze2


@register("range")
def range_kernel(ctx: OpContext) -> None:
    """Paddle's: `ceil(|end - start| / |step|)` values (integer arithmetic for integer
    types), accumulated `start, start + step, ...` in Start's dtype."""
    start, end, step = ctx.scalar("Start"), ctx.scalar("End"), ctx.scalar("Step")
    dtype = ctx.input("Start").dtype
    if step == 0:
        raise KernelError("range: Step must not be 0")
    if (end - start) * step < 0:
        raise KernelError(f"range: Step {step} goes away from End {end} starting at {start}")
    if np.issubdtype(dtype, np.integer):
        size = (abs(int(end) - int(start)) + abs(int(step)) - 1) // abs(int(step))
    else:
        size = int(np.ceil(abs((end - start) / step)))
    values = np.full(size, step, dtype=dtype)
    if size:
        values[0] = start
    ctx.set_output("Out", np.add.accumulate(values, dtype=dtype))


def _tril_triu(ctx: OpContext, x: np.ndarray) -> np.ndarray:
    if x.ndim < 2:
        raise KernelError(f"{ctx.type}: X must have at least 2 dims, got {list(x.shape)}")
    k = int(ctx.attr("diagonal"))
    return np.tril(x, k) if ctx.attr("lower") else np.triu(x, k)


@register("tril_triu")
def tril_triu(ctx: OpContext) -> None:
    ctx.set_output("Out", _tril_triu(ctx, ctx.input("X")), lod=ctx.lod("X"))


@register("tril_triu_grad")
def tril_triu_grad(ctx: OpContext) -> None:
    ctx.set_output("X@GRAD", _tril_triu(ctx, ctx.input("Out@GRAD")), lod=ctx.lod("Out@GRAD"))


def _unsqueeze_shape(ctx: OpContext, shape: tuple[int, ...]) -> list[int]:
    axes = _int_list(ctx, "AxesTensor", "AxesTensorList", "axes")
    try:
        return unsqueeze_dims(list(shape), axes)
    except ShapeError as exc:
        raise KernelError(str(exc)) from None


@register("unsqueeze2")
def unsqueeze2(ctx: OpContext) -> None:
    x = ctx.input("X")
    ctx.set_output("Out", x.reshape(_unsqueeze_shape(ctx, x.shape)), lod=ctx.lod("X"))
    ctx.set_output("XShape", np.zeros((0, *x.shape), dtype=x.dtype))


@register("unsqueeze2_grad")
def unsqueeze2_grad(ctx: OpContext) -> None:
    dout = ctx.input("Out@GRAD")
    ctx.set_output("X@GRAD", dout.reshape(ctx.input("XShape").shape[1:]))


# ---------------------------------------------------------------- squared_l2_norm


@register("squared_l2_norm")
def squared_l2_norm(ctx: OpContext) -> None:
    """`sum(X * X)` as a one-element tensor (a global-norm clip's per-grad term)."""
    x = ctx.input("X")
    flat = x.reshape(-1)
    ctx.set_output("Out", np.asarray([np.dot(flat, flat)], dtype=x.dtype))


@register("squared_l2_norm_grad")
def squared_l2_norm_grad(ctx: OpContext) -> None:
    x, dout = ctx.input("X"), ctx.input("Out@GRAD")
    if dout.size != 1:
        raise KernelError(f"squared_l2_norm_grad: Out@GRAD must hold one element, got {list(dout.shape)}")
    ctx.set_output("X@GRAD", x * (dout.reshape(-1)[0] * x.dtype.type(2)))
