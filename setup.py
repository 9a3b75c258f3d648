"""The compiled parts: `ops.kernels._fused` (one-pass optimizer updates) and
`ops.kernels._pcg64` (numpy's PCG64 uniform draws without numpy.random). Optional: where
they cannot be built the kernels run their numpy path, which computes the same bits.
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ops.kernels._fused",
            sources=["ops/kernels/_fused.c"],
            depends=["ops/kernels/_float_kind.h"],
            # -ffp-contract=off: no fused multiply-add, so each operation rounds as numpy's does.
            # -fno-math-errno: sqrt may use the vector instruction (it never sets errno here).
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            optional=True,
        ),
        Extension("ops.kernels._pcg64", sources=["ops/kernels/_pcg64.c"], depends=["ops/kernels/_float_kind.h"],
                  extra_compile_args=["-O3", "-std=c11"],
                  optional=True),
    ]
)
