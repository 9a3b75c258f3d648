"""Shared test fixtures: the Paddle-built programs and golden-file comparison.

Golden files live in tests/golden/. `pytest --update-golden` (or `make golden`)
rewrites them from the current code; review that diff like code.
"""

from __future__ import annotations

import difflib
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GOLDEN_DIR = TESTS / "golden"
FIXTURES = TESTS / "fixtures"
PADDLE_PROGRAMS = FIXTURES / "paddle_programs"
_CASE_JSONS = {p.parent.name: json.loads(p.read_text()) for p in sorted(PADDLE_PROGRAMS.glob("*/case.json"))}
# The real models tools/make_paddle_fixtures.py writes (ResNet-50, BERT: 500-1500 ops each).
# test_paddle_real_models.py covers them (round trip, verifier, transpile against Paddle);
# the per-case and per-file tests of the small cases below (golden dumps, fuzzing, training
# on the numpy kernels) would mean megabytes of golden text, minutes of fuzzing, and kernels
# (conv2d, layer_norm, ...) the runtime does not have.
# The script's small control-flow programs (`"real_model": false`) are per-case tests' like the older cases.
REAL_MODEL_CASES = sorted(n for n, case in _CASE_JSONS.items()
                          if case.get("generator") == "tools/make_paddle_fixtures.py" and case.get("real_model", True))
PADDLE_CASES = sorted(n for n in _CASE_JSONS if n not in REAL_MODEL_CASES)
PADDLE_PB_FILES = sorted(p for p in PADDLE_PROGRAMS.glob("*/*.pb") if p.parent.name in PADDLE_CASES)


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", default=False, help="rewrite tests/golden/ from the current code"
    )


class Golden:
    """Compare text with tests/golden/<name>, or rewrite it under --update-golden."""

    def __init__(self, update: bool) -> None:
        self.update = update

    def check(self, name: str, text: str) -> None:
        path = GOLDEN_DIR / name
        if self.update:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"golden file {path.relative_to(TESTS.parent)} is missing; run `make golden` and review it")
        expected = path.read_text()
        if expected != text:
            diff = "".join(
                difflib.unified_diff(
                    expected.splitlines(keepends=True), text.splitlines(keepends=True), str(path), "actual", n=2
                )
            )
            pytest.fail(f"output differs from golden file {path.name} (`make golden` rewrites it):\n{diff[:6000]}")


@pytest.fixture
def golden(request) -> Golden:
    return Golden(request.config.getoption("--update-golden"))


@pytest.fixture(params=PADDLE_CASES)
def paddle_case(request) -> Path:
    """Each case folder of tests/fixtures/paddle_programs (main.pb, startup.pb, case.json, expected.json)."""
    return PADDLE_PROGRAMS / request.param


def load_case_json(case: Path) -> tuple[dict, dict]:
    return json.loads((case / "case.json").read_text()), json.loads((case / "expected.json").read_text())


def run_job_threads(pserver: Callable[[str], None], endpoints: Sequence[str], trainer: Callable[[int], None],
                    trainers: int, errors: list[BaseException]) -> None:
    """A distributed job in threads: `pserver(endpoint)` for each endpoint and
    `trainer(tid)` for each trainer, all joined (bounded); fails if one hangs or any
    thread put an exception in `errors`."""
    threads = [threading.Thread(target=pserver, args=(ep,)) for ep in endpoints]
    threads += [threading.Thread(target=trainer, args=(tid,)) for tid in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "training hung"
    assert not errors, errors
