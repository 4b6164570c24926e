"""One progress reporter for long steps (compat.progress): plain lines with rate, ETA and fields where
output is not a terminal (KFP logs), nothing under -q, stacked live bars on a terminal; `--version`."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest

from compat import progress
from compat.progress import LINE_MARK, MODE_ENV, task, track


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "plain")
    monkeypatch.setenv(progress.EVERY_ENV, "0.01")


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(LINE_MARK)]


def test_plain_lines_give_count_rate_eta_and_fields(plain: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="compat.progress")
    steps = track(range(5), "training", unit="steps")
    for step in steps:
        time.sleep(0.015)
        steps.set(loss=1.0 / (step + 1))
    lines = progress_lines(caplog)
    assert lines and lines[0].startswith("[progress] training: 1/5 steps (20%), ")
    assert "steps/s, ETA " in lines[0] and "loss 1" in lines[0]
    assert lines[-1].startswith("[progress] training: done, 5 steps in ") and "loss 0.2" in lines[-1]


def test_a_resumed_step_counts_from_where_it_was(plain: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="compat.progress")
    with task("backfill stage 2", total=100, unit="items", completed=60) as handle:
        time.sleep(0.02)
        handle.advance(20, stage="25%")
    assert "80/100 items (80%)" in progress_lines(caplog)[0] and "stage 25%" in progress_lines(caplog)[0]


def test_quiet_reports_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(MODE_ENV, "quiet")
    monkeypatch.setenv(progress.EVERY_ENV, "0.001")
    caplog.set_level(logging.INFO, logger="compat.progress")
    for _ in track(range(3), "x"):
        time.sleep(0.005)
    assert progress_lines(caplog) == []


def test_bars_of_nested_steps_share_one_display(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "bar")
    with task("rollout", total=2) as outer:
        for _ in track(range(3), "encoding images"):  # a second live display would raise
            assert progress._DISPLAY.users == 2
        outer.advance(2)
    assert progress._DISPLAY.progress is None and progress._DISPLAY.users == 0


def test_run_echoes_progress_lines_of_its_tasks(tmp_path: Path) -> None:
    from pipelines.local_runner import _EchoingLog

    log_file, terminal = io.StringIO(), io.StringIO()
    echo = _EchoingLog(log_file, terminal)
    echo.write("12:00:01 INFO compat.progress: [progress] training: 3/10 steps (30%), 2.0 steps/s\n")
    echo.write("12:00:01 INFO other: chatter\n")
    assert terminal.getvalue() == "  training: 3/10 steps (30%), 2.0 steps/s\n"
    assert "chatter" in log_file.getvalue()
