"""`default_rng(entropy)`: numpy's `np.random.default_rng(entropy)` stream, the same numbers,
without importing numpy.random where the compiled `_pcg64` is built.

What a process imports stays resident for its whole run, and numpy.random (its generators,
distributions and legacy `RandomState`: nine extension modules) is 2-3 MB of a pserver's
peak RSS that only its startup program's initializers use (issue 30: the 64 MB pserver's
peak, docs/runtime.md "Where a peak goes"). The initializers and the executor's streams
draw from `default_rng`, which seeds a PCG64 state exactly as numpy's `SeedSequence` does
(in Python: a few words of integer arithmetic) and fills uniform draws in C (`_pcg64.fill`,
the loop of numpy's `Generator.random`). Any other draw (`standard_normal`, `integers`, ...)
hands the state to a numpy Generator and goes on from there, so the stream never differs
from numpy's, whichever calls a kernel makes in whichever order
(`tests/test_kernels_pcg64.py` checks every kind against numpy's own).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from itertools import cycle
from typing import Any

import numpy as np

try:
    from ops.kernels import _pcg64
except ImportError:  # pragma: no cover - a build without a C compiler draws with numpy.random
    _pcg64 = None

# numpy's SeedSequence (numpy/random/bit_generator.pyx), after O'Neill's seed_seq alternative
POOL_SIZE = 4
INIT_A, MULT_A = 0x43B0D7E5, 0x931E8875
INIT_B, MULT_B = 0x8B51F9DD, 0x58F38DED
MIX_MULT_L, MIX_MULT_R = 0xCA01F9DD, 0x4973F715
XSHIFT = 16
MASK32, MASK64, MASK128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1
PCG_MULT = (2549297995355413924 << 64) | 4865540595714422341  # PCG64's 128-bit multiplier


def _words(entropy: Any) -> list[int]:
    """The entropy as uint32 words, as numpy's `_coerce_to_uint32_array` makes them: an int
    little-endian word by word (0 is one word), a sequence each element's words in turn."""
    if isinstance(entropy, (int, np.integer)):
        n = int(entropy)
        if n < 0:
            raise ValueError(f"a seed must be a non-negative integer, not {n}")
        words = [n & MASK32] if n == 0 else []
        while n > 0:
            words.append(n & MASK32)
            n >>= 32
        return words
    if isinstance(entropy, (str, bytes, float, np.inexact)) or not isinstance(entropy, Iterable):
        raise TypeError(f"a seed must be an int or a sequence of ints, not {type(entropy).__name__}")
    return [word for item in entropy for word in _words(item)]


def _hashmix(value: int, hash_const: list[int]) -> int:
    value ^= hash_const[0]
    hash_const[0] = (hash_const[0] * MULT_A) & MASK32
    value = (value * hash_const[0]) & MASK32
    return value ^ (value >> XSHIFT)


def _mix(x: int, y: int) -> int:
    result = (MIX_MULT_L * x - MIX_MULT_R * y) & MASK32
    return result ^ (result >> XSHIFT)


def seed_pool(entropy: Any) -> list[int]:
    """numpy's `SeedSequence(entropy).pool` (no spawn key, pool size 4)."""
    words, hash_const = _words(entropy), [INIT_A]
    pool = [_hashmix(words[i] if i < len(words) else 0, hash_const) for i in range(POOL_SIZE)]
    for src in range(POOL_SIZE):
        for dst in range(POOL_SIZE):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hashmix(pool[src], hash_const))
    for word in words[POOL_SIZE:]:
        for dst in range(POOL_SIZE):
            pool[dst] = _mix(pool[dst], _hashmix(word, hash_const))
    return pool


def generate_state64(pool: list[int], n_words: int) -> list[int]:
    """numpy's `SeedSequence.generate_state(n_words, np.uint64)` from its pool."""
    hash_const, words = INIT_B, []
    source = cycle(pool)
    for _ in range(2 * n_words):
        value = next(source) ^ hash_const
        hash_const = (hash_const * MULT_B) & MASK32
        value = (value * hash_const) & MASK32
        words.append(value ^ (value >> XSHIFT))
    return [words[2 * i] | (words[2 * i + 1] << 32) for i in range(n_words)]  # little-endian pairs


def pcg64_state(entropy: Any) -> tuple[int, int]:
    """(state, inc) of numpy's `PCG64(entropy)` (`pcg64_set_seed`: PCG's srandom)."""
    seed = generate_state64(seed_pool(entropy), 4)
    initstate, initseq = (seed[0] << 64) | seed[1], (seed[2] << 64) | seed[3]
    inc = ((initseq << 1) | 1) & MASK128
    state = (inc + initstate) & MASK128  # a step from state 0 is `inc`
    return (state * PCG_MULT + inc) & MASK128, inc


Rng = Any  # what `default_rng` returns: a `Pcg64Generator` or numpy's Generator, the same numbers either way


class Pcg64Generator:
    """numpy's `default_rng(entropy)`: `random` drawn here, anything else by a numpy
    Generator that takes over the state at its first use (and keeps it from then on)."""

    __slots__ = ("_state", "_numpy")

    def __init__(self, entropy: Any) -> None:
        state, inc = pcg64_state(entropy)
        self._state = np.array([state >> 64, state & MASK64, inc >> 64, inc & MASK64, 0, 0], dtype=np.uint64)
        self._numpy: Any = None

    def random(self, size: Any = None, dtype: Any = np.float64, out: np.ndarray | None = None) -> Any:
        """`Generator.random`: uniform in [0, 1), float32 or float64."""
        if self._numpy is not None:
            return self._numpy.random(size, dtype=dtype, out=out)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"Unsupported dtype {dtype} for random")
        if out is None:
            array = np.empty(() if size is None else size, dtype)
        else:
            array = out
            if array.dtype != dtype or not array.flags.c_contiguous or not array.flags.writeable:
                raise ValueError("out must be a writeable C-contiguous array of the draw's dtype")
        _pcg64.fill(self._state, array.reshape(-1))
        if out is not None:
            return out
        return float(array[()]) if size is None else array  # numpy: a Python float

    def __getattr__(self, name: str) -> Any:
        return getattr(self.numpy_generator(), name)

    def numpy_generator(self) -> Any:
        """The numpy Generator at this generator's state; it draws every number from now on."""
        if self._numpy is None:
            from numpy.random import PCG64, Generator  # noqa: PLC0415 - only for the draws made here

            words = [int(w) for w in self._state]
            bits = PCG64()
            bits.state = {"bit_generator": "PCG64", "state": {"state": (words[0] << 64) | words[1],
                                                              "inc": (words[2] << 64) | words[3]},
                          "has_uint32": words[4], "uinteger": words[5]}
            self._numpy = Generator(bits)
        return self._numpy


def default_rng(entropy: Any = None) -> Rng:
    """`np.random.default_rng(entropy)`'s numbers (OS entropy, 128 bits, for None, as numpy
    draws): this module's generator where `_pcg64` is built, else numpy's own."""
    if entropy is None:
        entropy = secrets.randbits(128)
    if _pcg64 is None:
        return np.random.default_rng(entropy)
    return Pcg64Generator(entropy)
