"""Random initializers: `uniform_random`, `gaussian_random`,
`truncated_gaussian_random`.

Seeds: a non-zero `seed` attr gives the same numbers on every run (a generator seeded
with it, as Paddle does); `seed` 0 draws from the executor's stream (see `Executor`:
deterministic for a given executor seed and output var name, or OS entropy with
`Executor(seed=None)`). Into a var declared SELECTED_ROWS (a pserver's sparse table) the
tensor becomes the table's preallocated rows, and the same generator keeps growing it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ops import catalogue
from ops.kernels.context import OpContext
from ops.kernels.registry import register
from ops.kernels.tensor_ops import np_dtype, shape_from, store_created

Sampler = Callable[[tuple[int, ...]], np.ndarray]


def _draw_dtype(dtype: np.dtype) -> type:
    """numpy's generators draw float32 or float64; other float types are cast after."""
    return np.float32 if dtype == np.float32 else np.float64


def _create(ctx: OpContext, sample: Sampler) -> tuple[np.ndarray, Callable[[int], np.ndarray] | None]:
    """The tensor of the op's dtype and shape, and a row sampler to grow a table with."""
    dtype = np_dtype(ctx.attr("dtype"))
    shape = shape_from(ctx)
    array = sample(shape).astype(dtype, copy=False)
    grow = (lambda n: sample((n, *shape[1:])).astype(dtype, copy=False)) if shape else None
    return array, grow


@register("uniform_random")
def uniform_random(ctx: OpContext) -> None:
    low, high = float(ctx.attr("min")), float(ctx.attr("max"))
    rng = ctx.rng()
    draw = _draw_dtype(np_dtype(ctx.attr("dtype")))

    def sample(shape: tuple[int, ...]) -> np.ndarray:
        return rng.random(shape, dtype=draw) * draw(high - low) + draw(low)

    array, grow = _create(ctx, sample)
    diag_num, diag_step = int(ctx.attr("diag_num")), int(ctx.attr("diag_step"))
    if diag_num > 0:  # Paddle sets data[i * diag_step + i] = diag_val for i < diag_num
        flat = array.reshape(-1)
        flat[np.arange(diag_num) * (diag_step + 1)] = ctx.attr("diag_val")
    store_created(ctx, array, grow)




@register("gaussian_random")
def gaussian_random(ctx: OpContext) -> None:
    mean, std = float(ctx.attr("mean")), float(ctx.attr("std"))
    rng = ctx.rng()
    draw = _draw_dtype(np_dtype(ctx.attr("dtype")))

    def sample(shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=draw) * draw(std) + draw(mean)

    store_created(ctx, *_create(ctx, sample))


TRUNCATION = 2.0  # Paddle truncates at two standard deviations


@register("truncated_gaussian_random", defaults=catalogue.require("gaussian_random").attr_defaults())
def truncated_gaussian_random(ctx: OpContext) -> None:
    """Normal(mean, std) restricted to mean ± 2 std (out-of-range draws are redrawn)."""
    mean, std = float(ctx.attr("mean")), float(ctx.attr("std"))
    rng = ctx.rng()
    draw = _draw_dtype(np_dtype(ctx.attr("dtype")))

    def sample(shape: tuple[int, ...]) -> np.ndarray:
        z = rng.standard_normal(shape, dtype=draw)
        bad = np.abs(z) > TRUNCATION
        while bad.any():  # each round keeps ~95% of the redraws
            z[bad] = rng.standard_normal(int(bad.sum()), dtype=draw)
            bad = np.abs(z) > TRUNCATION
        return z * draw(std) + draw(mean)

    store_created(ctx, *_create(ctx, sample))
