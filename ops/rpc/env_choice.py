"""The runtime's `PSTRANSPILE_*` settings that name one of a few choices, read one way.

`PSTRANSPILE_GRPC_ENGINE` (`ops.rpc.engine`), `PSTRANSPILE_MALLOC` (`ops.rpc.malloc`),
`PSTRANSPILE_BULK` and `PSTRANSPILE_BULK_SHM` (`ops.rpc.bulk`), `PSTRANSPILE_EARLY_SEND` and `PSTRANSPILE_EARLY_RECV` (`ops.rpc.client`) are read with `env_choice`; `check_env_choices` is what `launch` and `pstranspile serve`
ask before starting anything, so a typo is one clear error there rather than a setting
silently ignored in every process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class EnvChoiceError(ValueError):
    """A setting names none of its choices."""


def env_choice(environ: Mapping[str, str] | None, variable: str, choices: tuple[str, ...],
               error: type[EnvChoiceError] = EnvChoiceError) -> str:
    """`variable`'s choice in `environ` (default `os.environ`): case and spaces ignored,
    unset or empty is the first choice; anything else raises `error`."""
    environ = os.environ if environ is None else environ
    choice = environ.get(variable, "").strip().lower() or choices[0]
    if choice not in choices:
        raise error(f"{variable}={environ[variable]!r}: expected one of {', '.join(choices)}")
    return choice


def check_env_choices(environ: Mapping[str, str] | None = None) -> None:
    """Raise `EnvChoiceError` for the first of the runtime's settings `environ` gets wrong."""
    from ops.rpc.bulk import bulk_choice, bulk_port, shm_choice
    from ops.rpc.client import early_choice, recv_choice
    from ops.rpc.engine import engine_env  # they read their settings with `env_choice`
    from ops.rpc.malloc import malloc_choice

    engine_env(environ)
    malloc_choice(environ)
    bulk_choice(environ)
    bulk_port(0, environ)
    shm_choice(environ)
    early_choice(environ)
    recv_choice(environ)


__all__ = ["EnvChoiceError", "check_env_choices", "env_choice"]
