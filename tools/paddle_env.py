"""Paddle itself, as a test and benchmark reference: one venv per version, made on demand.

Paddle is never a dependency of the product. The interop test, the side-by-side benchmark
and the fixture generators run Paddle in a separate interpreter, in a venv kept under
`$PSTRANSPILE_PADDLE_HOME` (default `~/.cache/ps-transpiler/paddle`) so that it survives
fresh clones (CI builds one once per machine, then reuses it).

    python tools/paddle_env.py 1.8.5      # make (or find) the Fluid 1.8.5 venv, print its python
    python tools/paddle_env.py 2.6.2

Fluid 1.8.5 wheels exist for CPython 3.5-3.8 only (this machine has 3.7 under pyenv);
Paddle 2.6.2 runs on 3.11.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


class PaddleUnavailable(RuntimeError):
    """Paddle cannot be installed here; the message says why (one line)."""


@dataclass(frozen=True)
class PaddleVersion:
    version: str
    python: str  # the interpreter version its wheel needs, e.g. "3.7"
    packages: tuple[str, ...]


VERSIONS = {
    "1.8.5": PaddleVersion("1.8.5", "3.7", ("paddlepaddle==1.8.5", "numpy<1.20", "protobuf<3.21")),
    "2.6.2": PaddleVersion("2.6.2", "3.11", ("paddlepaddle==2.6.2",)),
}

# What every Paddle process should run with on this 2-core AMD machine: Paddle 1.8.5's bundled
# MKL takes a slow path on AMD CPUs unless forced to AVX2, and 4 processes share 2 cores.
PADDLE_SPEED_ENV = {
    "MKL_DEBUG_CPU_TYPE": "5",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "CPU_NUM": "1",
    "GLOG_minloglevel": "2",
}


def remove_port_file(pid: int) -> None:
    """Remove the file a Fluid pserver's `listen_and_serv` writes its port to
    (`/tmp/paddle.<pid>.port`, its SavePort): a pserver the harness kills cannot."""
    Path(f"/tmp/paddle.{pid}.port").unlink(missing_ok=True)


def home() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ps-transpiler" / "paddle"
    return Path(os.environ.get("PSTRANSPILE_PADDLE_HOME", default))


def find_interpreter(python: str) -> Path | None:
    """A `pythonX.Y` on PATH, or pyenv's newest X.Y.*."""
    found = shutil.which(f"python{python}")
    if found and _runs(Path(found)):
        return Path(found)
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    versions = Path(root) / "versions"
    if versions.is_dir():
        candidates = sorted((p for p in versions.iterdir() if p.name.startswith(python + ".")),
                            key=lambda p: tuple(int(x) for x in p.name.split(".") if x.isdigit()))
        for candidate in reversed(candidates):
            exe = candidate / "bin" / "python"
            if _runs(exe):
                return exe
    return None


def _runs(exe: Path) -> bool:
    try:
        return subprocess.run([str(exe), "-c", "pass"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def venv_python(version: str) -> Path:
    return home() / f"venv-{version}" / "bin" / "python"


def installed(version: str) -> Path | None:
    """The venv's python if Paddle `version` is ready in it, without installing anything."""
    exe = venv_python(version)
    if (exe.parent.parent / ".ready").exists() and _runs(exe):
        return exe
    return None


def ensure(version: str, *, log=print) -> Path:
    """The python of a venv holding Paddle `version`, made first if need be (1-3 minutes).
    Raises PaddleUnavailable (one line) where it cannot be made."""
    if version not in VERSIONS:
        raise PaddleUnavailable(f"unknown Paddle version {version!r} (known: {', '.join(VERSIONS)})")
    ready = installed(version)
    if ready is not None:
        return ready
    spec = VERSIONS[version]
    base = find_interpreter(spec.python)
    if base is None:
        raise PaddleUnavailable(f"Paddle {version} needs Python {spec.python}, and none was found (PATH, pyenv)")
    venv = venv_python(version).parent.parent
    staging = venv.with_name(venv.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    log(f"paddle_env: creating a Python {spec.python} venv for Paddle {version} in {venv} (1-3 minutes, once)")
    try:
        _check([str(base), "-m", "venv", str(staging)], "venv")
        pip = [str(staging / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _check([*pip, *spec.packages], "pip install " + " ".join(spec.packages))
    except PaddleUnavailable:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # A venv's scripts name its own path: build in place of the final folder by renaming,
    # then rewrite nothing - `python -m` is all we use, which does not depend on the path.
    shutil.rmtree(venv, ignore_errors=True)
    os.replace(staging, venv)
    _fix_pyvenv_paths(venv, staging)
    (venv / ".ready").write_text(version + "\n")
    exe = venv_python(version)
    if not _runs(exe):
        raise PaddleUnavailable(f"the Paddle {version} venv in {venv} does not start")
    return exe


def _fix_pyvenv_paths(venv: Path, old: Path) -> None:
    """Scripts in bin/ have the staging path in their shebang; point them at the final one."""
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            try:
                text = script.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if str(old) in text:
                script.write_text(text.replace(str(old), str(venv)))


def _check(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PaddleUnavailable(f"{what} failed: {error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PaddleUnavailable(f"{what} failed: {last}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python tools/paddle_env.py {{{'|'.join(VERSIONS)}}}", file=sys.stderr)
        return 2
    try:
        print(ensure(args[0], log=lambda line: print(line, file=sys.stderr)))
    except PaddleUnavailable as error:
        print(f"paddle_env: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
