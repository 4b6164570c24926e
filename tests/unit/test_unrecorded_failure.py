"""A step whose process ended without recording its error (the warm task host died under it, or it was
killed) is reported by the name kfp.local gives it, never as "failed step: unknown"."""

from __future__ import annotations

from pathlib import Path

from pipelines.local_runner import _failure_of

KFP_FAILURE = (  # kfp.local's RuntimeError when a task fails inside the exit handler, colours included
    "Pipeline \x1b[95m'continual-upgrade'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m. Inner task "
    "failed: \x1b[96m'continual-op'\x1b[0m inside \x1b[96m'exit-handler-1'\x1b[0m."
)


def test_the_warm_host_dying_mid_run_names_the_step(tmp_path: Path) -> None:
    log = tmp_path / "pipeline.log"
    log.write_text("compatflow: the warm task host ended while task 4242 ran; the task was killed\n")
    failure = _failure_of(tmp_path, log, failed_task=KFP_FAILURE)
    assert failure["step"] == "continual" and failure["error"]["type"] == "TaskHostDied"
    assert "the warm task host ended while continual ran" in failure["error"]["message"]


def test_a_killed_step_is_named_and_no_named_step_stays_unknown(tmp_path: Path) -> None:
    log = tmp_path / "pipeline.log"
    log.write_text("Killed\n")
    failure = _failure_of(tmp_path, log, failed_task=KFP_FAILURE.replace("continual-op", "validate-op-2"))
    assert (failure["step"], failure["error"]["type"]) == ("validate", "TaskFailed")
    assert _failure_of(tmp_path, log)["step"] == "unknown"
