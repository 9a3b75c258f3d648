"""Who may talk to a pserver: the job token, TLS, the loopback default, and the handshake.

* **Job token.** Every process of a job holds the same secret (`PSTRANSPILE_JOB_TOKEN`, or
  a file named by `PSTRANSPILE_JOB_TOKEN_FILE` / `serve --token-file`; `launch` makes one per
  job). Every RPC carries it as gRPC metadata (`TOKEN_KEY`); the pserver's `Gate`
  compares it in constant time before any handler runs — before the request is even
  decoded — and answers a wrong or missing one `UNAUTHENTICATED` ("missing or wrong job
  token", never echoing what came), so such a request touches nothing.
* **TLS** (optional): a pserver with a certificate and key (`--tls-cert/--tls-key`,
  `PSTRANSPILE_TLS_CERT/KEY`) listens with TLS; with a CA (`--tls-ca`, `PSTRANSPILE_TLS_CA`)
  it also requires client certificates signed by it. A trainer speaks TLS when any of the
  three variables is set: the CA verifies the pservers, its own cert and key (if any) are
  its client certificate. Without TLS the token crosses the network in clear.
* **Loopback default.** A pserver without a token listens only on a loopback address;
  another address is refused before anything binds, unless `--insecure`
  (`PSTRANSPILE_INSECURE=1`) says otherwise, and the log line says which case holds.
* **Handshake.** A trainer's every RPC also carries what it was started as
  (`HANDSHAKE_KEY`: its id, the trainer count, sync or async, the plan's fingerprint); a
  pserver built for another count, mode or plan refuses it `FAILED_PRECONDITION`, naming
  both sides, and fails the job, so every process stops with that one reason. Fields a
  side does not know (a bare `RpcClient`; `serve` without `--plan`) are not compared.

Per call the gate costs one scan of the metadata, one `hmac.compare_digest` and one
string comparison with the handshakes already accepted (see benchmarks/RESULTS.md for the figures).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ops.rpc.errors import BindError
from transpiler.errors import PsTranspilerError

TOKEN_ENV = "PSTRANSPILE_JOB_TOKEN"
TOKEN_FILE_ENV = "PSTRANSPILE_JOB_TOKEN_FILE"
INSECURE_ENV = "PSTRANSPILE_INSECURE"
TLS_CERT_ENV = "PSTRANSPILE_TLS_CERT"
TLS_KEY_ENV = "PSTRANSPILE_TLS_KEY"
TLS_CA_ENV = "PSTRANSPILE_TLS_CA"

TOKEN_KEY = "x-pstranspile-job-token"  # gRPC metadata keys are lower case
HANDSHAKE_KEY = "x-pstranspile-handshake"
UNAUTHENTICATED_DETAILS = "missing or wrong job token"
SHORT_TOKEN = 16  # characters; a shorter token gets a warning


class AuthError(PsTranspilerError):
    """A token, token file or TLS setting that cannot be used."""


def _warn(text: str) -> None:
    print(f"pstranspile: warning: {text}", file=sys.stderr, flush=True)


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


# ------------------------------------------------------------------ the token


def check_token(token: str, source: str, warn: Callable[[str], None] = _warn) -> str:
    """`token` stripped of surrounding whitespace; an AuthError naming `source` when it
    cannot travel as gRPC metadata (empty, spaces, non-ASCII)."""
    token = token.strip()
    if not token:
        raise AuthError(f"the job token from {source} is empty")
    if not all("!" <= ch <= "~" for ch in token):
        raise AuthError(f"the job token from {source} must be printable ASCII without spaces")
    if len(token) < SHORT_TOKEN:
        warn(f"the job token from {source} has {len(token)} characters; use at least {SHORT_TOKEN} "
             "(e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def read_token_file(path: str | Path, source: str | None = None, warn: Callable[[str], None] = _warn) -> str:
    """The token in file `path` (surrounding whitespace dropped); a warning when other
    users may read the file."""
    source = source or str(path)
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text(encoding="ascii")
    except OSError as exc:
        raise AuthError(f"cannot read the job token file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise AuthError(f"the job token file {path} is not ASCII") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warn(f"the job token file {path} is readable by other users (mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    return check_token(text, source, warn)


def load_token(
    env: Mapping[str, str] | None = None, *, token_file: str | Path | None = None, warn: Callable[[str], None] = _warn
) -> str | None:
    """The job token: from `token_file` when given, else `PSTRANSPILE_JOB_TOKEN`, else the
    file `PSTRANSPILE_JOB_TOKEN_FILE` names; None when there is none."""
    env = _env(env)
    if token_file is not None:
        return read_token_file(token_file, f"--token-file {token_file}", warn)
    if env.get(TOKEN_ENV, ""):
        return check_token(env[TOKEN_ENV], TOKEN_ENV, warn)
    if env.get(TOKEN_FILE_ENV, "").strip():
        path = env[TOKEN_FILE_ENV].strip()
        return read_token_file(path, f"{TOKEN_FILE_ENV}={path}", warn)
    return None


def has_token(env: Mapping[str, str]) -> bool:
    """Whether `env` names a job token (without reading or checking it)."""
    return bool(env.get(TOKEN_ENV, "") or env.get(TOKEN_FILE_ENV, "").strip())


# ------------------------------------------------------------------ TLS


@dataclass(frozen=True)
class Tls:
    """PEM files: this side's certificate and key, and the CA the other side's chains to."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Tls | None:
        env = _env(env)
        paths = [env.get(key, "").strip() or None for key in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
        if not any(paths):
            return None
        cert, key, ca = (Path(p) if p else None for p in paths)
        return cls(cert, key, ca)

    def _read(self, path: Path | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as exc:
            raise AuthError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None

    def _pair(self) -> tuple[bytes, bytes] | None:
        if (self.cert is None) != (self.key is None):
            raise AuthError(f"TLS needs a certificate and its key together (--tls-cert/--tls-key, {TLS_CERT_ENV}/{TLS_KEY_ENV})")
        if self.cert is None:
            return None
        key, cert = self._read(self.key, "key"), self._read(self.cert, "certificate")
        assert key is not None and cert is not None
        return key, cert

    def server_credentials(self) -> grpc.ServerCredentials:
        """A pserver's: its cert and key; with a CA, client certificates signed by it are required."""
        pair = self._pair()
        if pair is None:
            raise AuthError(f"a pserver with TLS needs a certificate and key (--tls-cert/--tls-key, {TLS_CERT_ENV}/{TLS_KEY_ENV})")
        ca = self._read(self.ca, "CA")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A trainer's: the CA that verifies the pservers (default: the system's), and its
        own cert and key as a client certificate when it has them."""
        pair = self._pair()
        key, cert = pair if pair is not None else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca, "CA"), private_key=key,
                                            certificate_chain=cert)


# ------------------------------------------------------------------ the two sides


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1 (names other than localhost are not resolved)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class ServerAuth:
    """What a pserver requires of its callers."""

    token: str | None = None
    tls: Tls | None = None
    insecure: bool = False  # may listen beyond loopback without a token

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        token_file: str | Path | None = None,
        tls: Tls | None = None,
        insecure: bool = False,
        warn: Callable[[str], None] = _warn,
    ) -> ServerAuth:
        """The token (`token_file`, else the environment's), TLS (`tls`, else the
        environment's) and `insecure` or `PSTRANSPILE_INSECURE=1`."""
        env = _env(env)
        return cls(load_token(env, token_file=token_file, warn=warn), tls or Tls.from_env(env),
                   insecure or _flag(env, INSECURE_ENV))

    def __repr__(self) -> str:  # never print the token
        return f"ServerAuth(token={'set' if self.token else None}, tls={self.tls!r}, insecure={self.insecure})"

    def check_listen(self, where: str, endpoint: str) -> str:
        """The log line saying who may call a pserver listening on `where`; a BindError,
        before anything binds, for a non-loopback address without a token or `insecure`."""
        host = where.rpartition(":")[0]
        tls = "" if self.tls is None else (", TLS with client certificates" if self.tls.ca else ", TLS")
        if self.token is not None:
            return f"job token required on every RPC{tls or ', no TLS'}"
        if is_loopback(host):
            return f"no job token: listening on loopback only{tls}"
        if not self.insecure:
            raise BindError(
                f"pserver {endpoint}: refusing to listen on {where} without a job token (anyone who reaches it could "
                f"read every parameter and stop the job): set {TOKEN_ENV} or {TOKEN_FILE_ENV} (serve --token-file), "
                f"listen on loopback, or pass --insecure ({INSECURE_ENV}=1)"
            )
        return f"WARNING: no job token, anyone who reaches {where} controls this job (--insecure){tls}"

    def credentials(self) -> grpc.ServerCredentials | None:
        return None if self.tls is None else self.tls.server_credentials()


@dataclass(frozen=True)
class ClientAuth:
    """What a trainer presents: the token, and TLS."""

    token: str | None = None
    tls: Tls | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, warn: Callable[[str], None] = _warn) -> ClientAuth:
        env = _env(env)
        return cls(load_token(env, warn=warn), Tls.from_env(env))

    def __repr__(self) -> str:  # never print the token
        return f"ClientAuth(token={'set' if self.token else None}, tls={self.tls!r})"

    def channel(self, endpoint: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(endpoint, options=options)
        return grpc.secure_channel(endpoint, self.tls.channel_credentials(), options=options)

    def metadata(self, handshake: Handshake | None) -> tuple[tuple[str, str], ...]:
        """What every call carries."""
        out = []
        if self.token is not None:
            out.append((TOKEN_KEY, self.token))
        if handshake is not None:
            out.append((HANDSHAKE_KEY, handshake.encode()))
        return tuple(out)


# ------------------------------------------------------------------ the handshake


def plan_fingerprint(plan_json: Mapping[str, Any]) -> str:
    """16 hex digits of sha256 over a plan's JSON (`Plan.to_json()` or a loaded plan.json)
    without `trainers` and `sync_mode`, which the handshake compares on their own (nor the
    `cost` report `plan --json` adds): the
    endpoints, slicing options and where every block lives. Every process of a job
    transpiles the same plan (the determinism contract), so they all agree."""
    placement = {k: v for k, v in plan_json.items() if k not in ("trainers", "sync_mode", "cost")}
    text = json.dumps(placement, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_plan(path: str | Path) -> tuple[str, str]:
    """A plan.json file (what `transpile -o DIR` writes): its text and its fingerprint,
    from one read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
    except OSError as exc:
        raise AuthError(f"cannot read the plan {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AuthError(f"{path}: not a plan.json ({exc})") from None
    if not isinstance(data, dict) or "params" not in data:
        raise AuthError(f"{path}: not a plan.json (no params)")
    return text, plan_fingerprint(data)


def read_plan_fingerprint(path: str | Path) -> str:
    """The fingerprint of a plan.json file."""
    return read_plan(path)[1]


def _mode(sync_mode: bool) -> str:
    return "sync" if sync_mode else "async"


@dataclass(frozen=True)
class Handshake:
    """What a trainer was started as. `plan` is None when it does not know the plan."""

    trainer_id: int
    trainers: int
    sync_mode: bool
    plan: str | None = None

    def encode(self) -> str:
        text = f"trainer={self.trainer_id};trainers={self.trainers};mode={_mode(self.sync_mode)}"
        return text + (f";plan={self.plan}" if self.plan else "")

    @classmethod
    def decode(cls, text: str) -> Handshake:
        """The inverse of `encode`; a ValueError for anything else."""
        fields = dict(item.partition("=")[::2] for item in text.split(";"))
        if fields.get("mode") not in ("sync", "async"):
            raise ValueError(f"mode {fields.get('mode')!r}")
        return cls(int(fields["trainer"]), int(fields["trainers"]), fields["mode"] == "sync", fields.get("plan") or None)

    def describe(self) -> str:
        text = f"{self.trainers} trainer(s), {_mode(self.sync_mode)}"
        return text + (f", plan {self.plan}" if self.plan else "")


def mismatch(endpoint: str, got: Handshake, fanin: int, sync_mode: bool, plan: str | None) -> str | None:
    """Why pserver `endpoint` (built for `fanin` trainers, `sync_mode`, `plan`) cannot serve
    trainer `got`, or None when it can."""
    differs = []
    if got.trainers != fanin:
        differs.append("the trainer count (PADDLE_TRAINERS_NUM)")
    if got.sync_mode != sync_mode:
        differs.append("the mode (PSTRANSPILE_SYNC_MODE)")
    if got.plan and plan and got.plan != plan:  # a side that does not know the plan is not compared
        differs.append("the plan (endpoints, slicing or program)")
    if not differs:
        return None
    plans = bool(got.plan and plan and got.plan != plan)  # shown only when they differ
    ours = Handshake(-1, fanin, sync_mode, plan if plans else None).describe()
    theirs = Handshake(-1, got.trainers, got.sync_mode, got.plan if plans else None).describe()
    return (f"pserver {endpoint}: trainer {got.trainer_id} was started for {theirs} but this pserver serves {ours}: "
            f"{' and '.join(differs)} {'differs' if len(differs) == 1 else 'differ'}; "
            "every process of a job must be started alike")


# ------------------------------------------------------------------ the pserver's gate


def _abort_with(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that answers `code` without decoding the request."""

    def handler(request: bytes, context: grpc.ServicerContext) -> None:
        context.abort(code, details)

    return grpc.unary_unary_rpc_method_handler(handler)


_DENIED = _abort_with(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
_MALFORMED = _abort_with(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {HANDSHAKE_KEY} metadata")


class Gate(grpc.ServerInterceptor):
    """Checks every RPC's token, then its handshake, before the method's handler (and its
    request decoding) runs. A handshake that does not fit calls `refuse(reason)` (the
    pserver fails the job) and is answered FAILED_PRECONDITION with the reason."""

    def __init__(
        self,
        token: str | None,
        *,
        endpoint: str,
        fanin: int,
        sync_mode: bool,
        plan: str | None,
        refuse: Callable[[str], None],
    ) -> None:
        self._token = None if token is None else token.encode("ascii")
        self._endpoint, self._fanin, self._sync_mode, self._plan = endpoint, fanin, sync_mode, plan
        self._refuse = refuse
        self._accepted: set[str] = set()  # handshakes seen to fit (one per trainer)

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001 - gRPC's signature
        token = handshake = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_KEY:
                token = value
            elif key == HANDSHAKE_KEY:
                handshake = value
        if self._token is not None:
            given = token.encode("utf-8", "replace") if isinstance(token, str) else b""
            if not hmac.compare_digest(given, self._token):
                return _DENIED
        if handshake is not None and handshake not in self._accepted:
            refusal = self._check(handshake)
            if refusal is not None:
                return refusal
        return continuation(handler_call_details)

    def _check(self, text: str) -> grpc.RpcMethodHandler | None:
        try:
            got = Handshake.decode(text)
        except (KeyError, ValueError):
            return _MALFORMED
        reason = mismatch(self._endpoint, got, self._fanin, self._sync_mode, self._plan)
        if reason is None:
            if len(self._accepted) < 4 * self._fanin + 16:  # bounded: a caller cannot grow it forever
                self._accepted.add(text)
            return None
        self._refuse(reason)
        return _abort_with(grpc.StatusCode.FAILED_PRECONDITION, reason)


__all__ = [
    "HANDSHAKE_KEY",
    "INSECURE_ENV",
    "TLS_CA_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "TOKEN_KEY",
    "UNAUTHENTICATED_DETAILS",
    "AuthError",
    "ClientAuth",
    "Gate",
    "Handshake",
    "ServerAuth",
    "Tls",
    "has_token",
    "is_loopback",
    "load_token",
    "mismatch",
    "plan_fingerprint",
    "read_plan",
    "read_plan_fingerprint",
    "read_token_file",
]
