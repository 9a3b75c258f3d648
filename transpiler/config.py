"""Transpiler configuration: Paddle's `DistributeTranspilerConfig` and the frozen,
validated `TranspileOptions` the passes read.

Paddle derives the trainer program from `transpile(sync_mode=...)` but the pserver's mode
from `config.sync_mode`, so `transpile(sync_mode=False)` with a default config gives a
sync pserver and an async trainer that hang each other (Paddle 1.7/1.8's distribute_transpiler.py). Here one effective
mode drives both: the `sync_mode` argument when given, else `config.sync_mode`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

from transpiler.dispatch import PSDispatcher, dispatcher_name, resolve_dispatcher
from transpiler.errors import TranspileError
from transpiler.partition import PaddlePartitioner, Partitioner, partitioner_name, resolve_partitioner


class DistributedMode(IntEnum):
    """`listen_and_serv`'s `distributed_mode` attr (Paddle 1.7+ numbering)."""

    SYNC = 0
    ASYNC = 1  # async with the split done by send/recv at run time
    HALF_ASYNC = 2  # async with split_byref / concat in the trainer program


class DistributeTranspilerConfig:
    """Paddle-compatible configuration object; set attributes, then pass it to
    `DistributeTranspiler(config)`.

    Supported: `slice_var_up`, `split_method` (a `PSDispatcher` subclass or a name),
    `min_block_size` (>= 1; Paddle insists on >= 8192), `sync_mode`, `random_seed` (ours:
    the seed of the unsliced round-robin shuffle, Paddle's `program.random_seed`; None
    takes the program's, 0 for a loaded one),
    `runtime_split_send_recv` (async only), `half_async`, `completely_not_async`
    (treated as sync), `mode="pserver"`, `print_log`, `wait_port`, and ours: `clip_mode`
    ("exact", the default in sync mode: clips run on the pservers, on the averaged grad, as
    local training clips, a global norm summed across the pservers; "trainer", the default
    in async mode: each trainer clips its own grad, Paddle 1.8's program op for op: see
    `CLIP_MODES`).
    Not supported (a `TranspileError` says so): `mode` "nccl2"/"collective",
    `enable_dc_asgd`, `geo_sgd_mode`.
    """

    def __init__(self) -> None:
        self.slice_var_up = True
        self.split_method: type[PSDispatcher] | str | None = None
        self.min_block_size = 8192
        self.sync_mode = True
        self.runtime_split_send_recv = False
        self.half_async = False
        self.completely_not_async = False
        self.enable_dc_asgd = False
        self.geo_sgd_mode = False
        self.mode = "pserver"
        self.print_log = False
        self.wait_port = False
        self.random_seed: int | None = None
        # ours: how params are cut into partitions (`transpiler.partition`): a name
        # (`paddle`, `angel`, `column`), `module:Class`, a Partitioner class or instance
        self.partitioner: str | type[Partitioner] | Partitioner | None = None
        self.clip_mode: str | None = None  # None: "exact" in sync mode, "trainer" in async (CLIP_MODES)


@dataclass(frozen=True)
class TranspileOptions:
    """Everything the passes need, validated once."""

    endpoints: tuple[str, ...]
    trainers: int
    trainer_id: int
    sync_mode: bool
    slice_var_up: bool
    dispatcher: type[PSDispatcher]
    min_block_size: int
    runtime_split_send_recv: bool = False
    half_async: bool = False
    random_seed: int = 0  # Paddle's `program.random_seed`: it shuffles the unsliced round-robin order
    partitioner: Partitioner | None = None  # None: paddle (slicing + dispatcher)

    @property
    def partitioner_name(self) -> str:
        return "paddle" if self.partitioner is None else partitioner_name(self.partitioner)
    clip_mode: str = "trainer"  # where gradient clips run: CLIP_MODES

    @property
    def distributed_mode(self) -> DistributedMode:
        if self.sync_mode:
            return DistributedMode.SYNC
        return DistributedMode.ASYNC if self.runtime_split_send_recv else DistributedMode.HALF_ASYNC

    @property
    def split_method_name(self) -> str:
        return dispatcher_name(self.dispatcher)


# Transpile cost is linear in trainers (a sync pserver declares every trainer's grad of
# every block): 16,000 trainers take about 5 s. Far beyond any job, it is a typo.
MAX_TRAINERS = 100_000

_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")


def split_endpoint_list(pservers: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`"h1:p1, h2:p2"` or a list → its entries, stripped of whitespace. An empty entry
    (`a:1,,b:2`, a leading or trailing comma) is malformed, not skipped: it is most likely
    an endpoint lost from a script. Nothing at all is "no pserver endpoints"."""
    items = pservers.split(",") if isinstance(pservers, str) else list(pservers)
    entries = tuple(str(item).strip() for item in items)
    if entries in ((), ("",)):
        raise TranspileError("no pserver endpoints given (expected host:port[,host:port...])")
    if "" in entries:
        given = pservers if isinstance(pservers, str) else ",".join(str(item) for item in items)
        raise TranspileError(
            f"malformed pserver endpoint list {given!r}: entry {entries.index('') + 1} of {len(entries)} is empty "
            "(expected host:port[,host:port...])"
        )
    return entries


def parse_endpoints(pservers: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`"h1:p1,h2:p2"` or a list → a tuple of endpoints; empty entries, duplicates and
    malformed endpoints raise."""
    endpoints = split_endpoint_list(pservers)
    for endpoint in endpoints:
        match = _ENDPOINT.match(endpoint)
        if not match or not 0 < int(match["port"]) < 65536:
            raise TranspileError(f"malformed pserver endpoint {endpoint!r} (expected host:port, port 1-65535)")
    seen: dict[tuple[str, int], str] = {}
    for endpoint in endpoints:
        key = socket_key(endpoint)
        if seen.get(key) == endpoint:
            raise TranspileError(f"pserver endpoint {endpoint} is listed twice")
        if key in seen:
            raise TranspileError(f"pserver endpoints {seen[key]} and {endpoint} name the same socket")
        seen[key] = endpoint
    return endpoints


# Names every process resolves to this machine's loopback address, without asking a
# resolver: a transpile never touches the network, so other host names compare as written.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def socket_key(endpoint: str) -> tuple[str, int]:
    """What an endpoint listens on, so that `127.0.0.1:06170`, `127.0.0.1:6170` and
    `localhost:6170` compare equal: the port as a number, an IP address in its canonical
    form, `localhost` as 127.0.0.1, other names lower-cased."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        host = "127.0.0.1"
    if not _is_canonical_ipv4(host):
        import ipaddress  # here: most endpoints are plain IPv4, and the CLI starts faster without it

        try:
            host = ipaddress.ip_address(host).compressed
        except ValueError:
            pass  # a host name
    return (host, int(port))


def _is_canonical_ipv4(host: str) -> bool:
    """`a.b.c.d` with every part 0..255 written without leading zeros: what `ipaddress`
    would give back unchanged."""
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and p.isascii() and str(int(p)) == p and int(p) < 256 for p in parts)


# Where gradient-clip ops run (transpiler/passes/keep_clip_on_trainer.py):
# "trainer": on each trainer, on its own grad (Paddle 1.8's programs, op for op; the
#   default in async mode);
# "exact": sync mode only, its default; `clip` (ClipGradByValue) and `clip_by_norm` (ClipGradByNorm) run
#   on the pserver after the grads are averaged, as local training clips (a sliced param's
#   norm summed across the pservers holding it); a global-norm clip too, its norm summed across the pservers
#   (transpiler/passes/pserver_norm_reduce.py, ops/rpc/reduce.py).
CLIP_MODES = ("trainer", "exact")


def make_options(
    config: DistributeTranspilerConfig | None,
    *,
    pservers,
    trainers: int,
    trainer_id: int,
    sync_mode: bool | None = None,
    slice_var_up: bool | None = None,
    split_method=None,
    min_block_size: int | None = None,
    random_seed: int | None = None,
    partitioner=None,
    clip_mode: str | None = None,
) -> TranspileOptions:
    """Merge explicit arguments over `config` and validate the result."""
    config = config or DistributeTranspilerConfig()
    if config.mode != "pserver":
        raise TranspileError(f"mode {config.mode!r} is not supported; only 'pserver' mode is")
    if config.enable_dc_asgd:
        raise TranspileError("enable_dc_asgd is not supported")
    if config.geo_sgd_mode:
        raise TranspileError("geo_sgd_mode is not supported")
    if isinstance(trainers, bool) or not isinstance(trainers, int) or trainers < 1:
        raise TranspileError(f"trainers must be an integer >= 1, got {trainers!r}")
    if trainers > MAX_TRAINERS:
        raise TranspileError(f"trainers must be at most {MAX_TRAINERS} (a sync pserver declares a grad per trainer), "
                             f"got {trainers}")
    if isinstance(trainer_id, bool) or not isinstance(trainer_id, int) or not 0 <= trainer_id < trainers:
        raise TranspileError(f"trainer_id must be in [0, {trainers - 1}] for {trainers} trainer(s), got {trainer_id!r}")
    sync = (config.sync_mode or config.completely_not_async) if sync_mode is None else bool(sync_mode)
    runtime_split = bool(config.runtime_split_send_recv)
    if sync and runtime_split:
        raise TranspileError("runtime_split_send_recv needs async mode (sync_mode=False)")
    block_size = config.min_block_size if min_block_size is None else min_block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise TranspileError(f"min_block_size must be an integer >= 1, got {block_size!r}")
    seed = getattr(config, "random_seed", None) if random_seed is None else random_seed
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise TranspileError(f"random_seed must be an integer in [0, 2**32), got {seed!r}")
    chosen = resolve_partitioner(getattr(config, "partitioner", None) if partitioner is None else partitioner)
    if isinstance(chosen, PaddlePartitioner):
        chosen = None
    elif runtime_split:
        raise TranspileError(f"partitioner {partitioner_name(chosen)} needs the trainer to split grads itself; "
                             "runtime_split_send_recv splits by rows at run time")
    clip = getattr(config, "clip_mode", None) if clip_mode is None else clip_mode
    if clip is None:  # the default: local training's clip where there is an averaged grad
        clip = "exact" if sync else "trainer"
    if clip not in CLIP_MODES:
        raise TranspileError(f"clip_mode must be one of {', '.join(CLIP_MODES)}, got {clip!r}")
    if clip == "exact" and not sync:
        raise TranspileError("clip_mode='exact' needs sync mode: an async pserver applies each trainer's grad "
                             "alone, so there is no averaged grad to clip (use clip_mode='trainer')")
    return TranspileOptions(
        partitioner=chosen,
        endpoints=parse_endpoints(pservers),
        trainers=trainers,
        trainer_id=trainer_id,
        sync_mode=sync,
        slice_var_up=config.slice_var_up if slice_var_up is None else bool(slice_var_up),
        dispatcher=resolve_dispatcher(config.split_method if split_method is None else split_method),
        min_block_size=block_size,
        runtime_split_send_recv=runtime_split,
        half_async=bool(config.half_async) and not sync,
        random_seed=seed,
        clip_mode=clip,
    )
