"""`transpiler.output`: the file names of a transpile result in each form, and Paddle 2.6
reading the `.pdmodel` (and Fluid 1.8 `__model__`) files we write."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import PADDLE_PROGRAMS
from tools.paddle_env import installed
from transpiler.api import transpile
from transpiler.ir import Program
from transpiler.output import FORMS, program_file_name, write_programs

EPS = "127.0.0.1:6170,127.0.0.1:6171"
CASES = ("mlp_adam_2ps", "bert_adam_clip_2ps_sync")  # a small one, and a Paddle 2.x model with 0-d vars and clips


def _result(case: str):
    folder = PADDLE_PROGRAMS / case
    return transpile(Program.load(folder / "main.pb"), Program.load(folder / "startup.pb"), pservers=EPS, trainers=2)


def test_file_names_per_form():
    assert [program_file_name("trainer", form) for form in FORMS] == ["trainer.pb", "trainer.pdmodel",
                                                                       "trainer/__model__"]
    with pytest.raises(ValueError, match="unknown output form 'onnx'"):
        program_file_name("trainer", "onnx")


def test_every_form_holds_the_same_bytes(tmp_path):
    result = _result("mlp_adam_2ps")
    written = {form: write_programs(tmp_path / form, result.trainer, result.trainer_startup, result.pservers,
                                    result.plan, form=form) for form in FORMS}
    for pb, pdmodel, fluid in zip(*written.values(), strict=True):
        assert pb.read_bytes() == pdmodel.read_bytes() == fluid.read_bytes()
    assert sorted(p.relative_to(tmp_path / "fluid18").as_posix() for p in written["fluid18"]) == sorted(
        ["plan.json", "trainer/__model__", "trainer_startup/__model__", "pserver_127.0.0.1_6170/__model__",
         "pserver_127.0.0.1_6170_startup/__model__", "pserver_127.0.0.1_6171/__model__",
         "pserver_127.0.0.1_6171_startup/__model__"])


PADDLE_READS = r"""
import json, sys
import paddle
paddle.enable_static()
out = {}
for path in sys.argv[1:]:
    with open(path, "rb") as handle:
        program = paddle.static.deserialize_program(handle.read())
    out[path] = {"blocks": [[op.type for op in block.ops] for block in program.blocks],
                 "vars": [sorted(block.vars) for block in program.blocks]}
print(json.dumps(out))
"""


@pytest.mark.parametrize("case", CASES)
def test_paddle_2_6_reads_the_pdmodel_and_model_files_we_write(tmp_path, case):
    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    result = _result(case)
    files = []
    for form in ("paddle", "fluid18"):
        files += [p for p in write_programs(tmp_path / form, result.trainer, result.trainer_startup, result.pservers,
                                            result.plan, form=form) if p.name != "plan.json"]
    script = tmp_path / "read.py"
    script.write_text(PADDLE_READS)
    done = subprocess.run([str(python), str(script), *map(str, files)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen) == len(files) == 12
    for path in files:  # Paddle sees every block, op and var we wrote, in our order
        ours = Program.load(path)
        assert seen[str(path)]["blocks"] == [[op.type for op in block.ops] for block in ours.blocks], path
        assert seen[str(path)]["vars"] == [sorted(block.vars) for block in ours.blocks], path
    assert "listen_and_serv" in seen[str(tmp_path / "paddle" / "pserver_127.0.0.1_6170.pdmodel")]["blocks"][0]
