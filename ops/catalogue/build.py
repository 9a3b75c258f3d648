"""Building ops against their catalogue entries, the way Paddle's Python `Operator` does.

`make_op` is what `block.append_op` was in Fluid: slots checked against the entry
(required ones present, a non-duplicable slot one arg), every declared input slot the
caller left out present and empty (Fluid does this whenever inputs are given), attrs
typed by the entry (`epmap` STRINGS even when empty, `sections` INTS on `split_byref`
but LONGS on `send`) and, unless `fill_defaults=False`, defaults filled in as Paddle's
attr checker does. Slots and attrs come out sorted by name, as Paddle's C++ `OpDesc`
keeps slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ops.catalogue.opdef import COMMON_ATTRS, EMITTED_COMMON_ATTRS, OpDef, OpSpecError
from ops.catalogue.registry import CATALOGUE
from transpiler.errors import IRError, UnknownOpError
from transpiler.ir import Attr, AttrType, Op, OpRole
from transpiler.ir.attrs import coerce, sound_on_its_own
from transpiler.ir.program import SlotArgs, Var
from transpiler.ir.types import OP_ROLE_ATTR, OP_ROLE_VAR_ATTR


def get(op_type: str) -> OpDef | None:
    """The entry for `op_type`, or None for an op the catalogue does not know."""
    return CATALOGUE.get(op_type)


def require(op_type: str) -> OpDef:
    """The entry for `op_type`; `UnknownOpError` naming it when there is none."""
    entry = CATALOGUE.get(op_type)
    if entry is None:
        raise UnknownOpError(
            f"op {op_type!r} is not in the op catalogue (ops/catalogue); "
            "it loads, dumps and passes through untouched, but it cannot be built or differentiated"
        )
    return entry


def op_types() -> list[str]:
    return list(CATALOGUE)


_STR_ONLY = {str}


def _names(args: SlotArgs | None) -> tuple[str, ...]:
    if args is None:
        return ()
    if isinstance(args, (str, Var)):
        args = [args]
    elif (args.__class__ is list or args.__class__ is tuple) and set(map(type, args)) <= _STR_ONLY:
        return tuple(args)
    out = []
    for arg in args:
        name = arg if isinstance(arg, str) else getattr(arg, "name", None)
        if not isinstance(name, str):
            raise OpSpecError(f"a slot argument must be a var name or a var, got {arg!r}")
        out.append(name)
    return tuple(out)


class _Template:
    """What `make_op` needs of an entry, worked out once per entry: its slots by name, the
    attrs filled when a caller leaves them out (`Attr`s are immutable, so ops share them),
    the required attrs, and the slot layouts callers used (see `_check_slots`)."""

    __slots__ = ("entry", "slots", "specs", "sound_specs", "defaults", "sound_defaults", "required", "role_attrs",
                 "layouts")

    def __init__(self, entry: OpDef) -> None:
        self.entry = entry
        self.slots = {"input": {s.name: s for s in entry.inputs}, "output": {s.name: s for s in entry.outputs}}
        self.specs = {**COMMON_ATTRS, **entry.attrs}  # what `typed_attr` looks up: the entry's spec, else the common one
        # Whether an attr typed by its spec is sound on its own depends on its name and type
        # only: asked once per name here, not once per op built.
        self.sound_specs = {name: sound_on_its_own(name, Attr(spec.type, None)) for name, spec in self.specs.items()}
        defaults: dict[str, Attr] = {}
        for name, spec in entry.attrs.items():
            if not spec.required:
                defaults[name] = Attr.of(spec.default, spec.type)
        defaults.setdefault(OP_ROLE_ATTR, Attr.of(int(entry.role), AttrType.INT))
        for name in EMITTED_COMMON_ATTRS:
            if name not in defaults:
                spec = COMMON_ATTRS[name]
                defaults[name] = Attr.of(spec.default, spec.type)
        self.defaults = dict(sorted(defaults.items()))  # sorted once: an op's attrs come out sorted
        self.sound_defaults = all(sound_on_its_own(name, attr) for name, attr in self.defaults.items())
        self.required = tuple((name, spec) for name, spec in entry.attrs.items() if spec.required)
        # `op_role` as `role=` gives it, typed once per role value (a pass builds many ops of one role).
        self.role_attrs: dict[int, Attr] = {}
        # (direction, fill, given slot names...) -> (the op's slot names in order, the given
        # slots that take one var): the checks that depend on the names only, done once.
        self.layouts: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {}


_TEMPLATES: dict[int, _Template] = {}


def _template(entry: OpDef) -> _Template:
    template = _TEMPLATES.get(id(entry))
    if template is None or template.entry is not entry:
        template = _TEMPLATES[id(entry)] = _Template(entry)
    return template


def _check_slots(
    template: _Template, given: Mapping[str, SlotArgs] | None, direction: str, fill: bool
) -> dict[str, tuple[str, ...]]:
    if not given:
        slots = {}
    else:  # names already (the common case, at C speed), else `_names` normalises them
        slots = {k: tuple(v) if (v.__class__ is list or v.__class__ is tuple) and set(map(type, v)) <= _STR_ONLY
                 else _names(v) for k, v in given.items()}
        if set(map(type, slots)) != _STR_ONLY:
            slots = {str(k): v for k, v in slots.items()}
    layout = template.layouts.get((direction, fill, *slots))
    if layout is None:  # slot names not seen yet: check them all (raising as they come)
        return _check_new_slots(template, slots, direction, fill)
    order, single = layout
    for name in single:
        if len(slots[name]) > 1:
            raise OpSpecError(f"{template.entry.type}: {direction} slot {name} takes one var, got {len(slots[name])}: "
                              f"{list(slots[name])}")
    if len(order) == len(slots):
        return slots if order == tuple(slots) else {name: slots[name] for name in order}
    return {name: slots.get(name, ()) for name in order}  # the left-out dispensable inputs, empty


def _check_new_slots(
    template: _Template, slots: dict[str, tuple[str, ...]], direction: str, fill: bool
) -> dict[str, tuple[str, ...]]:
    entry = template.entry
    defs = entry.inputs if direction == "input" else entry.outputs
    known = template.slots[direction]
    key = (direction, fill, *slots)
    for name, args in slots.items():
        slot = known.get(name)
        if slot is None:
            raise OpSpecError(
                f"{entry.type}: no {direction} slot {name!r} (it has {', '.join(known) or 'none'})"
            )
        if not slot.duplicable and len(args) > 1:
            raise OpSpecError(f"{entry.type}: {direction} slot {name} takes one var, got {len(args)}: {list(args)}")
    if len(slots) < len(defs):
        for slot in defs:
            if slot.name in slots:
                continue
            if not slot.dispensable:
                raise OpSpecError(f"{entry.type}: {direction} slot {slot.name} is required")
            if fill and direction == "input":
                slots[slot.name] = ()
    slots = dict(sorted(slots.items())) if len(slots) > 1 else slots
    single = tuple(name for name in key[2:] if not known[name].duplicable)
    template.layouts[key] = (tuple(slots), single)
    return slots


def typed_attr(entry: OpDef | None, name: str, value: Any) -> Attr:
    """`value` as the wire type the entry (or the common attrs) declares for `name`;
    an attr neither declares gets the type its value implies."""
    spec = (entry.attrs.get(name) if entry is not None else None) or COMMON_ATTRS.get(name)
    try:
        if spec is None:
            return Attr.of(value)
        if isinstance(value, Attr):
            value = value.value
        return Attr.of(value, spec.type)
    except IRError as exc:
        where = entry.type if entry is not None else "op"
        raise OpSpecError(f"{where}: attr {name}={value!r}: {exc}") from None


def make_attrs(
    entry: OpDef, attrs: Mapping[str, Any] | None, *, fill_defaults: bool = True, role: OpRole | int | None = None,
    role_vars: tuple[str, ...] | list[str] | None = None,
) -> dict[str, Attr]:
    return dict(_make_attrs(_template(entry), attrs, fill_defaults, role, role_vars)[0])  # the caller's own dict


def _make_attrs(
    template: _Template, attrs: Mapping[str, Any] | None, fill_defaults: bool, role: OpRole | int | None,
    role_vars: tuple[str, ...] | list[str] | None,
) -> tuple[dict[str, Attr], bool]:
    """The op's attrs, and whether each is sound on its own (the verifier need not check them)."""
    entry = template.entry
    typed: dict[str, Attr] = {}
    sound = True
    if attrs:
        specs, sound_specs = template.specs, template.sound_specs
        for name, value in attrs.items():
            spec = specs.get(name)
            if spec is None or isinstance(value, Attr):
                typed[name] = attr = typed_attr(entry, name, value)
                sound = sound and sound_on_its_own(name, attr)
                continue
            try:  # `_typed_attr`, inline: make_op types every attr given
                typed[name] = Attr(spec.type, coerce(value, spec.type))
            except IRError as exc:
                raise OpSpecError(f"{entry.type}: attr {name}={value!r}: {exc}") from None
            sound = sound and sound_specs[name]
    if role is not None:
        typed[OP_ROLE_ATTR] = attr = _role_attr(template, role)
        sound = sound and sound_on_its_own(OP_ROLE_ATTR, attr)
    if role_vars is not None:
        typed[OP_ROLE_VAR_ATTR] = attr = _role_vars_attr(entry, role_vars)
        sound = sound and sound_on_its_own(OP_ROLE_VAR_ATTR, attr)
    if not fill_defaults:
        return dict(sorted(typed.items())), sound
    for name, spec in template.required:
        if name not in typed:
            raise OpSpecError(f"{entry.type}: attr {name} ({spec.type.name}) is required and has no default")
    defaults = template.defaults
    sound = sound and template.sound_defaults
    if not typed:
        return defaults, sound  # shared by every such op: an op never changes its attr dict in place
    if typed.keys() <= defaults.keys():
        return {**defaults, **typed}, sound  # the defaults' (sorted) order, the values given
    return dict(sorted({**defaults, **typed}.items())), sound


def _typed_attr(template: _Template, name: str, value: Any) -> Attr:
    """`typed_attr` for a plain value of a declared attr, without its lookups (`make_op` types every attr given)."""
    spec = template.specs.get(name)
    if spec is None or isinstance(value, Attr):
        return typed_attr(template.entry, name, value)
    try:
        return Attr(spec.type, coerce(value, spec.type))
    except IRError as exc:
        raise OpSpecError(f"{template.entry.type}: attr {name}={value!r}: {exc}") from None


def _role_attr(template: _Template, role: OpRole | int) -> Attr:
    # Keyed by the role as given: an OpRole hashes and compares as its int, and int() of a flag is slow.
    attr = template.role_attrs.get(role)
    if attr is None:
        attr = template.role_attrs[role] = typed_attr(template.entry, OP_ROLE_ATTR, int(role))
    return attr


def _role_vars_attr(entry: OpDef, role_vars: tuple[str, ...] | list[str]) -> Attr:
    if role_vars and set(map(type, role_vars)) == _STR_ONLY and OP_ROLE_VAR_ATTR not in entry.attrs:
        return Attr(AttrType.STRINGS, tuple(role_vars))  # what typed_attr gives, without its checks
    return typed_attr(entry, OP_ROLE_VAR_ATTR, list(role_vars))


def make_op(
    op_type: str,
    inputs: Mapping[str, SlotArgs] | None = None,
    outputs: Mapping[str, SlotArgs] | None = None,
    attrs: Mapping[str, Any] | None = None,
    *,
    fill_defaults: bool = True,
    role: OpRole | int | None = None,
    role_vars: tuple[str, ...] | list[str] | None = None,
) -> Op:
    """A detached op of a catalogued type, built as Fluid 1.8.5's Python would build it.

    `role` / `role_vars` set `op_role` / `op_role_var` (an `op_role` in `attrs` works too;
    without either the entry's default role is used). `fill_defaults=False` builds the
    op the way Paddle's backward builds raw `OpDesc`s: only the attrs given.
    Raises `UnknownOpError` for an op the catalogue does not know and `OpSpecError`
    (an `IRError`) for a bad slot or attr.
    """
    # A call shaped like one seen before (same type, slot names, attr names, role) reuses
    # what the checks that depend on names only worked out then (`_Shape`): a pass builds
    # hundreds of ops of a few shapes, and the general path below cost 7 us an op.
    try:
        key = (op_type, fill_defaults, role, role_vars is None, inputs is None, *(inputs or ()), None,
               *(outputs or ()), None, *(attrs or ()))
        shape = _SHAPES.get(key)
    except TypeError:  # an unhashable role or slot name: the general path says what is wrong
        key, shape = None, None
    if shape is not None and shape.entry is CATALOGUE.get(op_type):
        op = shape.build(inputs, outputs, attrs, role_vars)
        if op is not None:
            return op
    entry = require(op_type)
    template = _template(entry)
    ins = _check_slots(template, inputs, "input", fill=inputs is not None)
    outs = _check_slots(template, outputs, "output", fill=False)
    typed, sound = _make_attrs(template, attrs, fill_defaults, role, role_vars)
    if shape is None and key is not None and len(_SHAPES) < 4096 and _str_keys(inputs) and _str_keys(outputs) and _str_keys(attrs):
        _SHAPES[key] = _Shape(template, ins, outs, typed, attrs, fill_defaults, role, role_vars)
    return Op._built(op_type, ins, outs, typed, sound=sound)


def _str_keys(mapping: Mapping | None) -> bool:
    """Names the op keeps as given (the general path turns other keys into `str`)."""
    return not mapping or set(map(type, mapping)) == _STR_ONLY


class _Shape:
    """What `make_op` worked out for one shape of call (see there), so that the next call
    of that shape only normalises and types the values given: the slots in the op's
    order (with the left-out dispensable inputs empty), which take one var, each attr's
    spec type and soundness, the role attrs, and the attr order."""

    __slots__ = ("entry", "in_order", "in_single", "out_order", "out_single", "attr_types", "sound", "role_attr",
                 "role_vars_typed", "defaults", "sort")

    def __init__(self, template: _Template, ins: dict, outs: dict, typed: dict[str, Attr], attrs, fill_defaults: bool,
                 role, role_vars) -> None:
        self.entry = template.entry
        self.in_order, self.in_single = self._slots(template, ins, "input")
        self.out_order, self.out_single = self._slots(template, outs, "output")
        # Per attr given: its spec type, or None when typing depends on the value (no spec).
        self.attr_types = {}
        sound = True
        for name in attrs or ():
            spec = template.specs.get(name)
            self.attr_types[name] = None if spec is None else spec.type
            sound = sound and spec is not None and template.sound_specs[name]
        self.role_attr = typed.get(OP_ROLE_ATTR) if role is not None else None
        if self.role_attr is not None:
            sound = sound and sound_on_its_own(OP_ROLE_ATTR, self.role_attr)
        # op_role_var as `_role_vars_attr` types it when the entry does not declare it: STRINGS.
        self.role_vars_typed = role_vars is not None and OP_ROLE_VAR_ATTR not in self.entry.attrs
        if self.role_vars_typed:
            sound = sound and sound_on_its_own(OP_ROLE_VAR_ATTR, Attr(AttrType.STRINGS, ()))
        self.sound = sound and (template.sound_defaults or not fill_defaults)
        self.defaults = template.defaults if fill_defaults else None
        self.sort = not (fill_defaults and typed.keys() <= template.defaults.keys())  # else the defaults' order

    @staticmethod
    def _slots(template: _Template, slots: dict, direction: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        known = template.slots[direction]
        return tuple(slots), tuple(name for name in slots if not known[name].duplicable)

    def build(self, inputs, outputs, attrs, role_vars) -> Op | None:
        """The op, or None when a value needs the general path (to normalise it, or to
        say what is wrong with it)."""
        ins = self._take(inputs, self.in_order, self.in_single)
        if ins is None:
            return None
        outs = self._take(outputs, self.out_order, self.out_single)
        if outs is None:
            return None
        typed: dict[str, Attr] = {}
        if attrs:
            for name, value in attrs.items():
                attr_type = self.attr_types[name]
                if attr_type is None or isinstance(value, Attr):
                    return None
                cls = value.__class__
                if cls is int or cls is str or cls is bool:
                    # A scalar typed before is the same immutable Attr (`trainer_id` 0 of every
                    # send and recv): shared, not built again. No float: 0.0 and -0.0 are one key.
                    key = (attr_type, cls, value)
                    attr = _SCALAR_ATTRS.get(key)
                    if attr is None:
                        try:
                            attr = Attr(attr_type, coerce(value, attr_type))
                        except IRError:
                            return None
                        if len(_SCALAR_ATTRS) < 4096:
                            _SCALAR_ATTRS[key] = attr
                    typed[name] = attr
                    continue
                try:
                    typed[name] = Attr(attr_type, coerce(value, attr_type))
                except IRError:
                    return None
        if self.role_attr is not None:
            typed[OP_ROLE_ATTR] = self.role_attr
        if role_vars is not None:
            if not self.role_vars_typed or not role_vars or set(map(type, role_vars)) != _STR_ONLY:
                return None
            typed[OP_ROLE_VAR_ATTR] = Attr(AttrType.STRINGS, tuple(role_vars))
        defaults = self.defaults
        if defaults is None:
            typed = dict(sorted(typed.items()))
        elif not typed:
            typed = defaults
        elif self.sort:
            typed = dict(sorted({**defaults, **typed}.items()))
        else:
            typed = {**defaults, **typed}
        return Op._built(self.entry.type, ins, outs, typed, sound=self.sound)

    @staticmethod
    def _take(given, order: tuple[str, ...], single: tuple[str, ...]) -> dict[str, tuple[str, ...]] | None:
        """The slots in the op's order, names as tuples; None when an arg is not a name
        or a one-var slot has several (the general path normalises or refuses them)."""
        slots = {}
        get = given.get if given else {}.get
        for name in order:
            args = get(name, ())
            if args.__class__ is not tuple:
                if args.__class__ is not list:
                    return None
                args = tuple(args)
            if args and set(map(type, args)) != _STR_ONLY:
                return None
            slots[name] = args
        for name in single:
            if len(slots[name]) > 1:
                return None
        return slots


_SHAPES: dict[tuple, _Shape] = {}
_SCALAR_ATTRS: dict[tuple, Attr] = {}


def fill_attrs(op: Op, *, strict: bool = True) -> Op:
    """Give an existing op every attr its entry declares (defaults for the missing ones)
    and the declared wire type for the ones it has. Unknown ops are left alone unless
    `strict`, which raises `UnknownOpError`."""
    entry = get(op.type)
    if entry is None:
        if strict:
            require(op.type)
        return op
    for name, attr in list(op.attrs.items()):
        spec = entry.attrs.get(name) or COMMON_ATTRS.get(name)
        if spec is not None and attr.type != spec.type:
            op.set_attr(name, typed_attr(entry, name, attr.value))
    for name, spec in entry.attrs.items():
        if not op.has_attr(name):
            if spec.required:
                raise OpSpecError(f"{entry.type}: attr {name} ({spec.type.name}) is required and has no default")
            op.set_attr(name, Attr.of(spec.default, spec.type))
    if not op.has_attr(OP_ROLE_ATTR):
        op.set_attr(OP_ROLE_ATTR, Attr.of(int(entry.role), AttrType.INT))
    for name in EMITTED_COMMON_ATTRS:
        if not op.has_attr(name):
            spec = COMMON_ATTRS[name]
            op.set_attr(name, Attr.of(spec.default, spec.type))
    return op
