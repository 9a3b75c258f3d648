"""Kernels take attr defaults and grad op types from the op catalogue, so the two
cannot disagree: a kernel that repeats one is refused at registration."""

from __future__ import annotations

import pytest

import ops.rpc  # noqa: F401  (registers the RPC kernels too)
from ops import catalogue
from ops.kernels import get_kernel, register, registered_ops, unregister


def catalogued_kernels() -> list[str]:
    return [name for name in registered_ops() if catalogue.get(name) is not None]


def test_most_kernels_are_of_catalogue_ops():
    assert len(catalogued_kernels()) > 80


@pytest.mark.parametrize("op_type", catalogued_kernels())
def test_kernel_defaults_and_grad_are_the_catalogues(op_type):
    spec, entry = get_kernel(op_type), catalogue.require(op_type)
    assert {name: spec.defaults[name] for name in entry.attr_defaults()} == entry.attr_defaults()
    extra = set(spec.defaults) - set(entry.attr_defaults())
    assert not extra & set(entry.attrs), "a kernel default for an attr the catalogue declares"
    assert spec.grad == (entry.grad_types[0] if entry.grad_types else None)


def test_a_kernel_repeating_a_catalogue_default_is_refused():
    with pytest.raises(ValueError, match="'split_byref': the op catalogue holds num"):
        register("split_byref", defaults={"num": 0}, replace=True)
    assert get_kernel("split_byref").defaults["axis"] == 0  # its one local default: Paddle 2.x's attr


def test_a_kernel_naming_a_catalogue_grad_is_refused():
    with pytest.raises(ValueError, match="'mul': the op catalogue names its grad op"):
        register("mul", grad="mul_grad", replace=True)


def test_an_op_outside_the_catalogue_keeps_its_own_defaults_and_grad():
    assert catalogue.get("test_local_op") is None
    register("test_local_op", defaults={"k": 3}, grad="test_local_op_grad")(lambda ctx: None)
    try:
        spec = get_kernel("test_local_op")
        assert dict(spec.defaults) == {"k": 3} and spec.grad == "test_local_op_grad"
    finally:
        unregister("test_local_op")
