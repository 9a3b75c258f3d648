"""Run a job's process seeing only its own checkpoint dir (tests; no tests here).

    python tests/isolation_support.py --template 'T/disk{pserver}/ckpt' --pservers 2 -- CMD...

As a command prefix under `pstranspile launch`: the process reads its role from Paddle's
variables (`TRAINING_ROLE`, `PADDLE_CURRENT_ENDPOINT`, `PADDLE_TRAINER_ID`), enters a
mount namespace of its own (`unshare --mount`) and mounts an empty read-only tmpfs over
every checkpoint dir of the template that is not its own: pserver i keeps
`{pserver}=i`, trainer 0 keeps `{pserver}=job` (its scratch dir), the other trainers keep
none. A read of another process's dir then finds an empty folder, and a write there fails,
as with a volume only its own pod mounts. The process prints one `isolation:` line saying
what it sees, then execs CMD.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

FIELD = "{pserver}"


def available() -> str | None:
    """None when `unshare --mount` and a tmpfs mount work here; else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o ro,size=4k none /mnt && echo ok"], capture_output=True, text=True,
                           timeout=20, check=False)
    if probe.returncode != 0 or probe.stdout.strip() != "ok":
        return f"unshare --mount with a tmpfs mount fails here: {probe.stderr.strip() or probe.returncode}"
    return None


def prefix(template: Path | str, pservers: int) -> tuple[str, ...]:
    """The command prefix that runs a job's process under this isolation."""
    return (sys.executable, str(Path(__file__).resolve()), "--template", str(template), "--pservers", str(pservers), "--")


def own_and_hidden(template: str, pservers: int, env: dict[str, str]) -> tuple[str | None, list[str]]:
    """(this process's own dir or None, the dirs to hide) by its role."""
    everyone = [template.replace(FIELD, str(i)) for i in range(pservers)] + [template.replace(FIELD, "job")]
    role = env.get("TRAINING_ROLE", "").upper()
    if role == "PSERVER":
        endpoints = (env.get("PADDLE_PSERVER_ENDPOINTS") or env.get("PADDLE_PSERVERS_IP_PORT_LIST", "")).split(",")
        own = template.replace(FIELD, str(endpoints.index(env["PADDLE_CURRENT_ENDPOINT"])))
    elif role == "TRAINER" and env.get("PADDLE_TRAINER_ID", "0") == "0":
        own = template.replace(FIELD, "job")
    else:
        own = None
    return own, [d for d in everyone if d != own]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--template", required=True)
    parser.add_argument("--pservers", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    own, hidden = own_and_hidden(os.path.abspath(args.template), args.pservers, dict(os.environ))
    for folder in hidden:
        os.makedirs(folder, exist_ok=True)  # a mount point
    mounts = " && ".join(f"mount -t tmpfs -o ro,size=4k isolated '{d}'" for d in hidden)
    check = " && ".join(f"[ -z \"$(ls -A '{d}')\" ]" for d in hidden)
    who = os.environ.get("TRAINING_ROLE", "?").lower()
    line = f"echo 'isolation: {who} sees only {own or 'no checkpoint dir'}; {len(hidden)} other dir(s) hidden' >&2"
    script = f"{mounts} && {check} && {line} && exec \"$@\""
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command])
    return 127


if __name__ == "__main__":
    sys.exit(main())
