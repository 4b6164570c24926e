"""The gate's decision: ``pass`` only when every check passes, written as ``gate.json``; never fails open."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compat.io import utc_now, write_json_atomic
from components.gate.checks import Checks, check_drift, check_report, check_validation, describe, load_report
from components.gate.policy import GatePolicy, PolicyError, load_gate_policy
from components.state.documents import read_document
from components.state.run_dir import GATE_FILE

Value = int | float | str | bool | None  # a measured value or threshold; non-finite floats as strings


class Reason(BaseModel):
    """Why the gate blocked (or, for the first model, why it passed without a comparison)."""

    model_config = ConfigDict(extra="forbid")
    code: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    message: str = Field(min_length=1)
    direction: str | None = None
    metric: str | None = None
    value: Value = None
    threshold: Value = None


class CheckResult(BaseModel):
    """One evaluated check: its name, outcome and the sentence a person can act on."""

    model_config = ConfigDict(extra="forbid")
    name: str
    status: Literal["pass", "fail", "skipped"]
    code: str | None = None
    message: str
    direction: str | None = None
    metric: str | None = None
    value: Value = None
    threshold: Value = None


class GateDecision(BaseModel):
    """The release gate's decision on a compatibility report (``gate.json``): ``pass`` has no reason but the
    first model's (``bootstrap``); ``block`` has at least one. Every evaluated check is listed.
    ``schemas/gate_decision.schema.json`` is generated from this model (``make schemas``)."""

    model_config = ConfigDict(extra="forbid", title="Release gate decision")
    schema_version: Literal[1] = 1
    decision: Literal["pass", "block"]
    reasons: list[Reason]
    checks: list[CheckResult]
    policy: dict[str, Any] | None = Field(
        default=None, description="The resolved policy (null when it could not be read)."
    )
    policy_source: str | None = None
    report_path: str | None = None
    report_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    decided_at: str = Field(description="UTC, ISO 8601")
    inputs: dict[str, str | None] = Field(
        default_factory=dict, description="Where the validation and drift summaries came from (path or null)."
    )
    bootstrap: bool = Field(default=False, description="The first model's record: nothing to compare with.")

    @model_validator(mode="after")
    def _reasons_match_the_decision(self) -> GateDecision:
        if self.decision == "block" and not self.reasons:
            raise ValueError("a block decision needs at least one reason")
        if self.decision == "pass" and self.reasons and not self.bootstrap:
            raise ValueError("a pass decision has no reasons (but the first model's bootstrap record)")
        if self.decision == "pass" and not self.bootstrap and self.report_sha256 is None:
            raise ValueError("a pass decision names the sha256 of the report it passed")
        return self

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    @property
    def reason_codes(self) -> list[str]:
        return [r.code for r in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        """The document as written (unset optional fields of reasons and checks left out)."""
        document = self.model_dump(mode="json")
        for key in ("reasons", "checks"):
            document[key] = [
                {k: v for k, v in item.items() if v is not None or k in ("code", "message")}
                for item in document[key]
            ]
        return document

    def write(self, out_dir: str | Path) -> Path:
        """Write ``<out_dir>/gate.json`` atomically."""
        return write_json_atomic(Path(out_dir) / GATE_FILE, self.to_dict())

    @classmethod
    def read(cls, path: str | Path) -> GateDecision:
        """The decision in ``path``, checked: :class:`schemas.SchemaError` names the file and bad fields."""
        return read_document(cls, path, "run the gate step again (`compatflow gate`)")

    @classmethod
    def bootstrap_record(cls) -> GateDecision:
        """The first model's record: it passes with nothing to be compatible with."""
        return cls(
            decision="pass", reasons=[BOOTSTRAP_REASON], checks=[], bootstrap=True, decided_at=utc_now()
        )


BOOTSTRAP_REASON = Reason(
    code="bootstrap", message="no production model yet: the phase-0 model becomes the first production model"
)


def decide(
    report: Mapping[str, Any] | str | Path,
    policy: GatePolicy | Mapping[str, Any] | str | Path | None = None,
    *,
    validation: Mapping[str, Any] | str | Path | None = None,
    drift: Mapping[str, Any] | str | Path | None = None,
) -> GateDecision:
    """Decide on ``report`` (a compat_report mapping or a path) under ``policy`` (None: the shipped default;
    a mapping or a YAML path is merged over it). Never raises on bad input: every problem blocks."""
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
        reasons=[Reason.model_validate(r) for r in reasons],
        checks=[CheckResult.model_validate(c) for c in checks.items],
        policy=resolved.model_dump(mode="json") if resolved else None,
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
        reasons=[Reason(code=code, message=message)],
        checks=[CheckResult(name="gate", status="fail", code=code, message=message)],
        report_path=str(report) if report is not None else None,
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
    """The gate step: decide and write ``<out_dir>/gate.json``; an internal error still writes a block."""
    try:
        decision = decide(report, policy, validation=validation, drift=drift)
    except Exception as err:  # noqa: BLE001 - the gate must never fail open
        decision = block_decision(
            "gate_error", f"the gate crashed: {type(err).__name__}: {err}", report=report
        )
    decision.write(out_dir)
    return decision
