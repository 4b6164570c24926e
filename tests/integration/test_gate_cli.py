"""The gate's command line: exit codes a release job can act on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _gate_inputs import DRIFT_OK, VALIDATION_OK, make_report


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "gate", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )


def test_cli_exit_codes(tmp_path: Path) -> None:
    report, validation, drift = tmp_path / "r.json", tmp_path / "v.json", tmp_path / "d.json"
    report.write_text(json.dumps(make_report()))
    validation.write_text(json.dumps(VALIDATION_OK))
    drift.write_text(json.dumps(DRIFT_OK))
    common = ["--validation", str(validation), "--drift", str(drift)]

    ok = _cli("--report", str(report), *common, "--out", str(tmp_path / "pass"))
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "pass" / "gate.json").read_text())["decision"] == "pass"

    report.write_text(json.dumps(make_report())[:200])
    blocked = _cli("--report", str(report), *common, "--out", str(tmp_path / "block"))
    assert blocked.returncode == 1
    assert "report_malformed" in blocked.stdout
    assert json.loads((tmp_path / "block" / "gate.json").read_text())["decision"] == "block"

    usage = _cli(*common, "--out", str(tmp_path / "usage"))
    assert usage.returncode == 2 and "--report" in usage.stderr
    written = json.loads((tmp_path / "usage" / "gate.json").read_text())
    assert written["decision"] == "block" and written["reasons"][0]["code"] == "usage_error"
