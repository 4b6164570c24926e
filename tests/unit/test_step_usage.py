"""What a step cost: every step records wall and CPU seconds and its own peak memory; the report shows it."""

import mmap
import sys

import pytest

from components.report import inputs, sections
from components.runs import read_usage
from components.steps.base import step
from components.steps.usage import measured

MiB = 1024 * 1024

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _touch(n_bytes: int) -> int:
    """Make ``n_bytes`` of fresh pages resident, then free them: an anonymous map, not the allocator, whose
    freed but still resident heap a long-lived process (a pytest-xdist worker) may reuse without growing."""
    block = mmap.mmap(-1, n_bytes)
    for i in range(0, n_bytes, 4096):  # resident, not just reserved
        block[i] = 1
    block.close()
    return n_bytes


def test_the_peak_is_the_steps_own_not_an_earlier_ones():
    big: dict = {}
    with measured(big):
        _touch(300 * MiB)
    small: dict = {}
    with measured(small):
        _touch(20 * MiB)
    assert big["peak_is_step_only"] and small["peak_is_step_only"]
    assert big["peak_rss_mib"] - small["peak_rss_mib"] > 200  # the 300 MiB block is not the second step's
    assert big["wall_s"] >= big["cpu_s"] * 0.5 > 0 and big["workers_cpu_s"] == 0


def test_each_step_records_its_cost_and_outcome_and_the_report_shows_them(tmp_path):
    run_dir = tmp_path / "runs" / "phase-000-x"
    config = {"workspace": str(tmp_path / "ws")}

    @step("allocate")
    def allocate(deployment, run_dir, n_bytes):
        return _touch(n_bytes)

    @step("fail")
    def fail(deployment, run_dir):
        _touch(10 * MiB)
        raise ValueError("shard 3 is truncated")

    assert allocate(config, run_dir, 150 * MiB) == 150 * MiB
    with pytest.raises(ValueError):
        fail(config, run_dir)
    allocate(config, None, MiB)  # no run directory: nothing to record it in, and nothing breaks

    used = {u["step"]: u for u in read_usage(run_dir)}
    assert list(used) == ["allocate", "fail"]
    assert used["allocate"]["outcome"] == "ok" and used["fail"]["outcome"] == "ValueError"
    assert used["allocate"]["peak_is_step_only"] and used["fail"]["peak_is_step_only"]
    assert used["allocate"]["peak_rss_mib"] - used["fail"]["peak_rss_mib"] > 100
    assert (run_dir / "failure.json").is_file()  # the failure record is unchanged beside it

    built = {s.key: s for s in sections.build(inputs.load(run_dir))}
    table = built["usage"].items[0]
    assert [row[:2] for row in table.rows] == [["allocate", "ok"], ["fail", "ValueError"]]
    assert built["usage"].status == f"peak {used['allocate']['peak_rss_mib']:.0f} MiB"


def test_a_run_without_usage_has_no_resources_section(tmp_path):
    assert "usage" not in {s.key for s in sections.build(inputs.load(tmp_path))}


def test_a_failed_steps_usage_is_not_read_as_its_output(tmp_path):
    """The report finds a step's output by file name anywhere in the run: a gate step that failed before
    writing gate.json has only its usage record, which must not be taken for it."""

    @step("gate")
    def gate(deployment, run_dir):
        raise RuntimeError("no evaluation")

    with pytest.raises(RuntimeError):
        gate({"workspace": str(tmp_path / "ws")}, tmp_path / "run")
    assert inputs.load(tmp_path / "run")["gate"].path is None
