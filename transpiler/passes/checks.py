"""Checks across the programs of a bundle, on top of each program's own verifier:

* every var a trainer `send`s has a receiver: the pserver at its `epmap` entry lists it
  among `listen_and_serv`'s inputs, or an optimize block there reads it (the distributed
  table's grads), or declares it (broadcasts like the lr counter);
* every var a trainer `recv`s, and every table block a `distributed_lookup_table` reads,
  is declared on the pserver it is fetched from; every `prefetch` goes to a pserver with
  a prefetch block for it;
* every param block of the plan (and every shard of the distributed table) is updated by
  exactly one optimizer op, on its pserver;
* every `grad_to_block_id` entry names a block that reads that grad.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ops.catalogue.optimizer_ops import is_optimizer
from transpiler.errors import VerifyError
from transpiler.ir import Program
from transpiler.ir.verifier import op_problem, verify
from transpiler.naming import MalformedEntryError, decode_block_id, decode_pair
from transpiler.passes.bundle import Bundle


def verify_bundle(bundle: Bundle, *, after: str = "") -> None:
    """Verify every program built so far, then the cross-program checks once all exist."""
    suffix = f" (after {after})" if after else ""
    for label, program in bundle.programs():
        verify(program, name=label + suffix)
    if bundle.trainer is not None and bundle.pservers and all(p.startup is not None for p in bundle.pservers.values()):
        problems = list(cross_program_problems(bundle))
        if problems:
            first = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise VerifyError(
                first.reason + more + suffix,
                program=first.program,
                block=first.block,
                op_index=first.op_index,
                op_type=first.op_type,
                context=first.context,
            )


def cross_program_problems(bundle: Bundle) -> Iterable[VerifyError]:
    # Each pserver's grad_to_block_id is decoded and its blocks' reads gathered once, for
    # what it receives and for its own entries' check (two walks of hundreds of blocks before).
    serving, served_problems = {}, []
    for ep, progs in bundle.pservers.items():
        serving[ep], problems = _serving(f"pserver_{ep}", progs.main)
        served_problems.extend(problems)
    holding = {ep: progs.main.global_block() for ep, progs in bundle.pservers.items()}
    for label, program in (("trainer", bundle.trainer), ("trainer_startup", bundle.trainer_startup)):
        if program is None:
            continue
        block = program.global_block()
        for index, op in enumerate(block.ops):
            op_type = op.type
            if op_type not in _CROSS_CHECKED:  # nearly every op: one set lookup rather than four compares
                continue
            if op_type == "send":
                pairs = _pairs(op, "send_varnames", op.input("X"))
                if pairs is not None and _all_received(serving, pairs):  # the common case, without a generator
                    continue
                yield from _check_send(label, block, index, op, bundle, serving)
            elif op_type == "recv":
                names = op.attr("recv_varnames", ()) or op.output("Out")
                if not _all_held(holding, names, op.attr("epmap", ())):  # the common case, without a generator
                    yield from _check_recv(label, block, index, op, bundle, names)
            elif op_type == "distributed_lookup_table":
                yield from _check_recv(label, block, index, op, bundle, op.attr("table_names"), "endpoints")
            elif op_type == "prefetch":
                yield from _check_prefetch(label, block, index, op, bundle)
    yield from _check_each_block_optimized_once(bundle)
    yield from served_problems


_CROSS_CHECKED = frozenset({"send", "recv", "distributed_lookup_table", "prefetch"})


def _all_received(serving: dict[str, frozenset[str] | None], pairs: list[tuple[str, str]]) -> bool:
    """Whether the pserver of each (var, endpoint) receives the var (`_check_send` says what does not)."""
    for name, ep in pairs:
        received = serving.get(ep)
        if received is None or name not in received:
            return False
    return True


def _listen_and_serv(program: Program):
    return next((op for op in program.global_block().ops if op.type == "listen_and_serv"), None)


def _serving(label: str, program: Program) -> tuple[frozenset[str] | None, list[VerifyError]]:
    """What a pserver accepts (`listen_and_serv`'s inputs and whatever its optimize blocks
    read; None without a `listen_and_serv`), and the problems of its `grad_to_block_id`:
    an entry must name a block that reads that grad."""
    serve = _listen_and_serv(program)
    if serve is None:
        return None, [VerifyError("has no listen_and_serv op", program=label, block=0)]
    names = set(serve.input("X"))
    problems = []
    reads: dict[int, frozenset[str]] = {}
    for entry in serve.attr("grad_to_block_id", ()):
        try:
            grad, idx = decode_block_id(entry, "grad_to_block_id")
        except MalformedEntryError:
            idx = -1
        if not 0 < idx < program.num_blocks:
            problems.append(VerifyError(f"grad_to_block_id entry {entry!r} names no block", program=label, block=0))
            continue
        read = reads.get(idx)
        if read is None:
            read = reads[idx] = program.block(idx).names_read()
            names.update(read)
        if grad not in read:
            problems.append(VerifyError(f"grad_to_block_id entry {entry!r}: block {idx} does not read {grad!r}",
                                        program=label, block=idx))
    return frozenset(names), problems


def _all_held(holding: dict, names, endpoints) -> bool:
    """Whether each of `names` is declared on its endpoint's pserver (`_check_recv` says what is not)."""
    if len(names) != len(endpoints):
        return False
    for name, ep in zip(names, endpoints):
        block = holding.get(ep)
        if block is None or not block.has_var(name):
            return False
    return True


def _pairs(op, names_attr: str, slot_names: tuple[str, ...]):
    """(var, endpoint) pairs of a send; None when the counts cannot match."""
    names = list(op.attr(names_attr, ())) or list(slot_names)
    epmap = list(op.attr("epmap", ()))
    if len(names) != len(epmap) and len(names) == 1:
        return [(names[0], ep) for ep in epmap]  # a broadcast to every endpoint
    return list(zip(names, epmap, strict=True)) if len(names) == len(epmap) else None


def _check_send(label, block, index, op, bundle, serving):
    pairs = _pairs(op, "send_varnames", op.input("X"))
    if pairs is None:
        yield op_problem(label, block, op, index, f"send has {len(op.input('X'))} vars but {len(op.attr('epmap', ()))} endpoints")
        return
    for name, ep in pairs:
        if ep not in bundle.pservers:
            yield op_problem(label, block, op, index, f"send of {name!r} goes to {ep}, which is not a pserver")
            continue
        received = serving[ep]
        if received is None or (name not in received and not (
                op.attr("merge_add", False) and bundle.pservers[ep].main.global_block().has_var(name))):
            yield op_problem(label, block, op, index, f"send of {name!r} to {ep}: that pserver does not receive it")


def _check_recv(label, block, index, op, bundle, names, endpoints_attr="epmap"):
    endpoints = list(op.attr(endpoints_attr, ()))
    if len(names) != len(endpoints):
        yield op_problem(label, block, op, index, f"{op.type} has {len(names)} vars but {len(endpoints)} endpoints")
        return
    pairs = list(zip(names, endpoints, strict=True))
    for name, ep in pairs:
        progs = bundle.pservers.get(ep)
        if progs is None or not progs.main.global_block().has_var(name):
            yield op_problem(label, block, op, index, f"recv of {name!r} from {ep}: that pserver does not hold it")


def _check_prefetch(label, block, index, op, bundle):
    for name, ep in zip(op.input("X"), op.attr("epmap", ()), strict=False):
        progs = bundle.pservers.get(ep)
        serve = None if progs is None else _listen_and_serv(progs.main)
        entries = () if serve is None else serve.attr("prefetch_var_name_to_block_id", ())
        if name not in _prefetched_names(entries):
            yield op_problem(label, block, op, index, f"prefetch of {name!r} from {ep}: that pserver has no prefetch block for it")


def _prefetched_names(entries) -> list[str]:
    names = []
    for entry in entries:
        try:
            names.append(decode_pair(entry, "prefetch_var_name_to_block_id")[0])
        except MalformedEntryError:
            continue  # then no prefetch block answers for it: the caller reports the prefetch
    return names


def _check_each_block_optimized_once(bundle: Bundle):
    updated: Counter[tuple[str, str]] = Counter()
    for ep, progs in bundle.pservers.items():
        for block in progs.main.blocks:
            for op in block.ops:
                if is_optimizer(op.type):
                    for name in op.input("Param"):
                        updated[(ep, name)] += 1
    expected = {(ep, b.name) for p in bundle.plan.params for b, ep in zip(p.blocks, p.endpoints, strict=True)}
    if bundle.plan.table is not None:
        expected |= {(ep, bundle.plan.table.table) for ep in bundle.plan.table.endpoints}
    if updated.keys() == expected and all(count == 1 for count in updated.values()):
        return  # each expected block updated once, nothing else: no need to look for which is not
    for key in sorted(expected):
        if updated[key] != 1:
            ep, name = key
            yield VerifyError(f"param block {name!r} is updated {updated[key]} times on {ep}, not once",
                              program=f"pserver_{ep}")
    for key in sorted(set(updated) - expected):
        ep, name = key
        yield VerifyError(f"{name!r} is updated on {ep} but the plan puts no block of it there", program=f"pserver_{ep}")
