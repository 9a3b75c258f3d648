"""The distributed runtime: gRPC between trainers and pservers.

Importing this package registers the RPC kernels (`send`, `recv`, `send_barrier`,
`fetch_barrier`, `checkpoint_notify`, `prefetch`, `distributed_lookup_table`,
`listen_and_serv`) and `save` into the kernel registry.

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

from ops.rpc.engine import prefer_poller

prefer_poller()  # PSTRANSPILE_GRPC_ENGINE, before anything below imports gRPC (it reads its engine once)

from ops import kernels as _kernels  # noqa: F401  (the registry, and the local kernels first)
from ops.rpc import kernels, listen_and_serv, prefetch, reduce, table_io  # noqa: F401  (registers)
from ops.rpc.client import PrefetchRequest, RpcClient, RpcStats, close_clients, get_client
from ops.rpc.errors import PserverError, RpcError
from ops.rpc.server import PServer, ServeConfig
from ops.rpc.wire import WireError, WireVar, decode_var, encode_var

__all__ = [
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
