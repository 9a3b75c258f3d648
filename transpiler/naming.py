"""Every name the transpiler generates, and the `"name:value"` attr encoding, in one place.

Trainers and pservers are transpiled in different processes and must agree on every
name, and the pserver runtime reads the attrs the passes write: building and parsing
them here keeps the two sides from drifting. The names match Paddle's where Paddle has
one (`.block<i>`, `.trainer_<id>`, `kLookupTablePath`, the prefetch tmp vars).

A leaf module: it imports only the standard library and `transpiler.errors`, so the
lowest layers (plan, passes, the pserver runtime) can all use it.
"""

from __future__ import annotations

from collections.abc import Iterable

from transpiler.errors import PsTranspilerError

# The RAW var a lookup-table checkpoint notice fills with the directory to save to (Paddle's name).
LOOKUP_TABLE_PATH = "kLookupTablePath"

CONTROL_VAR_PREFIX = "__control_var@"


class MalformedEntryError(PsTranspilerError):
    """An attr entry that is not `"<name>:<value>"` (or whose value is not a block id)."""


def block_name(var: str, index: int) -> str:
    """Block `index` of a cut var (`fc_w.block1`), or a pserver's private copy of a
    param's state for that block when two blocks of the param share the pserver."""
    return f"{var}.block{index}"


def band_name(var: str, band: int) -> str:
    """Row band `band` of a var cut into 2-D partitions, on the trainer: what `split_byref`
    cuts the grad into before `split` cuts a band by columns, and what `concat` joins a
    param's column blocks into before joining the bands."""
    return f"{var}.band{band}"


def flat_name(var: str) -> str:
    """A rank-3+ var cut into column ranges, on the trainer, seen as the matrix
    `[d0, d1 * d2 * ...]` (`reshape2`): what its grad is cut from and its param joined into."""
    return f"{var}.flat"


def trainer_name(var: str, trainer: int) -> str:
    """Trainer `trainer`'s own copy of `var`: its grad on a pserver in sync mode with
    several trainers, or its async lr-decay step counter."""
    return f"{var}.trainer_{trainer}"


def trainer_of(name: str) -> int | None:
    """The trainer whose own copy `name` is, or a shard or block of it (`trainer_name`,
    then `shard_name` / `block_name`), else None."""
    while True:
        head, dot, tail = name.rpartition(".")
        if not dot:
            return None
        for prefix in ("trainer_", "pserver_", "block"):
            number = tail[len(prefix):] if tail.startswith(prefix) else ""
            if number.isdigit() and number.isascii():
                break
        else:
            return None
        if prefix == "trainer_":
            return int(number)
        name = head


def shard_name(var: str, shard: int) -> str:
    """The rows of `var` bound for pserver `shard` (the distributed table's grads)."""
    return f"{var}.pserver_{shard}"


def control_var(number: int) -> str:
    """A dependency-only var (Paddle draws random numbers; counting keeps every process alike)."""
    return f"{CONTROL_VAR_PREFIX}{number}"


def prefetch_in(shard: int) -> str:
    """The ids a trainer asks pserver `shard` for (Paddle's name)."""
    return f"prefetch_compress_in_tmp_{shard}"


def prefetch_out(shard: int) -> str:
    """The rows pserver `shard` answers a prefetch with (Paddle's name)."""
    return f"prefetch_compress_out_tmp_{shard}"


# ------------------------------------------------------------ "name:value" attrs


def encode_pairs(pairs: Iterable[tuple[str, str | int]]) -> list[str]:
    """`[("fc_w@GRAD.block1", 3)]` → `["fc_w@GRAD.block1:3"]`: the form of
    `grad_to_block_id`, `sparse_grad_to_param` and `prefetch_var_name_to_block_id`."""
    return [f"{name}:{value}" for name, value in pairs]


def decode_pair(entry: object, attr: str) -> tuple[str, str]:
    """`"a:b:c"` → `("a:b", "c")`: names may hold ':', the value may not."""
    name, sep, value = str(entry).rpartition(":")
    if not sep or not name or not value:
        raise MalformedEntryError(f"malformed {attr} entry {entry!r}: expected '<name>:<value>'")
    return name, value


def decode_block_id(entry: object, attr: str) -> tuple[str, int]:
    """`"fc_w@GRAD:3"` → `("fc_w@GRAD", 3)`."""
    name, value = decode_pair(entry, attr)
    if not value.lstrip("-").isdigit():
        raise MalformedEntryError(f"malformed {attr} entry {entry!r}: {value!r} is not a block id")
    return name, int(value)


def decode_block_ids(entries: Iterable[object] | None, attr: str) -> dict[str, int]:
    """A whole `grad_to_block_id`-style attr as `{name: block id}`."""
    return dict(decode_block_id(entry, attr) for entry in entries or ())
