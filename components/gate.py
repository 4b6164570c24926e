"""Release gate: decide ``pass`` or ``block`` for a candidate from its compatibility report.

The gate fails closed: anything it cannot read, parse, or find blocks with a reason that names
the file and field. A pass needs every check to pass:

* ``ecc_margin``: the empirical compatibility criterion, per required direction and K:
  ``M(new query, old gallery) - M(old query, old gallery) > min_margin`` (percentage points).
  The margin is recomputed from the retrieval matrix; a reported margin or ECC verdict that
  disagrees with it blocks as ``report_inconsistent`` (a report cannot vouch for itself).
* ``ecc_interval``: the bootstrap confidence interval's lower bound of that margin is above zero.
* ``eval_set_too_small``: the evaluation set has at least the policy's images and captions.
* ``retention_floor``: ``new/new R@K >= floor x reference R@K``; the reference is the independent
  new model's new/new when the report has one (policy ``reference: auto``), else old/old.
* ``drift_too_severe``: the drift severity (the worst of the overall and per-metric verdicts)
  is at most the policy's maximum.
* ``validation_blocked``: data validation did not block the phase.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_POLICY_PATH = Path(__file__).resolve().parent / "policies" / "gate_default.yaml"
SEVERITIES = ("none", "low", "medium", "high")
MARGIN_TOLERANCE = 0.05  # percentage points of rounding allowed between reported and recomputed margins
_MISSING = object()


class PolicyError(ValueError):
    """The gate policy is unreadable or invalid; the message names the file and the fields."""


@dataclass(frozen=True)
class GatePolicy:
    """Resolved release-gate thresholds (see ``components/policies/gate_default.yaml``)."""

    directions: tuple[str, ...]
    ks: tuple[int, ...]
    min_margin: float
    require_ci_lower_above_zero: bool
    min_eval_images: int
    min_eval_captions: int
    retention_floor: float
    retention_reference: str
    max_drift_severity: str
    require_drift: bool
    require_validation: bool
    source: str = "default"

    def to_dict(self) -> dict[str, Any]:
        """The policy in its YAML layout (what ``gate.json`` records)."""
        return {
            "schema_version": 1,
            "directions": list(self.directions),
            "ks": list(self.ks),
            "min_margin": self.min_margin,
            "require_ci_lower_above_zero": self.require_ci_lower_above_zero,
            "min_eval_images": self.min_eval_images,
            "min_eval_captions": self.min_eval_captions,
            "retention": {"floor": self.retention_floor, "reference": self.retention_reference},
            "max_drift_severity": self.max_drift_severity,
            "require_drift": self.require_drift,
            "require_validation": self.require_validation,
        }

    @classmethod
    def from_mapping(cls, overrides: Mapping[str, Any] | None = None, source: str = "<policy>") -> GatePolicy:
        """Merge ``overrides`` over the shipped default, validate, and build the policy."""
        import schemas

        base = _read_yaml(DEFAULT_POLICY_PATH, "default policy")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise PolicyError(f"{source}: a policy must be a mapping of keys, got {type(overrides).__name__}")
        merged = _merge(base, dict(overrides or {}))
        errors = schemas.schema_errors(merged, "gate_policy")
        errors += [f"{path}: {value!r} is not a finite number" for path, value in _non_finite(merged)]
        missing = sorted(set(base) - set(merged))
        errors += [f"{key}: required" for key in missing]
        if errors:
            raise PolicyError(
                f"{source} is not a valid gate policy (schemas/gate_policy.schema.json):\n  "
                + "\n  ".join(errors)
            )
        return cls(
            directions=tuple(merged["directions"]),
            ks=tuple(int(k) for k in merged["ks"]),
            min_margin=float(merged["min_margin"]),
            require_ci_lower_above_zero=bool(merged["require_ci_lower_above_zero"]),
            min_eval_images=int(merged["min_eval_images"]),
            min_eval_captions=int(merged["min_eval_captions"]),
            retention_floor=float(merged["retention"]["floor"]),
            retention_reference=str(merged["retention"]["reference"]),
            max_drift_severity=str(merged["max_drift_severity"]),
            require_drift=bool(merged["require_drift"]),
            require_validation=bool(merged["require_validation"]),
            source=source,
        )


def load_policy(path: str | Path | None = None) -> GatePolicy:
    """The shipped default (``path`` None) or a YAML policy merged over it; raises :class:`PolicyError`."""
    if path is None:
        return GatePolicy.from_mapping(None, source=str(DEFAULT_POLICY_PATH))
    path = Path(path)
    return GatePolicy.from_mapping(_read_yaml(path, "gate policy"), source=str(path))


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
        out = Path(out_dir) / "gate.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
        tmp.replace(out)
        return out


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
    checks = _Checks()
    resolved: GatePolicy | None = None
    try:
        if isinstance(policy, GatePolicy):
            resolved = policy
        elif isinstance(policy, Mapping):
            resolved = GatePolicy.from_mapping(policy, source="<policy mapping>")
        else:
            resolved = load_policy(policy)
        checks.ok("policy", f"policy loaded from {resolved.source}")
    except PolicyError as err:
        code = "policy_unreadable" if isinstance(err.__cause__, OSError) else "policy_invalid"
        checks.fail("policy", code, str(err))

    doc, report_sha, report_path = _load_report(report, checks)
    if doc is not None and resolved is not None:
        _check_report(doc, resolved, checks)
    if resolved is not None:
        _check_validation(validation, resolved, checks)
        _check_drift(drift, resolved, checks)

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
        decided_at=datetime.now(UTC).isoformat(timespec="seconds"),
        inputs={"validation": _describe(validation), "drift": _describe(drift)},
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
        decided_at=datetime.now(UTC).isoformat(timespec="seconds"),
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


# --- checks ------------------------------------------------------------------------------------


class _Checks:
    """Every evaluated check, in order; failing ones become the decision's reasons."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def ok(self, name: str, message: str, **fields: Any) -> None:
        self.items.append(
            {"name": name, "status": "pass", "code": None, "message": message, **_clean(fields)}
        )

    def skip(self, name: str, message: str) -> None:
        self.items.append({"name": name, "status": "skipped", "code": None, "message": message})

    def fail(self, name: str, code: str, message: str, **fields: Any) -> None:
        self.items.append(
            {"name": name, "status": "fail", "code": code, "message": message, **_clean(fields)}
        )

    def reasons(self) -> list[dict[str, Any]]:
        keep = ("code", "message", "direction", "metric", "value", "threshold")
        return [{k: c[k] for k in keep if k in c} for c in self.items if c["status"] == "fail"]


def _clean(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None fields; make non-finite numbers strings so gate.json stays valid JSON."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            value = repr(value)
        out[key] = round(value, 6) if isinstance(value, float) else value
    return out


def _load_report(
    report: Mapping[str, Any] | str | Path, checks: _Checks
) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """Parse the report; returns (document or None, sha256 of its bytes, path)."""
    if isinstance(report, Mapping):
        raw = json.dumps(report, sort_keys=True).encode()
        doc: Any = copy.deepcopy(dict(report))
        path = None
    else:
        path = str(report)
        try:
            raw = Path(report).read_bytes()
        except OSError as err:
            checks.fail("report", "report_unreadable", f"cannot read the compatibility report {path}: {err}")
            return None, None, path
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            what = "empty" if not raw.strip() else "truncated or malformed JSON"
            checks.fail("report", "report_malformed", f"compatibility report {path} is {what}: {err}")
            return None, hashlib.sha256(raw).hexdigest(), path
    sha = hashlib.sha256(raw).hexdigest()
    if not isinstance(doc, dict):
        checks.fail("report", "report_invalid", f"compatibility report {path or ''} is not a JSON object")
        return None, sha, path
    checks.ok("report", f"compatibility report parsed ({len(raw)} bytes)")
    return doc, sha, path


def _check_report(doc: dict[str, Any], policy: GatePolicy, checks: _Checks) -> None:
    import schemas

    errors = schemas.schema_errors(doc, "compat_report")
    if errors:
        shown = "; ".join(errors[:8]) + (f"; ... ({len(errors) - 8} more)" if len(errors) > 8 else "")
        checks.fail(
            "report_schema", "report_invalid", f"report breaks schemas/compat_report.schema.json: {shown}"
        )
    else:
        checks.ok("report_schema", "report matches schemas/compat_report.schema.json")
    bad = _non_finite(doc)
    if bad:
        shown = ", ".join(f"{p}={v!r}" for p, v in bad[:8])
        checks.fail("report_finite", "non_finite", f"report has non-finite numbers: {shown}", value=len(bad))
    else:
        checks.ok("report_finite", "every number in the report is finite")

    _check_eval_size(doc, policy, checks)
    for direction in policy.directions:
        for k in policy.ks:
            _check_ecc(doc, direction, f"R@{k}", policy, checks)
            _check_retention(doc, direction, f"R@{k}", policy, checks)


def _check_eval_size(doc: dict[str, Any], policy: GatePolicy, checks: _Checks) -> None:
    for key, minimum in (("images", policy.min_eval_images), ("captions", policy.min_eval_captions)):
        name = f"eval_size.{key}"
        value = _number(doc, ("eval_sizes", key), checks, name)
        if value is None:
            continue
        if value >= minimum:
            checks.ok(
                name,
                f"evaluation set has {value:g} {key} (minimum {minimum})",
                value=value,
                threshold=minimum,
            )
        else:
            checks.fail(
                name,
                "eval_set_too_small",
                f"evaluation set has {value:g} {key}, below the policy minimum of {minimum}: "
                "evaluate on a larger set",
                value=value,
                threshold=minimum,
            )


def _check_ecc(doc: dict[str, Any], direction: str, metric: str, policy: GatePolicy, checks: _Checks) -> None:
    name = f"ecc.{direction}.{metric}"
    tags = {"direction": direction, "metric": metric}
    old_old = _number(doc, ("retrieval", direction, "old/old", metric), checks, name, **tags)
    new_old = _number(doc, ("retrieval", direction, "new/old", metric), checks, name, **tags)
    if old_old is None or new_old is None:
        return
    margin = new_old - old_old
    verdict = _get(doc, ("ecc", direction, metric))
    if verdict is not _MISSING and verdict is not (margin > 0):
        checks.fail(
            name + ".verdict",
            "report_inconsistent",
            f"report's ecc.{direction}.{metric}={verdict} contradicts "
            f"new/old {new_old:g} vs old/old {old_old:g}",
            **tags,
        )
    if margin > policy.min_margin:
        checks.ok(
            name,
            f"{direction} {metric}: new/old {new_old:.2f} - old/old {old_old:.2f} = {margin:+.2f} pp",
            value=margin,
            threshold=policy.min_margin,
            **tags,
        )
    else:
        checks.fail(
            name,
            "ecc_margin",
            f"{direction} {metric}: new/old {new_old:.2f} - old/old {old_old:.2f} = {margin:+.2f} pp, "
            f"not above the minimum margin {policy.min_margin:g}: new queries read the old gallery worse",
            value=margin,
            threshold=policy.min_margin,
            **tags,
        )

    interval_name = f"ecc_interval.{direction}.{metric}"
    if not policy.require_ci_lower_above_zero:
        checks.skip(interval_name, "policy does not require the interval's lower bound above zero")
        return
    reported = _number(doc, ("margins", direction, metric, "margin"), checks, interval_name, **tags)
    low = _number(doc, ("margins", direction, metric, "ci_low"), checks, interval_name, **tags)
    high = _number(doc, ("margins", direction, metric, "ci_high"), checks, interval_name, **tags)
    if reported is None or low is None or high is None:
        return
    if abs(reported - margin) > MARGIN_TOLERANCE or low > high:
        checks.fail(
            interval_name,
            "report_inconsistent",
            f"margins.{direction}.{metric}: reported margin {reported:g} [{low:g}, {high:g}] does not match "
            f"new/old - old/old = {margin:g} or its bounds are reversed",
            value=reported,
            threshold=margin,
            **tags,
        )
    if low > 0:
        checks.ok(
            interval_name,
            f"{direction} {metric}: interval [{low:+.2f}, {high:+.2f}] lies above zero",
            value=low,
            threshold=0.0,
            **tags,
        )
    else:
        checks.fail(
            interval_name,
            "ecc_interval",
            f"{direction} {metric}: the bootstrap interval of the margin "
            f"[{low:+.2f}, {high:+.2f}] reaches zero: "
            "the improvement is not significant",
            value=low,
            threshold=0.0,
            **tags,
        )


def _check_retention(
    doc: dict[str, Any], direction: str, metric: str, policy: GatePolicy, checks: _Checks
) -> None:
    name = f"retention.{direction}.{metric}"
    tags = {"direction": direction, "metric": metric}
    new_new = _number(doc, ("retrieval", direction, "new/new", metric), checks, name, **tags)
    independent = doc.get("independent_new_new")
    use_independent = policy.retention_reference == "independent" or (
        policy.retention_reference == "auto" and independent is not None
    )
    if use_independent:
        label = "the independent new model's new/new"
        reference = _number(doc, ("independent_new_new", direction, metric), checks, name, **tags)
    else:
        label = "old/old"
        reference = _number(doc, ("retrieval", direction, "old/old", metric), checks, name, **tags)
    if new_new is None or reference is None:
        return
    threshold = policy.retention_floor * reference
    share = f"{100 * new_new / reference:.1f}%" if reference > 0 else "n/a"
    text = (
        f"{direction} {metric}: new/new {new_new:.2f} is {share} of {label} {reference:.2f} "
        f"(floor {100 * policy.retention_floor:g}%)"
    )
    if new_new >= threshold:
        checks.ok(name, text, value=new_new, threshold=threshold, **tags)
    else:
        checks.fail(
            name,
            "retention_floor",
            text + ": the candidate's own space regressed",
            value=new_new,
            threshold=threshold,
            **tags,
        )


def _check_validation(source: Any, policy: GatePolicy, checks: _Checks) -> None:
    doc = _load_summary(source, "validation", policy.require_validation, checks)
    if doc is None:
        return
    blocked = doc.get("blocked")
    if not isinstance(blocked, bool) or _non_finite(doc):
        checks.fail(
            "validation",
            "validation_invalid",
            f"validation summary {_describe(source)} needs a boolean 'blocked' and finite numbers",
        )
        return
    if blocked:
        why = doc.get("blocked_reasons") or []
        detail = "; ".join(str(r) for r in why) if isinstance(why, list) else str(why)
        checks.fail(
            "validation",
            "validation_blocked",
            f"data validation blocked the phase: {detail or 'no reason given'}",
            value=True,
            threshold=False,
        )
    else:
        checks.ok(
            "validation",
            f"data validation passed ({doc.get('passed', '?')} of {doc.get('total', '?')} samples kept)",
            value=False,
            threshold=False,
        )


def _check_drift(source: Any, policy: GatePolicy, checks: _Checks) -> None:
    doc = _load_summary(source, "drift", policy.require_drift, checks)
    if doc is None:
        return
    severities = [doc.get("severity")]
    verdicts = doc.get("verdicts", {})
    if isinstance(verdicts, Mapping):
        severities += [
            v.get("severity", "none") if isinstance(v, Mapping) else None for v in verdicts.values()
        ]
    else:
        severities.append(None)
    if any(s not in SEVERITIES for s in severities):
        checks.fail(
            "drift",
            "drift_invalid",
            f"drift summary {_describe(source)} has a severity outside {list(SEVERITIES)}: {severities}",
        )
        return
    worst = max(severities, key=SEVERITIES.index)
    limit = policy.max_drift_severity
    if SEVERITIES.index(worst) <= SEVERITIES.index(limit):
        checks.ok("drift", f"drift severity {worst} within the maximum {limit}", value=worst, threshold=limit)
    else:
        drifted = [m for m, v in verdicts.items() if isinstance(v, Mapping) and v.get("severity") == worst]
        checks.fail(
            "drift",
            "drift_too_severe",
            f"drift severity {worst} exceeds the policy maximum {limit}"
            + (f" (metrics: {', '.join(map(str, drifted))})" if drifted else ""),
            value=worst,
            threshold=limit,
        )


def _load_summary(source: Any, what: str, required: bool, checks: _Checks) -> dict[str, Any] | None:
    if source is None:
        if required:
            checks.fail(
                what,
                f"{what}_missing",
                f"no {what} summary was given and the policy requires one (pass --{what} {what}.json)",
            )
        else:
            checks.skip(what, f"no {what} summary; the policy does not require one")
        return None
    if isinstance(source, Mapping):
        return dict(source)
    try:
        doc = json.loads(Path(source).read_text())
    except OSError as err:
        checks.fail(what, f"{what}_unreadable", f"cannot read the {what} summary {source}: {err}")
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        checks.fail(what, f"{what}_invalid", f"{what} summary {source} is not valid JSON: {err}")
        return None
    if not isinstance(doc, dict):
        checks.fail(what, f"{what}_invalid", f"{what} summary {source} is not a JSON object")
        return None
    return doc


# --- small helpers ---------------------------------------------------------------------------


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, Mapping) or key not in doc:
            return _MISSING
        doc = doc[key]
    return doc


def _number(doc: Any, path: tuple[str, ...], checks: _Checks, name: str, **tags: Any) -> float | None:
    """A finite number at ``path``; otherwise record a failing check and return None."""
    dotted = ".".join(path)
    value = _get(doc, path)
    if value is _MISSING or value is None:
        checks.fail(name, "missing_field", f"report lacks {dotted}", **tags)
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        checks.fail(name, "report_invalid", f"report field {dotted} is {value!r}, not a number", **tags)
        return None
    if not math.isfinite(value):
        checks.fail(name, "non_finite", f"report field {dotted} is {value!r}", value=float(value), **tags)
        return None
    return float(value)


def _non_finite(doc: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Paths of every NaN / infinite number in a nested document."""
    if isinstance(doc, float):
        return [] if math.isfinite(doc) else [(prefix or "<root>", doc)]
    if isinstance(doc, Mapping):
        items = doc.items()
    elif isinstance(doc, list | tuple):
        items = enumerate(doc)
    else:
        return []
    found: list[tuple[str, float]] = []
    for key, value in items:
        found += _non_finite(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), dict(value))
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path, what: str) -> Any:
    import yaml

    try:
        text = path.read_text()
    except OSError as err:
        raise PolicyError(f"cannot read the {what} {path}: {err}") from err
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PolicyError(f"{what} {path} is not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise PolicyError(f"{what} {path} must be a YAML mapping of keys")
    return doc


def _describe(source: Any) -> str | None:
    if source is None:
        return None
    return "<mapping>" if isinstance(source, Mapping) else str(source)
