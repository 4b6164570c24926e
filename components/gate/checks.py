"""The gate's checks: each reads one input (the compatibility report, the validation and drift summaries)
and records a named pass, skip or failure with a sentence a person can act on."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.gate.policy import SEVERITIES, GatePolicy

MARGIN_TOLERANCE = 0.05  # percentage points of rounding allowed between reported and recomputed margins
_MISSING = object()


class Checks:
    """Every evaluated check, in order; failing ones become the decision's reasons."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def _add(self, name: str, status: str, code: str | None, message: str, **fields: Any) -> None:
        self.items.append(
            {"name": name, "status": status, "code": code, "message": message, **_clean(fields)}
        )

    def ok(self, name: str, message: str, **fields: Any) -> None:
        self._add(name, "pass", None, message, **fields)

    def skip(self, name: str, message: str) -> None:
        self._add(name, "skipped", None, message)

    def fail(self, name: str, code: str, message: str, **fields: Any) -> None:
        self._add(name, "fail", code, message, **fields)

    def judge(self, passed: bool, name: str, code: str, ok: str, failed: str, **fields: Any) -> None:
        """A pass saying ``ok``, or a failure with ``code`` saying ``failed``."""
        if passed:
            self.ok(name, ok, **fields)
        else:
            self.fail(name, code, failed, **fields)

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


def load_report(
    report: Mapping[str, Any] | str | Path, checks: Checks
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


def check_report(doc: dict[str, Any], policy: GatePolicy, checks: Checks) -> None:
    import schemas

    errors = schemas.schema_errors(doc, "compat_report")
    shown = "; ".join(errors[:8]) + (f"; ... ({len(errors) - 8} more)" if len(errors) > 8 else "")
    checks.judge(
        not errors,
        "report_schema",
        "report_invalid",
        "report matches schemas/compat_report.schema.json",
        f"report breaks schemas/compat_report.schema.json: {shown}",
    )
    bad = non_finite(doc)
    shown = ", ".join(f"{p}={v!r}" for p, v in bad[:8])
    if bad:
        checks.fail("report_finite", "non_finite", f"report has non-finite numbers: {shown}", value=len(bad))
    else:
        checks.ok("report_finite", "every number in the report is finite")
    _check_eval_size(doc, policy, checks)
    for direction in policy.directions:
        for k in policy.ks:
            _check_ecc(doc, direction, f"R@{k}", policy, checks)
            _check_retention(doc, direction, f"R@{k}", policy, checks)


def _check_eval_size(doc: dict[str, Any], policy: GatePolicy, checks: Checks) -> None:
    for key, minimum in (("images", policy.min_eval_images), ("captions", policy.min_eval_captions)):
        name = f"eval_size.{key}"
        value = _number(doc, ("eval_sizes", key), checks, name)
        if value is None:
            continue
        has = f"evaluation set has {value:g} {key}"
        checks.judge(
            value >= minimum,
            name,
            "eval_set_too_small",
            f"{has} (minimum {minimum})",
            f"{has}, below the policy minimum of {minimum}: evaluate on a larger set",
            value=value,
            threshold=minimum,
        )


def _check_ecc(doc: dict[str, Any], direction: str, metric: str, policy: GatePolicy, checks: Checks) -> None:
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
    said = f"{direction} {metric}: new/old {new_old:.2f} - old/old {old_old:.2f} = {margin:+.2f} pp"
    checks.judge(
        margin > policy.min_margin,
        name,
        "ecc_margin",
        said,
        f"{said}, not above the minimum margin {policy.min_margin:g}: new queries read the old gallery worse",
        value=margin,
        threshold=policy.min_margin,
        **tags,
    )
    _check_interval(doc, direction, metric, margin, policy, checks)


def _check_interval(
    doc: dict[str, Any], direction: str, metric: str, margin: float, policy: GatePolicy, checks: Checks
) -> None:
    name = f"ecc_interval.{direction}.{metric}"
    tags = {"direction": direction, "metric": metric}
    if not policy.require_ci_lower_above_zero:
        checks.skip(name, "policy does not require the interval's lower bound above zero")
        return
    reported, low, high = (
        _number(doc, ("margins", direction, metric, field), checks, name, **tags)
        for field in ("margin", "ci_low", "ci_high")
    )
    if reported is None or low is None or high is None:
        return
    if abs(reported - margin) > MARGIN_TOLERANCE or low > high:
        checks.fail(
            name,
            "report_inconsistent",
            f"margins.{direction}.{metric}: reported margin {reported:g} [{low:g}, {high:g}] does not match "
            f"new/old - old/old = {margin:g} or its bounds are reversed",
            value=reported,
            threshold=margin,
            **tags,
        )
    interval = f"{direction} {metric}: the bootstrap interval of the margin [{low:+.2f}, {high:+.2f}]"
    checks.judge(
        low > 0,
        name,
        "ecc_interval",
        f"{direction} {metric}: interval [{low:+.2f}, {high:+.2f}] lies above zero",
        f"{interval} reaches zero: the improvement is not significant",
        value=low,
        threshold=0.0,
        **tags,
    )


def _check_retention(
    doc: dict[str, Any], direction: str, metric: str, policy: GatePolicy, checks: Checks
) -> None:
    name = f"retention.{direction}.{metric}"
    tags = {"direction": direction, "metric": metric}
    new_new = _number(doc, ("retrieval", direction, "new/new", metric), checks, name, **tags)
    if policy.retention.reference == "independent" or (
        policy.retention.reference == "auto" and doc.get("independent_new_new") is not None
    ):
        label = "the independent new model's new/new"
        reference = _number(doc, ("independent_new_new", direction, metric), checks, name, **tags)
    else:
        label = "old/old"
        reference = _number(doc, ("retrieval", direction, "old/old", metric), checks, name, **tags)
    if new_new is None or reference is None:
        return
    threshold = policy.retention.floor * reference
    share = f"{100 * new_new / reference:.1f}%" if reference > 0 else "n/a"
    text = (
        f"{direction} {metric}: new/new {new_new:.2f} is {share} of {label} {reference:.2f} "
        f"(floor {100 * policy.retention.floor:g}%)"
    )
    failed = text + ": the candidate's own space regressed"
    fields = {"value": new_new, "threshold": threshold, **tags}
    checks.judge(new_new >= threshold, name, "retention_floor", text, failed, **fields)


def check_validation(source: Any, policy: GatePolicy, checks: Checks) -> None:
    doc = _load_summary(source, "validation", policy.require_validation, checks)
    if doc is None:
        return
    blocked = doc.get("blocked")
    if not isinstance(blocked, bool) or non_finite(doc):
        checks.fail(
            "validation",
            "validation_invalid",
            f"validation summary {describe(source)} needs a boolean 'blocked' and finite numbers",
        )
        return
    why = doc.get("blocked_reasons") or []
    detail = "; ".join(str(r) for r in why) if isinstance(why, list) else str(why)
    checks.judge(
        not blocked,
        "validation",
        "validation_blocked",
        f"data validation passed ({doc.get('passed', '?')} of {doc.get('total', '?')} samples kept)",
        f"data validation blocked the phase: {detail or 'no reason given'}",
        value=blocked,
        threshold=False,
    )


def check_drift(source: Any, policy: GatePolicy, checks: Checks) -> None:
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
            f"drift summary {describe(source)} has a severity outside {list(SEVERITIES)}: {severities}",
        )
        return
    worst = max(severities, key=SEVERITIES.index)
    limit = policy.max_drift_severity
    drifted = [m for m, v in verdicts.items() if isinstance(v, Mapping) and v.get("severity") == worst]
    checks.judge(
        SEVERITIES.index(worst) <= SEVERITIES.index(limit),
        "drift",
        "drift_too_severe",
        f"drift severity {worst} within the maximum {limit}",
        f"drift severity {worst} exceeds the policy maximum {limit}"
        + (f" (metrics: {', '.join(map(str, drifted))})" if drifted else ""),
        value=worst,
        threshold=limit,
    )


def _load_summary(source: Any, what: str, required: bool, checks: Checks) -> dict[str, Any] | None:
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


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, Mapping) or key not in doc:
            return _MISSING
        doc = doc[key]
    return doc


def _number(doc: Any, path: tuple[str, ...], checks: Checks, name: str, **tags: Any) -> float | None:
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


def describe(source: Any) -> str | None:
    if source is None:
        return None
    return "<mapping>" if isinstance(source, Mapping) else str(source)


def non_finite(doc: Any, prefix: str = "") -> list[tuple[str, float]]:
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
        found += non_finite(value, f"{prefix}.{key}" if prefix else str(key))
    return found
