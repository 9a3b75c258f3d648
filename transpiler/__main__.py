"""`python -m transpiler` is the `pstranspile` command."""

from __future__ import annotations

import sys

from transpiler.cli import main

if __name__ == "__main__":
    sys.exit(main())
