"""`python -m transpiler` is the `pstranspile` command."""

from __future__ import annotations

from transpiler.cli import run

if __name__ == "__main__":
    run()
