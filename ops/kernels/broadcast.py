"""Paddle's elementwise broadcasting, and the reduction its grads need.

With `axis == -1`, or operands of equal rank, Paddle 2.x broadcasts like numpy
(trailing dims aligned, size-1 dims stretched). With an explicit `axis`, the smaller
operand's dims line up with the larger one's starting at `axis` (after Paddle 1.8
trims the smaller one's trailing size-1 dims when they would overrun); we express
that as a reshape with size-1 dims around it and let numpy broadcast.
"""

from __future__ import annotations

import numpy as np


def aligned_shape(big: tuple[int, ...], small: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """The shape `small` is viewed as to broadcast against `big` at `axis`."""
    if axis == -1 or len(small) == len(big):
        return small
    dims = list(small)
    while dims and axis + len(dims) > len(big) and dims[-1] == 1:
        dims.pop()  # Paddle's trim_trailing_singular_dims
    if axis < 0 or axis + len(dims) > len(big):
        raise ValueError(f"cannot broadcast shape {list(small)} onto {list(big)} at axis {axis}")
    for i, d in enumerate(dims):
        if d != 1 and d != big[axis + i]:
            raise ValueError(f"shape {list(small)} does not match {list(big)} at axis {axis}")
    return (1,) * axis + tuple(dims) + (1,) * (len(big) - axis - len(dims))


def operands(x: np.ndarray, y: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """`x` and `y` reshaped (views) so numpy broadcasting follows Paddle's rule."""
    if x.ndim >= y.ndim:
        return x, y.reshape(aligned_shape(x.shape, y.shape, axis))
    return x.reshape(aligned_shape(y.shape, x.shape, axis)), y


def reduce_to(grad: np.ndarray, shape: tuple[int, ...], axis: int, other: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast result's grad back to an operand of `shape` (the other operand
    has shape `other`), undoing `operands`."""
    shape = tuple(shape)
    if grad.shape == shape:
        return grad
    if len(shape) < len(other):
        view = aligned_shape(tuple(other), shape, axis) if len(other) == grad.ndim else shape
    else:
        view = shape
    lead = grad.ndim - len(view)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(view) if d == 1 and grad.shape[lead + i] != 1
    )
    reduced = grad.sum(axis=axes, keepdims=True) if axes else grad
    return reduced.reshape(shape)
