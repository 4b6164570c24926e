"""The gate's decision: ``pass`` only when every check passes, written as ``gate.json``; never fails open."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat.io import utc_now, write_json_atomic
from components.gate.checks import (
    Checks,
    check_drift,
    check_report,
    check_validation,
    describe,
    load_report,
)
from components.gate.policy import GatePolicy, PolicyError, load_gate_policy
from components.state.run_dir import GATE_FILE


@dataclass
class GateDecision:
    """What the gate decided and why; ``to_dict()`` matches ``schemas/gate_decision.schema.json``."""

    decision: str
    reasons: list[dict[str, Any]]
    checks: list[dict[str, Any]]
    policy: dict[str, Any] | None
    policy_source: str | None
    report_path: str | None
    report_sha256: str | None
    decided_at: str
    inputs: dict[str, str | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    @property
    def reason_codes(self) -> list[str]:
        return [r["code"] for r in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "decision": self.decision,
            "reasons": self.reasons,
            "checks": self.checks,
            "policy": self.policy,
            "policy_source": self.policy_source,
            "report_path": self.report_path,
            "report_sha256": self.report_sha256,
            "decided_at": self.decided_at,
            "inputs": self.inputs,
        }

    def write(self, out_dir: str | Path) -> Path:
        """Write ``<out_dir>/gate.json`` atomically (checked against its schema first)."""
        import schemas

        document = self.to_dict()
        schemas.validate(document, "gate_decision", source="gate decision")
        return write_json_atomic(Path(out_dir) / GATE_FILE, document)


def decide(
    report: Mapping[str, Any] | str | Path,
    policy: GatePolicy | Mapping[str, Any] | str | Path | None = None,
    *,
    validation: Mapping[str, Any] | str | Path | None = None,
    drift: Mapping[str, Any] | str | Path | None = None,
) -> GateDecision:
    """Decide on ``report`` (a compat_report mapping or a path to one) under ``policy``.

    ``policy`` None means the shipped default; a mapping or a YAML path is merged over it.
    ``validation`` and ``drift`` are the summaries (mappings or paths) of those stages.
    Never raises on bad input: every problem becomes a blocking reason.
    """
    checks = Checks()
    resolved: GatePolicy | None = None
    try:
        if isinstance(policy, GatePolicy):
            resolved = policy
        elif isinstance(policy, Mapping):
            resolved = GatePolicy.from_mapping(policy, source="<policy mapping>")
        else:
            resolved = load_gate_policy(policy)
        checks.ok("policy", f"policy loaded from {resolved.source}")
    except PolicyError as err:
        code = "policy_unreadable" if isinstance(err.__cause__, OSError) else "policy_invalid"
        checks.fail("policy", code, str(err))

    doc, report_sha, report_path = load_report(report, checks)
    if doc is not None and resolved is not None:
        check_report(doc, resolved, checks)
    if resolved is not None:
        check_validation(validation, resolved, checks)
        check_drift(drift, resolved, checks)

    reasons = checks.reasons()
    return GateDecision(
        decision="pass" if not reasons and resolved is not None and doc is not None else "block",
        reasons=reasons,
        checks=checks.items,
        policy=resolved.to_dict() if resolved else None,
        policy_source=resolved.source
        if resolved
        else (str(policy) if isinstance(policy, str | Path) else None),
        report_path=report_path,
        report_sha256=report_sha,
        decided_at=utc_now(),
        inputs={"validation": describe(validation), "drift": describe(drift)},
    )


def block_decision(code: str, message: str, *, report: str | Path | None = None) -> GateDecision:
    """A block decision for a gate that could not run at all (usage or internal error)."""
    return GateDecision(
        decision="block",
        reasons=[{"code": code, "message": message}],
        checks=[{"name": "gate", "status": "fail", "code": code, "message": message}],
        policy=None,
        policy_source=None,
        report_path=str(report) if report is not None else None,
        report_sha256=None,
        decided_at=utc_now(),
    )


def run_gate(
    report: str | Path,
    out_dir: str | Path,
    *,
    policy: str | Path | None = None,
    validation: str | Path | None = None,
    drift: str | Path | None = None,
) -> GateDecision:
    """The gate stage: decide and write ``<out_dir>/gate.json``; an internal error still writes a block."""
    try:
        decision = decide(report, policy, validation=validation, drift=drift)
    except Exception as err:  # noqa: BLE001 - the gate must never fail open
        decision = block_decision(
            "gate_error", f"the gate crashed: {type(err).__name__}: {err}", report=report
        )
    decision.write(out_dir)
    return decision
