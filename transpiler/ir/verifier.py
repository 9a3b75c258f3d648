"""Structural checks every program must pass.

* blocks: block `i` has `idx == i`; block 0 has parent -1; every other block's parent
  is another existing block and the parent chain reaches block 0 without a cycle;
  `forward_block_idx` is -1 or an existing block;
* ops: every slot argument names a var declared in the op's block or an ancestor
  (`@EMPTY@`, Paddle's "no grad here" placeholder, excepted) or, in a control-flow grad
  block (`forward_block_idx` set: `conditional_block_grad`'s, `while_grad`'s), in a block
  its forward block sees: Paddle runs it in the forward's scope (`Block.visible_blocks`); BLOCK / BLOCKS attrs
  name existing blocks other than the op's own; VAR / VARS attrs name declared vars;
  the common attrs (`op_role`, ...) have the types Paddle gives them.

An op's attrs that are sound whatever the program (well-typed common attrs, no block or
var reference: `attrs.sound_on_its_own`) are checked once: the op remembers that attr
dict (`Op._verified_attrs`), which clones share and every edit replaces, and `make_op`,
`set_attr` and `clone` keep it when what they add is sound too. The slots are checked on
every call: whether their vars are declared depends on the block.

`check(program)` returns every problem found; `verify(program)` raises the first as a
`VerifyError` naming program, block, op index and op type, with the dump lines around
the op. Passes of the transpiler add their own checks through `extra_checks`.

`check_warnings(program)` returns what is legal but worth saying, one line per kind for
the whole program (never per op), e.g. ops that repeat an attr: Paddle 2.6 writes them and
reads them back (its `OpDesc` keeps the last value), so they are never refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import attrgetter

from transpiler.errors import VerifyError
from transpiler.ir.attrs import COMMON_ATTR_TYPES, REFERENCE_TYPES, AttrType
from transpiler.ir.printer import op_context
from transpiler.ir.program import Block, Op, Program
from transpiler.ir.types import EMPTY_VAR_NAME

# An extra check gets the program and its name and yields the problems it finds.
Check = Callable[[Program, str], Iterable[VerifyError]]


def verify(program: Program, *, name: str = "program", extra_checks: Iterable[Check] = ()) -> None:
    """Raise the first problem found as a `VerifyError` (its message counts the rest)."""
    problems = check(program, name=name, extra_checks=extra_checks)
    if not problems:
        return
    first = problems[0]
    if len(problems) > 1:
        first = VerifyError(
            f"{first.reason} (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})",
            program=first.program,
            block=first.block,
            op_index=first.op_index,
            op_type=first.op_type,
            context=first.context,
        )
    raise first


def check(program: Program, *, name: str = "program", extra_checks: Iterable[Check] = ()) -> list[VerifyError]:
    problems = list(_check_blocks(program, name))
    if not problems:  # op checks resolve parents, which needs a sound block tree
        quiet = _quiet_children(program)
        for block in program.blocks:
            if block.idx not in quiet:
                problems.extend(_check_ops(program, block, name))
    for extra in extra_checks:
        problems.extend(extra(program, name))
    return problems


def check_warnings(program: Program, *, name: str = "program") -> list[str]:
    repeating, names = 0, {}
    for _, op in program.all_ops():
        repeated = op.repeated_attrs()
        if repeated:
            repeating += 1
            for attr_name in repeated:
                names[attr_name] = names.get(attr_name, 0) + 1
    if not repeating:
        return []
    listed = ", ".join(f"{n} ({count} op{'s' if count > 1 else ''})" for n, count in sorted(names.items()))
    return [
        f"{name}: {repeating} of {program.num_ops()} ops repeat attrs ({listed}); the last value of each is used, "
        "as in Paddle"
    ]


def op_problem(name: str, block: Block, op: Op, index: int, message: str) -> VerifyError:
    """A `VerifyError` located at `op`, with the dump around it (for extra checks too)."""
    return VerifyError(
        message, program=name, block=block.idx, op_index=index, op_type=op.type, context=op_context(block, index)
    )


def _check_blocks(program: Program, name: str) -> Iterable[VerifyError]:
    count = program.num_blocks
    if count == 0:
        yield VerifyError("has no blocks", program=name)
        return
    for position, block in enumerate(program.blocks):
        if block.idx != position:
            yield VerifyError(f"is at position {position} but says idx={block.idx}", program=name, block=position)
        if position == 0:
            if block.parent_idx != -1:
                yield VerifyError(f"the global block has parent {block.parent_idx}, not -1", program=name, block=0)
        elif not 0 <= block.parent_idx < count or block.parent_idx == position:
            yield VerifyError(
                f"has parent {block.parent_idx}, which is not another block of the {count}", program=name, block=position
            )
        if block.forward_block_idx != -1 and not 0 <= block.forward_block_idx < count:
            yield VerifyError(
                f"forward_block_idx {block.forward_block_idx} is not a block of the {count}",
                program=name,
                block=position,
            )
    # Parent chains must reach block 0; walk each once with memoisation (linear overall).
    reaches_root = {0: True}
    for position in range(1, count):
        chain, current = [], position
        while current not in reaches_root:
            if current in chain or not 0 <= program.blocks[current].parent_idx < count:
                for member in chain:
                    reaches_root[member] = False
                if current in chain:  # an out-of-range parent is reported above
                    yield VerifyError("its parent chain never reaches block 0 (a cycle)", program=name, block=position)
                break
            chain.append(current)
            current = program.blocks[current].parent_idx
        else:
            for member in chain:
                reaches_root[member] = reaches_root[current]


_attr_type = attrgetter("type")


def _quiet_children(program: Program) -> frozenset[int]:
    """The children of block 0 that declare no var of their own (a pserver's hundreds of
    optimize blocks), when `_check_ops` would find nothing in any of them: every name
    their ops use is declared in block 0 and every op's attrs are known sound. Asked of
    them all at once (one set, one difference) rather than block by block; empty when
    any of them needs a look, which `_check_ops` then gives each."""
    blocks = program.blocks
    children = [block for block in blocks[1:] if block.parent_idx == 0 and not block._vars]
    if len(children) < 2:
        return frozenset()
    names: set[str] = set()
    for block in children:
        for op in block.ops:
            if op._verified_attrs is not op._attrs:
                return frozenset()
            names.update(*op._inputs.values(), *op._outputs.values())
    names.discard(EMPTY_VAR_NAME)
    if names.difference(blocks[0]._vars):
        return frozenset()
    return frozenset(block.idx for block in children)


def _check_ops(program: Program, block: Block, name: str) -> Iterable[VerifyError]:
    count = program.num_blocks
    # Every name the block's ops use, at once (`Block.names_used`), less the vars declared in
    # this block and each ancestor, nearest first: when all are declared (set arithmetic, at
    # C speed), no slot needs checking op by op.
    undeclared = block.names_used()
    scopes = []
    chain: list[Block] = []
    current: Block | None = block
    while current is not None:
        chain.append(current)
        current = current.parent
    # A control-flow grad block also sees what its forward block sees (`Block.visible_blocks`).
    forward = any(b.forward_block_idx >= 0 for b in chain)
    if forward:
        chain = block.visible_blocks()
    for current in chain:
        scope = current._vars
        scopes.append(scope)
        if undeclared and scope:
            # `set.difference(dict)` looks each name up in the dict; `difference_update` would walk
            # every key of the scope (the global block's, for each of hundreds of small blocks).
            undeclared = undeclared.difference(scope)
    where = f"block {block.idx} and its ancestors"
    if forward:
        others = ", ".join(str(b.idx) for b in chain[1:])
        where = f"block {block.idx} and the blocks whose scopes it runs in ({others}: ancestors and forward blocks)"
    undeclared.discard(EMPTY_VAR_NAME)
    ops: Iterable[tuple[int, Op]] = enumerate(block.ops)
    if not undeclared:
        # Nothing to look for in the slots: visit only the ops whose attrs are not known sound
        # (nearly none in a transpile's programs), found at C speed.
        ops = [(index, op) for index, op in ops if op._verified_attrs is not op._attrs]
        if not ops:
            return
    # A slot whose args one scope holds all is checked at C speed (nearly every slot).
    holds = [scope.__contains__ for scope in scopes]

    def declared(var: str) -> bool:
        return any(var in scope for scope in scopes)

    for index, op in ops:
        for direction, slots in (("input", op._inputs), ("output", op._outputs)) if undeclared else ():
            for slot, args in slots.items():
                for has in holds:
                    if all(map(has, args)):
                        break
                else:
                    for arg in args:
                        if arg != EMPTY_VAR_NAME and not declared(arg):
                            yield op_problem(
                                name, block, op, index,
                                f"{direction} {slot}={arg!r} names a var that {where} do not declare",
                            )
        attrs = op._attrs
        if op._verified_attrs is attrs:
            continue  # sound on their own (`attrs.sound_on_its_own`) and unchanged since: an edit replaces the dict
        sound = True
        for attr_name, expected in COMMON_ATTR_TYPES.items():
            attr = attrs.get(attr_name)
            if attr is not None and attr.type not in expected:
                sound = False
                yield op_problem(
                    name, block, op, index,
                    f"attr {attr_name} is {attr.type.name}, not {' or '.join(t.name for t in expected)}",
                )
        if REFERENCE_TYPES.isdisjoint(map(_attr_type, attrs.values())):
            if sound:  # nothing left that depends on the program: no need to look again
                op._verified_attrs = attrs
            continue
        for attr_name, attr in attrs.items():
            if attr_name in COMMON_ATTR_TYPES:
                continue
            if attr.type in (AttrType.BLOCK, AttrType.BLOCKS):
                targets = (attr.value,) if attr.type == AttrType.BLOCK else attr.value
                for target in targets:
                    if not 0 <= target < count:
                        yield op_problem(
                            name, block, op, index,
                            f"attr {attr_name}=block[{target}] points past the last block ({count - 1})",
                        )
                    elif target == block.idx:
                        yield op_problem(name, block, op, index, f"attr {attr_name}=block[{target}] is the op's own block")
            elif attr.type in (AttrType.VAR, AttrType.VARS):
                targets = (attr.value,) if attr.type == AttrType.VAR else attr.value
                for target in targets:
                    if not declared(target):
                        yield op_problem(
                            name, block, op, index, f"attr {attr_name}=var({target}) names an undeclared var"
                        )
