"""The RPC layer's errors."""

from __future__ import annotations

from transpiler.errors import PsTranspilerError


class RpcError(PsTranspilerError):
    """A trainer's RPC failed: the pserver could not be reached, timed out, or reported
    an error (whose reason the message carries)."""


class PserverError(PsTranspilerError):
    """A pserver gave up: a trainer vanished or failed, an optimize block failed, or it
    could not listen. The message names the pserver, the trainer and the step."""


class BindError(PserverError):
    """A pserver cannot listen on its endpoint (the port is in use, the host is not local)."""
