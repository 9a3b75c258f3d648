"""`ops.kernels.pcg64.default_rng`: numpy's `default_rng` stream, number for number, without
importing numpy.random (a pserver's initializers draw through it: issue 30's peak RSS)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ops.kernels import pcg64

pytest.importorskip("ops.kernels._pcg64", reason="the optional C extension is not built here")

ENTROPIES = [0, 1, 7, (1 << 32) - 1, 1 << 32, (1 << 64) - 1, 12345678901234567890, 1 << 100,
             [0, 123], [7, 0xDEADBEEF, 3], [1, 2, 3, 4, 5, 6, 7], [1 << 63, 1 << 40, 0, 9], [[5, 6], 7], []]


@pytest.mark.parametrize("entropy", ENTROPIES, ids=repr)
def test_the_seeded_state_is_numpys(entropy):
    state = np.random.default_rng(entropy).bit_generator.state
    assert pcg64.pcg64_state(entropy) == (state["state"]["state"], state["state"]["inc"])


@pytest.mark.parametrize("entropy", ENTROPIES[:10], ids=repr)
def test_uniform_draws_are_numpys_in_any_mix_of_dtypes_and_sizes(entropy):
    ours, theirs = pcg64.default_rng(entropy), np.random.default_rng(entropy)
    assert isinstance(ours, pcg64.Pcg64Generator)
    # odd float32 counts leave half a 64-bit output buffered; a float64 draw does not use it
    for size, dtype in [(7, np.float32), ((3, 5), np.float64), (1, np.float32), (1, np.float32), (1000, np.float32),
                        ((), np.float64), ((2, 0), np.float32), (9, np.float64), (3, np.float32)]:
        got, want = ours.random(size, dtype=dtype), theirs.random(size, dtype=dtype)
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert ours.random() == theirs.random() and type(ours.random()) is float


def test_out_arrays_and_bad_requests_as_numpy():
    ours, theirs = pcg64.default_rng(3), np.random.default_rng(3)
    into, want = np.empty((4, 4), np.float32), np.empty((4, 4), np.float32)
    assert ours.random(out=into, dtype=np.float32) is into
    theirs.random(out=want, dtype=np.float32)
    assert into.tobytes() == want.tobytes()
    with pytest.raises(TypeError, match="Unsupported dtype"):
        ours.random(3, dtype=np.int32)
    with pytest.raises(ValueError, match="non-negative"):
        pcg64.default_rng(-1)
    with pytest.raises(TypeError, match="an int or a sequence of ints"):
        pcg64.default_rng(1.5)


def test_any_other_draw_goes_on_from_the_same_state_through_numpy():
    ours, theirs = pcg64.default_rng([0, 99]), np.random.default_rng([0, 99])
    for draw in range(3):
        assert ours.random(5, dtype=np.float32).tobytes() == theirs.random(5, dtype=np.float32).tobytes()
        assert ours.standard_normal(7, dtype=np.float32).tobytes() == theirs.standard_normal(7, dtype=np.float32).tobytes()
        assert ours.integers(0, 1 << 63) == theirs.integers(0, 1 << 63)
        assert ours.random(4).tobytes() == theirs.random(4).tobytes()


def test_os_entropy_gives_a_new_stream_each_time_and_numpy_without_the_extension(monkeypatch):
    assert pcg64.default_rng().random(4).tobytes() != pcg64.default_rng().random(4).tobytes()
    monkeypatch.setattr(pcg64, "_pcg64", None)
    fallback = pcg64.default_rng(5)
    assert isinstance(fallback, np.random.Generator)
    assert fallback.random(6).tobytes() == np.random.default_rng(5).random(6).tobytes()


def test_an_initializer_runs_without_importing_numpy_random():
    code = ("import sys\n"
            "from ops.testing import run_op\n"
            "out = run_op('uniform_random', attrs={'shape': [64, 3], 'min': -1.0, 'max': 1.0, 'seed': 5, 'dtype': 5})['Out']\n"
            "print(out.dtype, out.shape, 'numpy.random' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["float32", "(64,", "3)", "False"]


def test_the_compiled_fill_refuses_what_it_cannot_write_safely():
    from ops.kernels import _pcg64  # noqa: PLC0415

    state = np.zeros(6, np.uint64)
    with pytest.raises(ValueError, match="the state is 6 uint64 words"):
        _pcg64.fill(np.zeros(5, np.uint64), np.zeros(3, np.float32))
    for out in (np.zeros(3, np.int32), np.zeros(3, ">f4" if sys.byteorder == "little" else "<f4")):
        with pytest.raises(TypeError, match="float32 or float64"):
            _pcg64.fill(state, out)
    with pytest.raises(ValueError, match="not C-contiguous"):
        _pcg64.fill(state, np.zeros(6, np.float32)[::2])
    assert not state.any()  # nothing drawn
