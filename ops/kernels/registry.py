"""The kernel registry: op type → `KernelSpec` (the function, Paddle's attr defaults,
and the op type of its grad op).

Other modules plug ops in with the same decorator (the RPC layer registers `send`,
`recv`, `listen_and_serv`, ... this way):

    @register("mul")
    def mul(ctx: OpContext) -> None: ...

The op catalogue is the one source of what an op is: a kernel of a catalogue op takes
its attr defaults and its grad op type from the catalogue entry. A kernel gives
`defaults=` only for attrs the entry does not declare (Paddle 2.6's additions such as
`multi_precision`, or every attr of an op the catalogue does not know) and `grad=` only
for an op the catalogue does not know; repeating what the catalogue holds is an error at
registration, so the two cannot disagree.

A module whose kernels most processes never run (the RPC layer's trainer-side kernels, in
a pserver) can be declared instead of imported: `register_lazily(module, op_types)` names
the op types it registers, and the first lookup of one of them (`get_kernel`,
`registered_ops`, ...) imports it. Every op type stays known to the registry, and a
declared module that does not register what it was declared for is an error at that
lookup, not a missing kernel later.

`grad` is the op Paddle's grad maker emits for the op (`mul_grad`; `scale` for `scale`
and `sum`; `cast` for `cast`), so `tests/test_gradcheck.py` can insist every
differentiable kernel has a finite-difference check. An op without a kernel is an
`UnknownOpError`, never a silent no-op.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ops import catalogue
from ops.catalogue import OpDef
from transpiler.errors import UnknownOpError

if TYPE_CHECKING:
    from ops.kernels.context import OpContext

KernelFn = Callable[["OpContext"], None]


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel."""

    op_type: str
    fn: KernelFn
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    grad: str | None = None  # the grad op type Paddle emits for this op; None: not differentiable
    family: str = ""  # the module that registered it

    @property
    def differentiable(self) -> bool:
        return self.grad is not None


_REGISTRY: dict[str, KernelSpec] = {}
_LAZY: dict[str, str] = {}  # op type -> the module that registers it when imported (`register_lazily`)
_LOCK = threading.Lock()
_GENERATION = [0]  # bumped by every (un)registration: the executor's prepared blocks check it


def register(
    op_type: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    grad: str | None = None,
    replace: bool = False,
) -> Callable[[KernelFn], KernelFn]:
    """Decorator registering `fn` as the kernel of `op_type` (stackable for aliases).

    Registering an op type twice is an error unless `replace=True`, so two modules
    cannot silently fight over an op.
    """
    if not isinstance(op_type, str) or not op_type:
        raise ValueError(f"an op type must be a non-empty string, got {op_type!r}")
    entry = catalogue.get(op_type)
    all_defaults = _defaults(op_type, entry, defaults or {})
    grad_type = _grad_type(op_type, entry, grad)

    def decorate(fn: KernelFn) -> KernelFn:
        spec = KernelSpec(
            op_type=op_type,
            fn=fn,
            defaults=MappingProxyType(all_defaults),
            grad=grad_type,
            family=getattr(fn, "__module__", "").rsplit(".", 1)[-1],
        )
        with _LOCK:
            if op_type in _REGISTRY and not replace and _REGISTRY[op_type].fn is not fn:
                raise ValueError(f"op {op_type!r} already has a kernel (from {_REGISTRY[op_type].family})")
            _REGISTRY[op_type] = spec
            _LAZY.pop(op_type, None)
            _GENERATION[0] += 1
        return fn

    return decorate


def register_lazily(module: str, op_types: Iterable[str]) -> None:
    """Declare that importing `module` registers the kernels of `op_types`: it is imported
    at the first lookup of one of them, not now (see the module docstring)."""
    op_types = tuple(op_types)
    if not module or not op_types:
        raise ValueError(f"register_lazily needs a module and its op types, got {module!r}, {op_types!r}")
    with _LOCK:
        for op_type in op_types:
            declared = _LAZY.get(op_type, module)
            if declared != module:
                raise ValueError(f"op {op_type!r} is already declared for {declared}, not {module}")
        for op_type in op_types:
            if op_type not in _REGISTRY:
                _LAZY[op_type] = module
        _GENERATION[0] += 1


def _load(op_types: Iterable[str] | None = None) -> None:
    """Import the declared modules of those of `op_types` (None: all) not registered yet;
    each must register every op type it was declared for."""
    with _LOCK:
        modules = sorted(set(_LAZY.values()) if op_types is None else {_LAZY[t] for t in op_types if t in _LAZY})
    for module in modules:
        importlib.import_module(module)  # registers (outside the lock: `register` takes it)
        with _LOCK:
            missing = sorted(t for t, m in _LAZY.items() if m == module and t not in _REGISTRY)
            for op_type in [t for t, m in _LAZY.items() if m == module]:
                del _LAZY[op_type]
            if missing:
                raise UnknownOpError(f"module {module} was declared to register {', '.join(missing)} but did not")


def load_kernels(op_types: Iterable[str]) -> None:
    """Import now the modules declared for any of `op_types` (`register_lazily`), rather
    than at their first run: a process that is about to allocate big arrays (a step's
    params and grads) loads its code first, so the objects a late import makes do not land
    in the holes those arrays leave when freed, where the next one of their size would no
    longer fit. Op types without a kernel are left to the executor to report."""
    _load(op_types)


def _defaults(op_type: str, entry: OpDef | None, local: Mapping[str, Any]) -> dict[str, Any]:
    """The catalogue entry's defaults, plus `local` for the attrs the entry does not declare."""
    if entry is None:
        return dict(local)
    repeated = sorted(set(local) & set(entry.attrs))
    if repeated:
        raise ValueError(f"kernel {op_type!r}: the op catalogue holds {', '.join(repeated)}; do not repeat it")
    return {**local, **entry.attr_defaults()}


def _grad_type(op_type: str, entry: OpDef | None, local: str | None) -> str | None:
    """The grad op type the catalogue's grad maker emits; `local` for an op it does not know."""
    if entry is None:
        return local
    if local is not None:
        raise ValueError(f"kernel {op_type!r}: the op catalogue names its grad op; do not repeat it")
    return entry.grad_types[0] if entry.grad_types else None


def swap_kernel(op_type: str, fn: KernelFn) -> KernelSpec:
    """Run `fn` for `op_type` instead of its kernel, keeping the spec's defaults and grad
    (a profiler's timers, a test's spy); returns the spec to give `restore_kernel`."""
    _load((op_type,))
    with _LOCK:
        original = _REGISTRY.get(op_type)
        if original is None:
            raise UnknownOpError(f"no kernel for op {op_type!r}")
        _REGISTRY[op_type] = replace(original, fn=fn)
        _GENERATION[0] += 1
    return original


def restore_kernel(spec: KernelSpec) -> None:
    """Put back a spec `swap_kernel` returned."""
    with _LOCK:
        _REGISTRY[spec.op_type] = spec
        _GENERATION[0] += 1


def unregister(op_type: str) -> None:
    """Remove a kernel (tests that register temporary ops clean up with this)."""
    with _LOCK:
        _REGISTRY.pop(op_type, None)
        _LAZY.pop(op_type, None)
        _GENERATION[0] += 1


def generation() -> int:
    """A number that changes whenever a kernel is registered or removed."""
    return _GENERATION[0]


def get_kernel(op_type: str) -> KernelSpec:
    spec = _REGISTRY.get(op_type)
    if spec is None and op_type in _LAZY:
        _load((op_type,))
        spec = _REGISTRY.get(op_type)
    if spec is None:
        raise UnknownOpError(f"no kernel for op {op_type!r}")
    return spec


def has_kernel(op_type: str) -> bool:
    return op_type in _REGISTRY or op_type in _LAZY


def registered_ops() -> list[str]:
    """Every op type with a kernel, sorted (the declared modules imported)."""
    _load()
    with _LOCK:
        return sorted(_REGISTRY)


def differentiable_ops() -> dict[str, str]:
    """Forward op type → the grad op type it emits, for every differentiable kernel."""
    _load()
    with _LOCK:
        return {name: spec.grad for name, spec in sorted(_REGISTRY.items()) if spec.grad is not None}
