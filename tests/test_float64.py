"""Training in float64, the documented way: `transpiler.api.as_float64`, `pstranspile cast
--float64`, `pstranspile transpile|plan --float64` and `examples/train_program.py --float64`."""

from __future__ import annotations

import numpy as np
from e2e_support import EXAMPLES, run_script_locally

from conftest import PADDLE_PROGRAMS
from transpiler.api import as_float64, transpile
from transpiler.cli import main as cli_main
from transpiler.ir import DType, Program

MLP = PADDLE_PROGRAMS / "mlp_adam_2ps"
EPS = "127.0.0.1:6170,127.0.0.1:6171"


def float_dtypes(program: Program) -> set[DType]:
    return {v.dtype for b in program.blocks for v in b.vars.values() if v.dtype in (DType.FP32, DType.FP64)}


def test_the_api_exports_as_float64_and_the_copy_transpiles():
    main, startup = Program.load(MLP / "main.pb"), Program.load(MLP / "startup.pb")
    wide_main, wide_startup = as_float64(main), as_float64(startup)
    assert float_dtypes(main) == {DType.FP32} and float_dtypes(wide_main) == {DType.FP64}
    result = transpile(wide_main, wide_startup, pservers=EPS, trainers=2)
    assert float_dtypes(result.trainer) == {DType.FP64}
    for pserver, pserver_startup in result.pservers.values():
        assert float_dtypes(pserver) == float_dtypes(pserver_startup) == {DType.FP64}


def test_cli_cast_writes_the_float64_copy(tmp_path, capsys):
    out = tmp_path / "main64.pb"
    assert cli_main(["cast", str(MLP / "main.pb"), "--float64", "-o", str(out)]) == 0
    assert Program.load(out).to_bytes() == as_float64(Program.load(MLP / "main.pb")).to_bytes()
    assert cli_main(["cast", str(MLP / "main.pb"), "-o", str(out)]) == 2  # the precision must be named
    assert "--float64" in capsys.readouterr().err


def test_cli_transpile_float64(tmp_path):
    argv = ["transpile", str(MLP / "main.pb"), "--pservers", EPS, "--trainers", "2", "--float64", "-o", str(tmp_path)]
    assert cli_main(argv) == 0
    assert float_dtypes(Program.load(tmp_path / "trainer.pb")) == {DType.FP64}
    assert float_dtypes(Program.load(tmp_path / "pserver_127.0.0.1_6170_startup.pb")) == {DType.FP64}


def test_train_program_float64(tmp_path):
    run_script_locally((str(EXAMPLES / "train_program.py"), "--main", str(MLP / "main.pb"), "--startup",
                        str(MLP / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "2", "--float64",
                        "--save", str(tmp_path)))
    saved = np.load(tmp_path / "local.npz")
    assert saved.files and all(saved[k].dtype == np.float64 for k in saved.files)
