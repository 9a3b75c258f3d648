"""What a pass is: a name, the bundle fields it needs, the fields it fills, and its `run`.

The pipeline runner checks the contract around every pass (`check_requires` before,
`check_produces` after), so a pipeline in the wrong order fails with a `PipelineError`
naming the pass and the missing field, not with an `AttributeError` deep inside a pass
(and not with an `assert`, which `python -O` drops).

A field is named as on the `Bundle` (`"analysis"`); `"pservers.startup"` means that field
of every `PserverPrograms` in `bundle.pservers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transpiler.errors import TranspileError

if TYPE_CHECKING:
    from transpiler.config import TranspileOptions
    from transpiler.passes.bundle import Bundle


class PipelineError(TranspileError):
    """A pass ran without what it requires, or did not produce what it declares."""


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Bundle, TranspileOptions], Bundle]
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()


def check_requires(step: Pass, bundle: Bundle) -> None:
    missing = [name for name in step.requires if not _present(bundle, name)]
    if missing:
        raise PipelineError(
            f"pass {step.name} requires {', '.join(missing)}, which no earlier pass produced; "
            "run the passes that produce it first"
        )


def check_produces(step: Pass, bundle: Bundle) -> None:
    missing = [name for name in step.produces if not _present(bundle, name)]
    if missing:
        raise PipelineError(f"pass {step.name} declares it produces {', '.join(missing)}, but left it unset")


def _present(bundle: Bundle, path: str) -> bool:
    field, _, member = path.partition(".")
    value = getattr(bundle, field)
    if not member:
        return _set(value)
    return _set(value) and all(_set(getattr(item, member)) for item in value.values())


def _set(value: Any) -> bool:
    """Not None, and a container (the pservers, ...) not empty."""
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)
