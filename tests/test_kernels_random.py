"""Initializers: ranges, dtypes, and the seed policy (reproducible runs)."""

from __future__ import annotations

import numpy as np

from ops.executor import Executor
from ops.testing import run_op
from transpiler.ir import DType

FP32, FP64 = int(DType.FP32), int(DType.FP64)


def uniform(seed: int = 0, executor: Executor | None = None, **attrs):
    base = {"shape": [200, 50], "min": -0.5, "max": 0.25, "seed": seed, "dtype": FP32}
    return run_op("uniform_random", attrs={**base, **attrs}, executor=executor)["Out"]


def test_uniform_range_dtype_shape():
    out = uniform()
    assert out.dtype == np.float32 and out.shape == (200, 50)
    assert out.min() >= -0.5 and out.max() < 0.25
    assert abs(out.mean() - (-0.125)) < 0.01
    assert uniform(dtype=FP64).dtype == np.float64


def test_uniform_seed_attr_repeats_on_every_run_and_every_executor():
    a, b = uniform(seed=7, executor=Executor(seed=1)), uniform(seed=7, executor=Executor(seed=2))
    np.testing.assert_array_equal(a, b)
    exe = Executor()
    np.testing.assert_array_equal(uniform(seed=7, executor=exe), uniform(seed=7, executor=exe))
    assert not np.array_equal(uniform(seed=7), uniform(seed=8))


def test_seed_zero_follows_the_executor_seed():
    np.testing.assert_array_equal(uniform(executor=Executor(seed=3)), uniform(executor=Executor(seed=3)))
    assert not np.array_equal(uniform(executor=Executor(seed=3)), uniform(executor=Executor(seed=4)))
    exe = Executor(seed=3)
    assert not np.array_equal(uniform(executor=exe), uniform(executor=exe))  # a second draw is a new draw


def test_seed_none_is_not_reproducible():
    assert not np.array_equal(uniform(executor=Executor(seed=None)), uniform(executor=Executor(seed=None)))


def test_uniform_diag():
    out = run_op(
        "uniform_random",
        attrs={"shape": [3, 4], "min": 0.0, "max": 0.5, "seed": 1, "diag_num": 3, "diag_step": 4, "diag_val": 9.0},
    )["Out"].reshape(-1)
    assert out[[0, 5, 10]].tolist() == [9.0, 9.0, 9.0]
    assert (np.delete(out, [0, 5, 10]) < 0.5).all()


def test_gaussian_moments():
    out = run_op("gaussian_random", attrs={"shape": [20000], "mean": 1.5, "std": 0.5, "seed": 3})["Out"]
    assert out.dtype == np.float32
    assert abs(out.mean() - 1.5) < 0.02 and abs(out.std() - 0.5) < 0.02


def test_truncated_gaussian_stays_within_two_std():
    out = run_op("truncated_gaussian_random", attrs={"shape": [20000], "mean": -1.0, "std": 2.0, "seed": 4})["Out"]
    assert out.min() >= -5.0 and out.max() <= 3.0
    assert abs(out.mean() + 1.0) < 0.05
    assert out.std() < 2.0 * 0.9  # truncation narrows the spread (≈ 0.88 std)
