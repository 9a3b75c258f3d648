"""The distributed runtime: gRPC between trainers and pservers.

Importing this package registers the RPC kernels (`send`, `recv`, `send_barrier`,
`fetch_barrier`, `checkpoint_notify`, `prefetch`, `distributed_lookup_table`,
`listen_and_serv`, `pserver_allreduce_sum`) and `save` into the kernel registry, by name:
the module of a kernel is imported when a program first runs one of its ops
(`register_lazily`), and `PServer`, `RpcClient`, ... below when first used. So a pserver
never loads the trainer's client and kernels, nor a trainer the server: what a process
imports stays resident for its whole run (issue 30, docs/runtime.md "Where a peak goes";
`tests/test_rpc_lazy_imports.py`).

| module | what |
|---|---|
| `wire` | `VariableMessage` / `VarBatch` bytes ⇄ LoDTensor / SelectedRows (zero-copy receive) |
| `engine` | which gRPC I/O engine (`PSTRANSPILE_GRPC_ENGINE`), applied before gRPC starts |
| `env_choice` | the `PSTRANSPILE_*` settings that name a choice, read and checked one way |
| `malloc` | glibc's malloc tuned to keep a step's freed MB buffers mapped (`PSTRANSPILE_MALLOC`) |
| `service` | the service's method paths, codecs, channel options, timeouts |
| `auth` | the job token, TLS, the loopback default, the trainer/pserver handshake |
| `bulk` | the bulk channel: tensors of a step's batches on a TCP stream beside gRPC (`PSTRANSPILE_BULK`) |
| `client` | `RpcClient`, one per trainer id per process (`get_client`) |
| `server` | `PServer`: the gRPC server and the sync / async protocols |
| `listen_and_serv` | the kernel that runs a `PServer` in a pserver program |
| `kernels` | the trainer-side kernels |
| `prefetch` | the trainer's prefetch kernels: `prefetch`, `distributed_lookup_table` |
| `table_io` | sparse table shards on disk: the `save` kernel, the shard format, the merge |
| `tensor_file` | Fluid's LoDTensor file format (one var per file, `save_persistables`') |
| `checkpoint` | checkpoints: atomic as a whole, confined to the pserver's dir, restore / reshard, warm start |
| `fetch` | whole params out of running pservers or a checkpoint (`pstranspile fetch`, `Session.pull`) |
| `serve` | run a pserver's startup and main programs (`pstranspile serve`) |
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.rpc.engine import prefer_poller

prefer_poller()  # PSTRANSPILE_GRPC_ENGINE, before anything below imports gRPC (it reads its engine once)

from ops import kernels as _kernels  # noqa: E402  (the registry, and the local kernels first)
from ops.rpc.errors import PserverError, RpcError  # noqa: E402
from ops.rpc.wire import WireError, WireVar, decode_var, encode_var  # noqa: E402

# module -> the op types it registers when imported (`tests/test_rpc_lazy_imports.py` checks them)
KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "ops.rpc.kernels": ("send", "recv", "send_barrier", "fetch_barrier", "checkpoint_notify"),
    "ops.rpc.prefetch": ("prefetch", "distributed_lookup_table"),
    "ops.rpc.listen_and_serv": ("listen_and_serv",),
    "ops.rpc.reduce": ("pserver_allreduce_sum",),
    "ops.rpc.table_io": ("save",),
}
for _module, _op_types in KERNEL_MODULES.items():
    _kernels.register_lazily(_module, _op_types)

# name -> the module that defines it, imported at first use (PEP 562)
_LAZY_NAMES = {
    "PrefetchRequest": "ops.rpc.client",
    "RpcClient": "ops.rpc.client",
    "RpcStats": "ops.rpc.client",
    "close_clients": "ops.rpc.client",
    "get_client": "ops.rpc.client",
    "PServer": "ops.rpc.server",
    "ServeConfig": "ops.rpc.server",
}

if TYPE_CHECKING:
    from ops.rpc.client import PrefetchRequest, RpcClient, RpcStats, close_clients, get_client
    from ops.rpc.server import PServer, ServeConfig


def __getattr__(name: str) -> Any:
    """A name of `_LAZY_NAMES`, or a submodule not imported yet (`ops.rpc.server` after a
    bare `import ops.rpc`, as when this package imported them all)."""
    module = _LAZY_NAMES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name.isidentifier() and (Path(__file__).parent / f"{name}.py").is_file():
        return importlib.import_module(f"{__name__}.{name}")  # binds itself as this package's attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KERNEL_MODULES",
    "PServer",
    "PrefetchRequest",
    "PserverError",
    "RpcClient",
    "RpcError",
    "RpcStats",
    "ServeConfig",
    "WireError",
    "WireVar",
    "close_clients",
    "decode_var",
    "encode_var",
    "get_client",
]
