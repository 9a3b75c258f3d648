"""What a process imports stays resident for its whole run (issue 30: a pserver's peak RSS
within 1.3x of what it must hold). So the RPC layer's kernels and the kernel families a
pserver seldom runs are registered by name (`register_lazily`) and imported at their first
lookup, a pserver never loads the trainer's client nor a trainer the server, and the
runtime leaves out modules it never runs (`transpiler.cost`, `sysconfig`, `tempfile`, the
`idna` codec, numpy.random for a uniform initializer). These tests keep it so: a real
job's processes list their modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import EXAMPLES, REPO, launch_ok

from conftest import PADDLE_PROGRAMS
from ops.kernels import LAZY_FAMILIES, get_kernel, register_lazily, registered_ops, unregister
from ops.kernels.registry import _REGISTRY
from ops.rpc import KERNEL_MODULES
from transpiler.errors import UnknownOpError

# never imported by a pserver (its own kernels and what serving runs aside)
NOT_IN_A_PSERVER = (
    "ops.rpc.client", "ops.rpc.early_recv", "ops.rpc.kernels", "ops.rpc.prefetch", "transpiler.cost", "sysconfig",
    "tempfile", "encodings.idna", "ops.kernels.control", "ops.kernels.nn", "ops.kernels.loss", "ops.kernels.recurrent",
    "ops.kernels.transformer", "ops.kernels.vision",
    "numpy.random",  # its startup's uniform_random draws through ops.kernels.pcg64
)
NOT_IN_A_TRAINER = ("ops.rpc.server", "ops.rpc.listen_and_serv", "ops.rpc.arrival_sum", "ops.rpc.serve")

# train_program.py, writing the process's modules at its exit into OUT/<role>.<pid>
LISTING = """import atexit, os, runpy, sys
def _write():
    with open(os.path.join({out!r}, f"{{os.environ.get('TRAINING_ROLE', 'LOCAL')}}.{{os.getpid()}}"), "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
atexit.register(_write)
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("declared", [KERNEL_MODULES, LAZY_FAMILIES], ids=["ops.rpc", "ops.kernels"])
def test_each_module_registered_by_name_registers_exactly_its_names(declared):
    registered_ops()  # imports every declared module
    for module, op_types in declared.items():
        found = {op for op, spec in _REGISTRY.items() if spec.fn.__module__ == module}
        assert found == set(op_types), module


def test_a_lookup_imports_the_declared_module_and_nothing_before():
    code = ("import sys, ops.rpc\n"
            "from ops.kernels import get_kernel, has_kernel\n"
            "before = [m for m in ('ops.rpc.kernels', 'ops.rpc.client', 'ops.rpc.server', 'ops.kernels.vision') if m in sys.modules]\n"
            "known = has_kernel('send') and has_kernel('conv2d')\n"
            "get_kernel('send')\n"
            "print(before, known, 'ops.rpc.kernels' in sys.modules, 'ops.rpc.client' in sys.modules,"
            " 'ops.kernels.vision' in sys.modules, ops.rpc.RpcClient.__module__, ops.rpc.server.__name__)")
    assert fresh_python(code) == "[] True True True False ops.rpc.client ops.rpc.server"


def test_a_declared_module_that_does_not_register_its_names_is_an_error_at_the_lookup():
    register_lazily("ops.rpc.errors", ("t30_never_registered",))
    try:
        with pytest.raises(UnknownOpError, match="ops.rpc.errors was declared to register t30_never_registered"):
            get_kernel("t30_never_registered")
        with pytest.raises(UnknownOpError, match="no kernel for op 't30_never_registered'"):
            get_kernel("t30_never_registered")  # the declaration is gone after the failed import
        register_lazily("ops.rpc.errors", ("t30_other",))
        with pytest.raises(ValueError, match="'t30_other' is already declared for ops.rpc.errors, not ops.rpc.wire"):
            register_lazily("ops.rpc.wire", ("t30_other",))
    finally:
        unregister("t30_never_registered")
        unregister("t30_other")


def test_a_pserver_checking_its_address_loads_no_idna_codec():
    code = ("import socket, sys\n"
            "from ops.rpc.bind import check_bindable\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            "check_bindable(f'127.0.0.1:{port}', who='pserver'); check_bindable(f'localhost:{port}', who='pserver')\n"
            "print('encodings.idna' in sys.modules)")
    assert fresh_python(code) == "False"


def test_a_pserver_and_a_trainer_of_a_real_job_import_only_their_own_side(tmp_path: Path):
    """1 pserver, 2 sync trainers on a Fluid 1.8-built program (bulk channel, sums on
    arrival), each process listing its modules at exit."""
    folder = PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps"
    out = tmp_path / "modules"
    out.mkdir()
    wrapper = tmp_path / "listing.py"
    wrapper.write_text(LISTING.format(out=str(out), script=str(EXAMPLES / "train_program.py")))
    command = (sys.executable, str(wrapper), "--main", str(folder / "main.pb"), "--startup", str(folder / "startup.pb"),
               "--loss", "mean_0.tmp_0", "--steps", "2", "--batch", "8")
    launch_ok(tmp_path, command, pservers=1, trainers=2, sync_mode=True, timeout=60.0)
    listed = {path.name: set(path.read_text().split()) for path in out.iterdir()}
    pservers = [mods for name, mods in listed.items() if name.startswith("PSERVER.")]
    trainers = [mods for name, mods in listed.items() if name.startswith("TRAINER.")]
    assert len(pservers) == 1 and len(trainers) == 2, sorted(listed)
    for mods in pservers:
        assert {"ops.rpc.server", "ops.rpc.bulk", "ops.kernels.optimizers"} <= mods  # it did serve
        assert not mods & set(NOT_IN_A_PSERVER), sorted(mods & set(NOT_IN_A_PSERVER))
    for mods in trainers:
        assert {"ops.rpc.client", "ops.rpc.kernels"} <= mods  # it did train
        assert not mods & set(NOT_IN_A_TRAINER), sorted(mods & set(NOT_IN_A_TRAINER))
