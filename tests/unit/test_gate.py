"""Release gate on hand-made compatibility reports: each case gets the right decision and reason code."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from _gate_inputs import DRIFT_OK, VALIDATION_OK, make_report

import schemas
from components.gate import GatePolicy, PolicyError, decide, load_gate_policy, run_gate

BOTH_DIRECTIONS = {"directions": ["t2i", "i2t"]}


def _decide(report, **kwargs):
    """The gate on ``report``; the policy (a mapping merged over the default) requires both directions unless
    it says otherwise."""
    kwargs.setdefault("validation", VALIDATION_OK)
    kwargs.setdefault("drift", DRIFT_OK)
    policy = kwargs.pop("policy", None)
    if policy is None or isinstance(policy, dict):
        policy = {**BOTH_DIRECTIONS, **(policy or {})}
    decision = decide(report, policy, **kwargs)
    schemas.validate(decision.to_dict(), "gate_decision", source="decision")
    return decision


def test_clear_pass_lists_every_check(tmp_path: Path) -> None:
    path = tmp_path / "compat_report.json"
    path.write_text(json.dumps(make_report()))
    decision = _decide(path)
    assert decision.decision == "pass", decision.reasons
    assert decision.reasons == []
    names = {c.name for c in decision.checks}
    for d in ("t2i", "i2t"):
        assert {f"ecc.{d}.R@1", f"ecc_interval.{d}.R@1", f"retention.{d}.R@1"} <= names
    assert {"eval_size.images", "eval_size.captions", "validation", "drift", "policy"} <= names
    assert all(c.status == "pass" for c in decision.checks)
    assert len(decision.report_sha256) == 64
    assert decision.policy["retention"]["reference"] == "auto"


def test_negative_margin_in_one_direction_blocks() -> None:
    report = make_report()
    report["retrieval"]["i2t"]["new/old"]["R@1"] = 33.0  # old/old is 35
    report["margins"]["i2t"]["R@1"] = {"margin": -2.0, "ci_low": -3.5, "ci_high": -0.5}
    report["ecc"]["i2t"]["R@1"] = False
    decision = _decide(report)
    assert decision.decision == "block"
    margin = [r for r in decision.reasons if r.code == "ecc_margin"]
    assert len(margin) == 1 and margin[0].direction == "i2t" and margin[0].metric == "R@1"
    assert margin[0].value == pytest.approx(-2.0)
    assert "report_inconsistent" not in decision.reason_codes
    assert not any(r.direction == "t2i" for r in decision.reasons)


def test_positive_margin_whose_interval_crosses_zero_blocks() -> None:
    report = make_report()
    report["margins"]["t2i"]["R@1"].update(ci_low=-0.8, ci_high=8.8)
    decision = _decide(report)
    assert decision.decision == "block"
    assert decision.reason_codes == ["ecc_interval"]
    assert decision.reasons[0].direction == "t2i"
    # the same report passes when the policy does not ask for the interval
    assert _decide(report, policy={"require_ci_lower_above_zero": False}).decision == "pass"


def test_nan_blocks_and_names_the_field(tmp_path: Path) -> None:
    report = make_report()
    report["retrieval"]["t2i"]["new/old"]["R@1"] = float("nan")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))  # json writes the NaN token, which Python parses back
    decision = _decide(path)
    assert decision.decision == "block"
    assert "non_finite" in decision.reason_codes
    assert any("retrieval.t2i.new/old.R@1" in r.message for r in decision.reasons)
    json.dumps(decision.to_dict(), allow_nan=False)  # the decision itself stays valid JSON
    # infinity in an interval bound too
    report = make_report()
    report["margins"]["i2t"]["R@1"]["ci_low"] = float("inf")
    assert "non_finite" in _decide(report).reason_codes


def test_missing_direction_blocks() -> None:
    report = make_report()
    del report["retrieval"]["i2t"]
    decision = _decide(report)
    assert decision.decision == "block"
    missing = [r for r in decision.reasons if r.code == "missing_field"]
    assert missing and all(r.direction == "i2t" for r in missing)
    assert "report_invalid" in decision.reason_codes


def test_missing_metric_required_by_policy_blocks() -> None:
    decision = _decide(make_report(), policy={"ks": [1, 20]})
    assert decision.decision == "block"
    assert {r.metric for r in decision.reasons if r.code == "missing_field"} == {"R@20"}


def test_tiny_evaluation_set_blocks() -> None:
    report = make_report()
    report["eval_sizes"] = {"images": 12, "captions": 60}
    decision = _decide(report)
    assert decision.decision == "block"
    assert decision.reason_codes == ["eval_set_too_small", "eval_set_too_small"]
    assert decision.reasons[0].value == 12 and decision.reasons[0].threshold == 100


@pytest.mark.parametrize("content", ["", '{"schema_version": 1, "retrieval": {"t2i": {"old/old": {"R@1": 3'])
def test_truncated_json_blocks(tmp_path: Path, content: str) -> None:
    path = tmp_path / "compat_report.json"
    path.write_text(content)
    decision = _decide(path)
    assert decision.decision == "block"
    assert decision.reason_codes == ["report_malformed"]
    assert str(path) in decision.reasons[0].message


def test_missing_report_file_blocks(tmp_path: Path) -> None:
    decision = _decide(tmp_path / "nowhere.json")
    assert decision.decision == "block" and decision.reason_codes == ["report_unreadable"]


def test_report_that_vouches_for_itself_is_not_believed() -> None:
    report = make_report()
    report["retrieval"]["t2i"]["new/old"]["R@1"] = 29.0  # worse than old/old 30, but margins/ecc claim +4
    decision = _decide(report)
    assert decision.decision == "block"
    assert {"ecc_margin", "report_inconsistent"} <= set(decision.reason_codes)


def test_retention_floor_uses_independent_model_when_present() -> None:
    report = make_report()
    report["retrieval"]["t2i"]["new/new"]["R@1"] = 38.0  # 92.7% of independent 41.0, but above old/old 30
    decision = _decide(report)
    assert decision.reason_codes == ["retention_floor"]
    assert decision.reasons[0].threshold == pytest.approx(0.95 * 41.0)
    report["independent_new_new"] = None  # without an independent model the reference is old/old
    assert _decide(report).decision == "pass"
    assert "missing_field" in _decide(report, policy={"retention": {"reference": "independent"}}).reason_codes


def test_invalid_policy_blocks(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("min_margn: 1.0\n")  # typo: an unknown key must not relax the gate
    decision = _decide(make_report(), policy=bad)
    assert decision.decision == "block" and decision.reason_codes == ["policy_invalid"]
    assert "min_margn" in decision.reasons[0].message and decision.policy is None
    bad.write_text("directions: [t2i, x2y]\nretention: {floor: 1.5}\n")
    assert _decide(make_report(), policy=bad).reason_codes == ["policy_invalid"]
    bad.write_text("min_margin: .nan\n")
    assert _decide(make_report(), policy=bad).reason_codes == ["policy_invalid"]
    bad.write_text("ks: [1\n")
    assert _decide(make_report(), policy=bad).reason_codes == ["policy_invalid"]
    assert _decide(make_report(), policy=tmp_path / "absent.yaml").reason_codes == ["policy_unreadable"]
    with pytest.raises(PolicyError, match="min_margn"):
        GatePolicy.from_mapping({"min_margn": 1})


def test_partial_policy_merges_over_default(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("min_margin: 5.0\nretention: {floor: 0.5}\n")
    policy = load_gate_policy(path)
    assert policy.min_margin == 5.0 and policy.retention.floor == 0.5
    assert policy.retention.reference == "auto" and policy.directions == ["t2i"]  # the served direction
    decision = _decide(make_report(), policy=path)  # margins are +4 and +3: below 5
    assert [r.direction for r in decision.reasons if r.code == "ecc_margin"] == ["t2i"]


def test_default_policy_judges_the_served_direction_only() -> None:
    report = make_report()
    report["retrieval"]["i2t"]["new/old"]["R@1"] = 30.0  # old/old is 35: i2t regresses
    report["margins"]["i2t"]["R@1"] = {"margin": -5.0, "ci_low": -7.0, "ci_high": -3.0}
    report["ecc"]["i2t"]["R@1"] = False
    assert decide(report, None, validation=VALIDATION_OK, drift=DRIFT_OK).decision == "pass"
    assert _decide(report).reason_codes == ["ecc_margin", "ecc_interval"]  # a caption gallery's policy


def test_drift_too_severe_blocks() -> None:
    drift = copy.deepcopy(DRIFT_OK)
    drift["verdicts"]["image_embedding"]["severity"] = "high"  # overall says low; the worst verdict counts
    decision = _decide(make_report(), drift=drift, policy={"max_drift_severity": "medium"})
    assert decision.reason_codes == ["drift_too_severe"]
    assert decision.reasons[0].value == "high" and "image_embedding" in decision.reasons[0].message
    assert (
        _decide(make_report(), drift=drift).decision == "pass"
    )  # the default reports drift, never blocks on it
    assert _decide(make_report(), drift={"severity": "extreme"}).reason_codes == ["drift_invalid"]


def test_validation_blocked_blocks() -> None:
    validation = dict(VALIDATION_OK, blocked=True, blocked_reasons=["quarantined 9% > 5%"])
    decision = _decide(make_report(), validation=validation)
    assert decision.reason_codes == ["validation_blocked"]
    assert "quarantined 9% > 5%" in decision.reasons[0].message


def test_missing_summaries_block_when_required(tmp_path: Path) -> None:
    decision = decide(make_report(), None)
    assert sorted(decision.reason_codes) == ["drift_missing", "validation_missing"]
    relaxed = decide(make_report(), {"require_drift": False, "require_validation": False})
    assert relaxed.decision == "pass"
    assert {c.status for c in relaxed.checks if c.name in ("drift", "validation")} == {"skipped"}
    (tmp_path / "v.json").write_text('{"total": 3')
    assert "validation_invalid" in _decide(make_report(), validation=tmp_path / "v.json").reason_codes


def test_run_gate_writes_schema_valid_decision(tmp_path: Path) -> None:
    report = tmp_path / "compat_report.json"
    report.write_text(json.dumps(make_report()))
    decision = run_gate(report, tmp_path / "gate", policy=None)
    written = json.loads((tmp_path / "gate" / "gate.json").read_text())
    schemas.validate(written, "gate_decision", source="gate.json")
    assert written["decision"] == decision.decision == "block"  # no validation / drift summaries given
