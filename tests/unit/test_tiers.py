"""The tiers hold: a unit test can start no process and bind no server socket (the guard refuses at the
call), each test is marked with the folder it lives in, and a test over five minutes is flagged."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import _tiers
import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_a_unit_test_cannot_start_a_process_or_a_server(unit_guard) -> None:
    assert unit_guard is not None and unit_guard.test is not None
    with pytest.raises(RuntimeError, match="starts a subprocess.*move it to tests/integration"):
        subprocess.run(["true"])
    with pytest.raises(RuntimeError, match="binds a socket"), socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
    with pytest.raises(RuntimeError, match="forks"):
        sys.audit("os.fork")
    assert len(unit_guard.refused) == 3
    unit_guard.refused.clear()  # refused as expected: the test itself passes


def test_a_kfp_or_service_library_import_is_found_when_the_test_ends() -> None:
    guard = _tiers.UnitGuard.__new__(_tiers.UnitGuard)  # not hooked: only its bookkeeping is tested
    guard.test, guard.refused = "t", []
    saved = sys.modules.pop("kfp", None)
    guard._modules_before = guard.loaded()
    try:
        sys.modules["kfp"] = type(sys)("kfp")
        assert guard.stop() == ["imports kfp"]
    finally:
        sys.modules.pop("kfp")
        if saved is not None:
            sys.modules["kfp"] = saved


def test_each_test_is_marked_with_its_folder(request) -> None:
    assert request.node.get_closest_marker("unit") is not None
    assert _tiers.tier_of(TESTS / "integration" / "test_index.py") == "integration"
    assert _tiers.tier_of(TESTS / "e2e" / "test_crash_resume.py") == "e2e"
    assert _tiers.tier_of(TESTS / "conftest.py") is None


def test_tests_over_five_minutes_are_flagged_and_written(tmp_path) -> None:
    durations = {
        "tests/unit/test_a.py::test_fast": 0.5,
        "tests/e2e/test_b.py::test_slow": 301.0,
        "tests/integration/test_c.py::test_slower": 420.0,
    }
    assert list(_tiers.over_limit(durations)) == [
        "tests/integration/test_c.py::test_slower",
        "tests/e2e/test_b.py::test_slow",
    ]
    out = tmp_path / "durations.json"
    _tiers.write_durations(out, durations)
    written = json.loads(out.read_text())
    assert written["tiers"] == {"unit": 0.5, "integration": 420.0, "e2e": 301.0}
    assert list(written["tests"])[0] == "tests/integration/test_c.py::test_slower"
    assert _tiers.read_baseline(out) == {"unit": 0.5, "integration": 420.0, "e2e": 301.0}


def test_the_committed_baseline_names_only_tests_that_exist() -> None:
    baseline = json.loads((TESTS / "durations.json").read_text())
    files = {node.split("::", 1)[0] for node in baseline["tests"]}
    missing = sorted(f for f in files if not (TESTS.parent / f).is_file())
    assert not missing, f"tests/durations.json names moved or removed files (run `make durations`): {missing}"
    assert max(baseline["tests"].values()) <= _tiers.LIMIT_S
