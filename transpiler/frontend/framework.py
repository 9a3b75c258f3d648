"""Programs under construction: default programs, `program_guard`, vars and `append_op`.

`Program` *is* an IR `transpiler.ir.Program` (a subclass), so what the builder makes
is what the transpiler, serde and the verifier take, with no conversion step. It adds
the state Fluid's Python `Program` kept while building: the current block, the role
and role vars given to new ops (`_optimized_guard`, `_lr_schedule_guard`), the device
(`device_guard`), `random_seed`, and a `Variable` wrapper per var.

`Variable` is a thin handle on an IR `Var` (name + block), for two reasons: Fluid
scripts use operator overloading (`global_step / decay_steps`, `1 + x`), and some
Python-only flags (`stop_gradient`, `trainable`, `regularizer`) must not reach the
wire, because Fluid 1.8 never wrote them. `var.desc` is the IR `Var`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ops import catalogue
from ops.catalogue import OpSpecError, ShapeContext, ShapeError, TensorInfo
from transpiler.errors import UnknownOpError
from transpiler.frontend import unique_name
from transpiler.frontend.errors import BuildError
from transpiler.ir import Block, DType, Op, OpRole, Var, VarKind
from transpiler.ir import Program as IRProgram
from transpiler.ir.types import OP_NAMESCOPE_ATTR, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR

# What Fluid 1.8.5 writes in `ProgramDesc.version` (the Paddle version as an integer).
FLUID_VERSION = 1008005
GRAD_SUFFIX = "@GRAD"
FLOAT_DTYPES = frozenset({DType.FP16, DType.FP32, DType.FP64, DType.BF16})


def to_dtype(dtype: Any) -> DType:
    if isinstance(dtype, Variable):
        dtype = dtype.dtype
    try:
        return DType.from_any(dtype)
    except (ValueError, TypeError):
        raise BuildError("dtype", f"unknown dtype {dtype!r}") from None


def fmt_shape(shape: Sequence[int] | None) -> str:
    return "None" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


# ------------------------------------------------------------------ Variable


class Variable:
    """A var of a program under construction (a handle on the IR `Var`)."""

    def __init__(self, block: Block, name: str, *, stop_gradient: bool = False, is_data: bool = False) -> None:
        self.block = block
        self.name = name
        self.stop_gradient = stop_gradient
        self.is_data = is_data
        self.error_clip = None

    # -- the IR declaration
    @property
    def desc(self) -> Var:
        return self.block.var(self.name)

    @property
    def program(self) -> Program:
        return self.block.program  # type: ignore[return-value]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.desc.shape or ())

    @property
    def dtype(self) -> DType:
        dtype = self.desc.dtype
        if dtype is None:
            raise BuildError(self.name, f"a {self.desc.kind.name} var has no dtype")
        return dtype

    @property
    def lod_level(self) -> int:
        return self.desc.lod_level

    @property
    def type(self) -> VarKind:
        return self.desc.kind

    @property
    def persistable(self) -> bool:
        return self.desc.persistable

    @persistable.setter
    def persistable(self, value: bool) -> None:
        self.desc.persistable = bool(value)

    def __repr__(self) -> str:
        desc = self.block.find_var(self.name)
        if desc is None:
            return f"Variable({self.name!r}, undeclared)"
        dtype = desc.dtype.short if desc.dtype is not None else "-"
        return f"Variable({self.name!r}, {dtype}, {fmt_shape(desc.shape)}, lod={desc.lod_level})"

    # -- operator overloading, as Fluid's monkey_patch_variable (see math_op_patch)
    def _binary(self, method: str, other: Any) -> Variable:
        from transpiler.frontend import math_op_patch

        return math_op_patch.binary(self, method, other)

    def __add__(self, other):
        return self._binary("__add__", other)

    def __radd__(self, other):
        return self._binary("__radd__", other)

    def __sub__(self, other):
        return self._binary("__sub__", other)

    def __rsub__(self, other):
        return self._binary("__rsub__", other)

    def __mul__(self, other):
        return self._binary("__mul__", other)

    def __rmul__(self, other):
        return self._binary("__rmul__", other)

    def __truediv__(self, other):
        return self._binary("__truediv__", other)

    def __rtruediv__(self, other):
        return self._binary("__rtruediv__", other)

    def __pow__(self, other):
        return self._binary("__pow__", other)

    def __rpow__(self, other):
        return self._binary("__rpow__", other)

    def __neg__(self):
        from transpiler.frontend import math_op_patch

        return math_op_patch.scalar_op(self, -1.0, 0.0)

    def __lt__(self, other):
        return self._binary("__lt__", other)

    def __le__(self, other):
        return self._binary("__le__", other)

    def __gt__(self, other):
        return self._binary("__gt__", other)

    def __ge__(self, other):
        return self._binary("__ge__", other)

    # Fluid 1.8 also overloads == and != to build `equal` ops; here they keep Python's
    # identity semantics so Variables can live in dicts and sets. Use layers.equal.
    __hash__ = object.__hash__

    def astype(self, dtype: Any) -> Variable:
        from transpiler.frontend import layers

        return layers.cast(self, dtype)


class Parameter(Variable):
    """A trainable var of the global block (persistable; `fc_0.w_0`, or its ParamAttr name)."""

    def __init__(self, block: Block, name: str, **kwargs: Any) -> None:
        super().__init__(block, name, stop_gradient=False)
        self.trainable = bool(kwargs.get("trainable", True))
        self.optimize_attr = dict(kwargs.get("optimize_attr") or {"learning_rate": 1.0})
        self.regularizer = kwargs.get("regularizer")
        self.gradient_clip_attr = kwargs.get("gradient_clip_attr")
        self.do_model_average = kwargs.get("do_model_average")
        self.initializer = kwargs.get("initializer")


# -------------------------------------------------------------------- Program


class _NameScope:
    """Fluid's name-scope tree: a scope entered again under the same parent gets `_1`, `_2`, ..."""

    def __init__(self, name: str = "", parent: _NameScope | None = None) -> None:
        self.name, self.parent = name, parent
        self.children: dict[str, list[_NameScope]] = {}

    def child(self, prefix: str) -> _NameScope:
        siblings = self.children.setdefault(prefix, [])
        scope = _NameScope(prefix if not siblings else f"{prefix}_{len(siblings)}", self)
        siblings.append(scope)
        return scope

    def full_name(self) -> str:
        names, scope = [], self
        while scope.parent is not None:
            names.append(scope.name)
            scope = scope.parent
        return "/" + "".join(f"{name}/" for name in reversed(names))


class Program(IRProgram):
    """A Fluid-1.x program being built; an IR `Program` at every moment."""

    def __init__(self) -> None:
        super().__init__()
        self.append_block(Block(self, 0, -1))
        self.version = FLUID_VERSION
        self.random_seed = 0
        self._name_scope_root = _NameScope()
        self.current_block_idx = 0
        self._op_role: int = int(OpRole.Forward)
        self._op_role_var: tuple[str, ...] = ()
        self._device: str | None = None
        self._appending_grad_times = 0
        self._variables: dict[tuple[int, str], Variable] = {}

    @classmethod
    def empty(cls) -> Program:
        return cls()

    # -- blocks
    def current_block(self) -> Block:
        return self.block(self.current_block_idx)

    def _create_block(self, parent_idx: int | None = None) -> Block:
        parent = self.current_block_idx if parent_idx is None else parent_idx
        block = self.create_block(parent)
        self.current_block_idx = block.idx
        return block

    def _rollback(self) -> None:
        self.current_block_idx = self.current_block().parent_idx

    # -- vars
    def variable(self, name: str, block: Block | int | None = None) -> Variable:
        """The `Variable` of `name` in `block` (default: the current block) or its ancestors."""
        start = self.current_block() if block is None else (self.block(block) if isinstance(block, int) else block)
        found: Block | None = start
        while found is not None:
            handle = self._variables.get((found.idx, name))
            if handle is not None:
                return handle
            if found.has_var(name):
                return self._wrap(found, name)
            found = found.parent
        raise BuildError("program", f"no var {name!r} in block {start.idx} or its ancestors")

    def _wrap(self, block: Block, name: str, handle: Variable | None = None) -> Variable:
        key = (block.idx, name)
        if handle is not None:
            self._variables[key] = handle
        elif key not in self._variables:
            self._variables[key] = Variable(block, name)
        return self._variables[key]

    def all_parameters(self) -> list[Parameter]:
        """The global block's parameters in creation order."""
        block = self.global_block()
        return [
            handle
            for name in block.vars
            if isinstance(handle := self._variables.get((0, name)), Parameter)
        ]

    # -- role guards (what Fluid's Program does for optimizer and lr ops)
    @contextmanager
    def _optimized_guard(self, param_and_grads: Sequence[Any]) -> Iterator[None]:
        saved = self._op_role, self._op_role_var
        self._op_role = int(OpRole.Optimize)
        self._op_role_var = tuple(v.name if isinstance(v, Variable) else str(v) for v in param_and_grads)
        try:
            yield
        finally:
            self._op_role, self._op_role_var = saved

    @contextmanager
    def _lr_schedule_guard(self, is_with_opt: bool = False) -> Iterator[None]:
        saved = self._op_role, self._op_role_var
        self._op_role = int(OpRole.LRSched | OpRole.Optimize) if is_with_opt else int(OpRole.LRSched)
        self._op_role_var = ()
        try:
            yield
        finally:
            self._op_role, self._op_role_var = saved


# ------------------------------------------------------- default programs


_main_program = Program()
_startup_program = Program()


def default_main_program() -> Program:
    return _main_program


def default_startup_program() -> Program:
    return _startup_program


def switch_main_program(program: Program) -> Program:
    global _main_program
    old, _main_program = _main_program, program
    return old


def switch_startup_program(program: Program) -> Program:
    global _startup_program
    old, _startup_program = _startup_program, program
    return old


@contextmanager
def program_guard(main_program: Program, startup_program: Program | None = None) -> Iterator[None]:
    """Build into `main_program` (and `startup_program`, when given) inside the `with`."""
    for what, program in (("main_program", main_program), ("startup_program", startup_program)):
        if program is not None and not isinstance(program, Program):
            raise BuildError("program_guard", f"{what} must be a transpiler.frontend.Program, got {type(program).__name__}")
    old_main = switch_main_program(main_program)
    old_startup = switch_startup_program(startup_program) if startup_program is not None else None
    try:
        yield
    finally:
        switch_main_program(old_main)
        if old_startup is not None:
            switch_startup_program(old_startup)


_scope_path: list[_NameScope] = []  # the scopes entered, innermost last


@contextmanager
def name_scope(prefix: str | None = None) -> Iterator[None]:
    """Fluid's name scopes: ops built inside get `op_namescope` = the scope path, e.g.
    `/gradient_clip/` (the transpiler keeps gradient-clip ops on the trainer by it).
    Outside every scope the builder writes no `op_namescope` (Fluid's is "/"). The tree
    of scopes is the main program's (Fluid's is the process's), so a program's scope
    names do not depend on what was built before it."""
    parent = _scope_path[-1] if _scope_path else default_main_program()._name_scope_root
    _scope_path.append(parent.child(prefix or ""))
    try:
        yield
    finally:
        _scope_path.pop()


def current_name_scope() -> str | None:
    """The `op_namescope` an op built now gets, None outside every scope."""
    return _scope_path[-1].full_name() if _scope_path else None


@contextmanager
def device_guard(device: str | None = None) -> Iterator[None]:
    """Ops built inside get `op_device=device` (Fluid 1.8 pins Adam's beta powers to "cpu")."""
    program = default_main_program()
    startup = default_startup_program()
    saved = program._device, startup._device
    program._device = startup._device = device
    try:
        yield
    finally:
        program._device, startup._device = saved


# ----------------------------------------------------------- var creation


def create_var(
    block: Block,
    name: str | None = None,
    *,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    kind: VarKind = VarKind.LOD_TENSOR,
    lod_level: int | None = None,
    persistable: bool | None = None,
    stop_gradient: bool = False,
    need_check_feed: bool = False,
    is_data: bool = False,
    layer: str = "create_var",
) -> Variable:
    """Declare a var (or reuse the one of that name, checking it agrees), as Fluid's
    `Block.create_var` does."""
    program = block.program
    if not isinstance(program, Program):
        raise BuildError(layer, "vars can only be created in a transpiler.frontend.Program")
    if name is None:
        name = unique_name.generate("_generated_var")
    dtype = None if dtype is None else to_dtype(dtype)
    shape = None if shape is None else tuple(int(d) for d in shape)
    if block.has_var(name):
        desc = block.var(name)
        if shape is not None and desc.shape is not None and desc.shape != () and tuple(desc.shape) != shape:
            raise BuildError(
                layer, f"var {name!r} exists with shape {fmt_shape(desc.shape)}; it cannot be redeclared as {fmt_shape(shape)}"
            )
        if dtype is not None and desc.dtype is not None and desc.dtype != dtype:
            raise BuildError(
                layer, f"var {name!r} exists as {desc.dtype.short}; it cannot be redeclared as {dtype.short}"
            )
        if persistable is not None:
            desc.persistable = persistable
        handle = program._wrap(block, name)
        return handle
    with_dtype = dtype is not None or kind in (VarKind.LOD_TENSOR, VarKind.SELECTED_ROWS, VarKind.LOD_TENSOR_ARRAY)
    if with_dtype and dtype is None:
        dtype = DType.FP32
    block.create_var(
        name,
        kind,
        dtype if with_dtype else None,
        (shape if shape is not None else ()) if with_dtype else None,
        lod_level=lod_level or 0,
        persistable=bool(persistable),
        need_check_feed=need_check_feed,
    )
    return program._wrap(block, name, Variable(block, name, stop_gradient=stop_gradient, is_data=is_data))


def create_parameter(
    block: Block,
    name: str,
    *,
    shape: Sequence[int],
    dtype: Any,
    initializer: Any = None,
    layer: str = "create_parameter",
    **attrs: Any,
) -> Parameter:
    """A parameter in `block`'s program's global block; with an `initializer`, it is run
    (prepended to the startup block) unless an op already initialises the var."""
    program = block.program
    if not isinstance(program, Program):
        raise BuildError(layer, "parameters can only be created in a transpiler.frontend.Program")
    shape = tuple(int(d) for d in shape)
    if not shape or any(d <= 0 for d in shape):
        raise BuildError(
            layer, f"parameter {name!r} needs a static positive shape, got {fmt_shape(shape)} "
            "(the input's feature dims must be known when the layer is built)"
        )
    glob = program.global_block()
    create_var(glob, name, shape=shape, dtype=dtype, persistable=True, layer=layer)
    handle = program._variables.get((0, name))
    if not isinstance(handle, Parameter):
        handle = program._wrap(glob, name, Parameter(glob, name, initializer=initializer, **attrs))
    if initializer is not None:
        writers = glob.writers(name)
        if len(writers) > 1:
            raise BuildError(layer, f"parameter {name!r} is initialised by {len(writers)} ops")
        if not writers:
            initializer(handle, glob)
    return handle  # type: ignore[return-value]


# ------------------------------------------------------------------ ops


def _arg_names(args: Any) -> list[str]:
    if args is None:
        return []
    if isinstance(args, (str, Variable, Var)):
        args = [args]
    return [a if isinstance(a, str) else a.name for a in args]


def _info(block: Block, name: str) -> TensorInfo | None:
    var = block.find_var(name)
    if var is None or var.dtype is None:
        return None
    return TensorInfo(var.dtype, tuple(var.shape or ()), var.lod_level, var.kind)


def append_op(
    block: Block,
    op_type: str,
    inputs: Mapping[str, Any] | None = None,
    outputs: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Any] | None = None,
    *,
    index: int | None = None,
    layer: str | None = None,
) -> Op:
    """Build an op against the catalogue (slots checked, attrs typed and defaulted), give
    it the program's current role, role vars and device, run the op's shape rule on its
    outputs, and add it to `block` (at `index`, or at the end)."""
    layer = layer or op_type
    program = block.program
    values = dict(attrs or {})
    for name, value in list(values.items()):
        if isinstance(value, Block):
            values[name] = value.idx
    if isinstance(program, Program):
        values.setdefault(OP_ROLE_ATTR, program._op_role)
        if program._op_role_var and not values.get(OP_ROLE_VAR_ATTR):
            values[OP_ROLE_VAR_ATTR] = list(program._op_role_var)
        if program._device is not None:
            values.setdefault("op_device", program._device)
        scope = current_name_scope()
        if scope is not None:
            values.setdefault(OP_NAMESCOPE_ATTR, scope)
    ins = None if inputs is None else {slot: _arg_names(args) for slot, args in inputs.items()}
    outs = None if outputs is None else {slot: _arg_names(args) for slot, args in outputs.items()}
    try:
        op = catalogue.make_op(op_type, ins, outs, values)
    except UnknownOpError as exc:
        raise UnknownOpError(f"{layer}: {exc}") from None
    except OpSpecError as exc:
        raise BuildError(layer, str(exc)) from None
    for name in op.input_names + op.output_names:
        if block.find_var(name) is None:
            raise BuildError(layer, f"{op_type} names var {name!r}, which block {block.idx} does not declare")
    _infer_shapes(block, op, layer)
    block.add_op(op, index=index)
    return op


def _infer_shapes(block: Block, op: Op, layer: str) -> None:
    entry = catalogue.require(op.type)
    if entry.infer_shape is None:
        return
    ctx = ShapeContext(
        op.type,
        {slot: tuple(_info(block, n) for n in args) for slot, args in op.inputs.items()},
        op.attr_values(),
    )
    try:
        result = entry.infer_shape(ctx)
    except ShapeError as exc:
        raise BuildError(layer, str(exc)) from None
    for slot, infos in result.items():
        if slot not in op.outputs:
            continue
        for name, info in zip(op.output(slot), infos, strict=True):
            if info is None:
                continue
            var = block.find_var(name)
            if var is None or var.dtype is None:
                continue
            var.dtype = info.dtype
            var.shape = tuple(info.shape)
            var.lod_level = info.lod_level
            if info.kind in (VarKind.LOD_TENSOR, VarKind.SELECTED_ROWS):
                var.kind = info.kind

