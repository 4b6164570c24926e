"""`rollout.probe_tolerance` is finite and bounded where it is declared, a number YAML reads as text is
refused saying how YAML wants it, and the report warns when the tolerance leaves no probe able to halt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from components.deployment import MAX_PROBE_TOLERANCE, Deployment, error_lines


def problems(value: str) -> list[str]:
    try:
        Deployment.model_validate(yaml.safe_load(f"rollout: {{probe_tolerance: {value}}}"))
    except ValidationError as err:
        return error_lines(err)
    return []


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (".inf", "finite number"),
        (".nan", "finite number"),
        ("1.0e+9", f"less than or equal to {MAX_PROBE_TOLERANCE:g}"),
        ("1e9", "write the exponent with a dot and a sign (1.0e+9"),
        ("1.0e9", "write the exponent with a dot and a sign (1.0e+9"),
        ("-1", "greater than or equal to 0"),
    ],
)
def test_a_tolerance_that_is_not_a_finite_bounded_number_is_refused(value: str, said: str) -> None:
    found = problems(value)
    assert len(found) == 1 and found[0].startswith("rollout.probe_tolerance: ") and said in found[0], found


def test_a_tolerance_in_range_is_kept() -> None:
    assert problems("0") == problems("1.0e+2") == problems(str(MAX_PROBE_TOLERANCE)) == []


def test_the_report_warns_when_no_probe_can_halt(tmp_path: Path) -> None:
    from components.report import render, summary

    (tmp_path / "rollout").mkdir()
    state = {"status": "completed", "baseline": {"R@1": 8.2, "R@5": 20.0}, "probe_tolerance": 900.0}
    for floors, warned in (({"R@1": 0.0, "R@5": 0.0}, True), ({"R@1": 0.0, "R@5": 1.5}, False)):
        (tmp_path / "rollout" / "rollout_state.json").write_text(json.dumps({**state, "floors": floors}))
        line = "Warning: every probe floor is 0 (rollout.probe_tolerance 900.00 standard errors"
        assert (line in render(tmp_path, "md")) is warned and (line in summary(tmp_path)) is warned
