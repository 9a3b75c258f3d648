"""The exit of a training script: a job that fails says why in one line, not a traceback.

    if __name__ == "__main__":
        sys.exit(run_script(main))

A failure the runtime diagnosed (a pserver that stopped the job, a trainer that vanished,
a bad environment: every `PsTranspilerError`) prints `<script>: error: <reason>` and exits
1, which `launch` reports with the log's tail; Ctrl-C exits 130. Anything else is a bug in
the script and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from transpiler.errors import PsTranspilerError


def run_script(main: Callable[[], int | None]) -> int:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script"
    try:
        return main() or 0
    except PsTranspilerError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{prog}: error: {reason}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
