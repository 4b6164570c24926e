"""The report's content as plain data (notes, tables, figures, links) built from a run's inputs: both
renderers walk the same sections, so they always say the same thing."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.report import plots
from components.report.inputs import RunInputs, Source
from components.runs import RunFailure, locate_in_log
from components.state.run_dir import GATE_FILE, RunDir


@dataclass
class Note:
    text: str
    tone: str = "plain"  # plain | good | bad | warn | muted


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]
    caption: str | None = None
    collapsed: bool = False


@dataclass
class Figure:
    title: str
    png: bytes


@dataclass
class Hits:
    """Retrieval examples: each query with its hits, as pictures in HTML and as captions in Markdown."""

    queries: list[tuple[str, list[Mapping[str, Any]]]]


@dataclass
class Link:
    text: str
    href: str
    exists: bool = True


@dataclass
class Section:
    key: str
    title: str
    status: str  # a short word shown as a badge: pass, block, ok, not run, unreadable, ...
    tone: str = "plain"
    items: list[Note | Table | Figure | Link | Hits] = field(default_factory=list)


def build(inputs: RunInputs, link_base: Path | None = None) -> list[Section]:
    """Every section of the report, in reading order; ``link_base`` is where relative links start."""
    base = link_base or inputs.run_dir
    gate = inputs.data("gate")
    failure, blocked = inputs["failure"].document, inputs["blocked"].document
    sections = [
        _gate_section(inputs["gate"]),
        _validation_section(inputs["validation"]),
        _drift_section(inputs["drift"], base),
        _training_section(inputs["metrics"]),
        _compat_section(inputs["compat_report"], gate),
        _margins_section(inputs["compat_report"], gate),
        _rollout_section(inputs["rollout"]),
    ]
    if examples := _examples_section(inputs["examples"]):
        sections.append(examples)
    if failure or blocked:
        stopped_by = f"step {failure.step} failed before it" if failure else f"{blocked.step} stopped the run"
        for section in sections:
            if section.status == "not run":
                section.items = [Note(f"The step did not run: {stopped_by}.", "muted")]
    if blocked:
        stop = f"The run stopped at step {blocked.step}: {blocked.reason or 'no reason given'}"
        sections[0].items.insert(0, Note(stop, "bad"))
    if failure:
        sections.insert(0, _failure_section(failure, inputs.run_dir))
    if usage := _usage_section(inputs.run_dir):
        sections.append(usage)
    return sections


def _failure_section(failure: RunFailure, run_dir: Path) -> Section:
    """First section of a failed run: the step, the exception, where to look, what to do next."""
    message = failure.error.message.strip() or "(no message)"
    items: list[Note | Table | Figure | Link] = [
        Note(f"Step {failure.step} failed: {failure.error.type}: {message}", "bad"),
        Note(f"What to do: {failure.next_action}.", "warn"),
    ]
    log = RunDir(run_dir).pipeline_log
    if log.is_file():
        line = locate_in_log(log, failure)
        items.append(Note(f"Log: {log}" + (f", line {line}" if line else ""), "plain"))
    if trace := [t.rstrip() for t in failure.error.traceback]:
        items.append(Table(["traceback (last frames)"], [[t] for t in trace], collapsed=True))
    return Section("failure", "Run failed", "failed", "bad", items)


def _absent(source: Source, key: str, title: str, what: str) -> Section | None:
    """The section saying why ``source`` is not there (not run, or unreadable); None when it is."""
    if source.error:
        return Section(key, title, "unreadable", "bad", [Note(source.error, "bad")])
    if source.data is None:
        note = Note(f"No {what} for this run: the step did not run.", "muted")
        return Section(key, title, "not run", "muted", [note])
    return None


def _gate_section(source: Source) -> Section:
    if missing := _absent(source, "gate", "Release gate", GATE_FILE):
        return missing
    gate = source.data or {}
    decision = str(gate.get("decision", "unknown"))
    passed = decision == "pass"
    section = Section("gate", "Release gate", decision, "good" if passed else "bad")
    if passed:
        section.items.append(Note("The candidate passed every check of the release gate.", "good"))
    else:
        blocked = f"The candidate was blocked for {len(gate.get('reasons', []))} reason(s):"
        section.items.append(Note(blocked, "bad"))
        rows = [
            [r.get("code"), r.get("direction", ""), r.get("metric", ""), _fmt(r.get("value"))]
            + [_fmt(r.get("threshold")), r.get("message")]
            for r in gate.get("reasons", [])
        ]
        section.items.append(Table(["code", "direction", "metric", "value", "threshold", "message"], rows))
    if checks := gate.get("checks", []):
        rows = [[c.get("name"), c.get("status"), c.get("message")] for c in checks]
        caption = f"All {len(checks)} checks"
        section.items.append(Table(["check", "status", "message"], rows, caption=caption, collapsed=True))
    details = [
        f"decided at {gate.get('decided_at')}",
        f"compatibility report sha256 {gate.get('report_sha256') or '-'}",
    ]
    if gate.get("policy_source"):
        details.append(f"policy {gate['policy_source']}")
    section.items.append(Note("; ".join(details), "muted"))
    return section


def _validation_section(source: Source) -> Section:
    if missing := _absent(source, "validation", "Data validation", "validation summary"):
        return missing
    doc = source.data or {}
    blocked = doc.get("blocked")
    section = Section(
        "validation", "Data validation", "blocked" if blocked else "ok", "bad" if blocked else "good"
    )
    splits = doc.get("splits")
    counts = ["samples", "passed", "quarantined", "quarantined %"]
    if isinstance(splits, Mapping) and splits:  # every split validated: one row each (quarantined = not used)
        rows, reasons = [], []
        for name, entry in splits.items():
            entry = entry if isinstance(entry, Mapping) else {}
            over = _sub(entry, "captions").get("over_context")
            rows.append([name, *_counts(entry), over, "yes" if entry.get("blocked") else "no"])
            reasons += [[name, str(k), v] for k, v in _sub(entry, "by_reason").items()]
        context = _sub(doc, "captions").get("context_tokens")
        over = f"captions over {context} tokens" if context else "captions over context"
        section.items.append(Table(["split", *counts, over, "blocked"], rows))
        if reasons:
            reasons.sort(key=lambda r: -_num(r[2]))
            section.items.append(Table(["split", "quarantine reason", "samples"], reasons))
    else:
        section.items.append(Table([*counts, "phase blocked"], [[*_counts(doc), "yes" if blocked else "no"]]))
        by_reason = _sub(doc, "by_reason")
        if by_reason:
            rows = sorted(([str(k), v] for k, v in by_reason.items()), key=lambda r: -_num(r[1]))
            section.items.append(Table(["quarantine reason", "samples"], rows))
    section.items += [Note(f"blocked: {reason}", "bad") for reason in doc.get("blocked_reasons") or []]
    return section


def _counts(entry: Mapping[str, Any]) -> list[Any]:
    """Samples, passed, quarantined and the quarantined share of a validation document or split entry."""
    total, quarantined = entry.get("total"), entry.get("quarantined")
    return [total, entry.get("passed"), quarantined, _pct(quarantined, total)]


def _drift_section(source: Source, base: Path) -> Section:
    if missing := _absent(source, "drift", "Data drift", "drift summary"):
        return missing
    doc = source.data or {}
    severity = str(doc.get("severity", "unknown"))
    tone = {"none": "good", "low": "good", "medium": "warn", "high": "bad"}.get(severity, "warn")
    section = Section("drift", "Data drift", f"severity {severity}", tone)
    verdicts = doc.get("verdicts")
    if isinstance(verdicts, Mapping) and verdicts:
        rows = []
        for name, verdict in verdicts.items():
            v = verdict if isinstance(verdict, Mapping) else {}
            scores = [_fmt(v.get(k)) for k in ("score", "noise_floor", "calibrated_score", "threshold")]
            drift = "yes" if v.get("drift") else "no"
            rows.append(
                [name, v.get("kind", "-"), v.get("method", "-"), *scores, drift, v.get("severity", "-")]
            )
        header = ["metric", "kind", "method", "score", "noise floor", "above noise", "threshold", "drift"]
        section.items.append(Table([*header, "severity"], rows))
        about = (
            "noise floor: the largest score between random halves of the reference (what sampling alone "
            "gives); threshold and severity apply to the score above it"
        )
        section.items.append(Note(about, "muted"))
    if (html_report := doc.get("html_report")) and source.path is not None:
        target = (source.path.parent / str(html_report)).resolve()
        href = os.path.relpath(target, base).replace(os.sep, "/")
        section.items.append(Link("Evidently drift report", href, target.is_file()))
    return section


def _training_section(source: Source) -> Section:
    if missing := _absent(source, "training", "Training", "training metrics"):
        return missing
    doc = source.data or {}
    section = Section("training", "Training", "ok", "plain")
    if warning := (doc.get("budget") or {}).get("warning"):
        section.status, section.tone = "warning", "warn"
        section.items.append(Note(f"Training budget: {warning}.", "warn"))
    if png := plots.training_curves(doc):
        section.items.append(Figure("Training curves", png))
    else:
        section.items.append(Note("metrics.json has no training curve.", "muted"))
    scalars: list[list[Any]] = []
    for key, value in doc.items():
        rows = _nested_table(value) if key != "curve" else None
        if rows:
            section.items.append(Table(rows[0], rows[1:], caption=key.replace("_", " ")))
        elif isinstance(value, Mapping):
            scalars += [[f"{key}.{k}", _fmt(v)] for k, v in value.items() if _is_scalar(v)]
        elif _is_scalar(value):
            scalars.append([key, _fmt(value)])
    if scalars:
        section.items.append(Table(["field", "value"], scalars, caption="Run facts", collapsed=True))
    return section


NOT_GATED = "measured, not gated"


def _gated_directions(gate: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The directions the release gate judges (its policy's), None when no gate ran."""
    directions = _sub(gate or {}, "policy").get("directions")
    return tuple(str(d) for d in directions) if isinstance(directions, list | tuple) else None


def _ecc_verdict(report: Mapping[str, Any], gated: tuple[str, ...] | None) -> tuple[bool | None, list[str]]:
    """Whether the ECC holds over the gated directions (all of them when no gate ran), and the measured
    directions the gate does not judge."""
    ecc = _sub(report, "ecc")
    if gated is None or not ecc:
        return report.get("ecc_passed"), []
    verdicts = [v for d in gated if isinstance(ecc.get(d), Mapping) for v in ecc[d].values()]
    ungated = [d for d in ecc if d not in gated]
    return (all(bool(v) for v in verdicts) if verdicts else report.get("ecc_passed")), ungated


def _compat_section(source: Source, gate: Mapping[str, Any] | None = None) -> Section:
    if missing := _absent(source, "compat", "Compatibility matrix", "compatibility report"):
        return missing
    report = source.data or {}
    gated = _gated_directions(gate)
    passed, ungated = _ecc_verdict(report, gated)
    status = {True: "ECC holds", False: "ECC fails"}.get(passed, "evaluated")
    if ungated and passed is not None:
        status += f" ({', '.join(gated or ())})"
    section = Section(
        "compat", "Compatibility matrix", status, {True: "good", False: "bad"}.get(passed, "plain")
    )
    judged = ", ".join(gated or ()) or "no direction"
    for direction in ungated:
        note = f"{direction}: {NOT_GATED} (the gate judges {judged}; its figures are shown for information)."
        section.items.append(Note(note, "muted"))
    if png := plots.compat_heatmap(report):
        section.items.append(Figure("Query model x gallery model, R@1", png))
    rows = []
    retrieval = _sub(report, "retrieval")
    for direction in plots.DIRECTIONS:
        label = f"{direction} ({NOT_GATED})" if direction in ungated else direction
        for pair, values in _sub(retrieval, direction).items():
            if isinstance(values, Mapping):
                rows.append([label, pair, *(_fmt(values.get(m)) for m in plots.METRICS)])
    for direction, values in _sub(report, "independent_new_new").items():
        if isinstance(values, Mapping):
            rows.append([direction, "independent new/new", *(_fmt(values.get(m)) for m in plots.METRICS)])
    if rows:
        section.items.append(
            Table(["direction", "query/gallery", *plots.METRICS], rows, caption="Recall (%)")
        )
    sizes = report.get("eval_sizes")
    if isinstance(sizes, Mapping):
        domains = ", ".join(map(str, sizes.get("domains") or [])) or "-"
        images, captions = sizes.get("images"), sizes.get("captions")
        section.items.append(
            Note(f"Evaluation set: {images} images, {captions} captions; domains: {domains}.", "muted")
        )
    return section


def _margins_section(source: Source, gate: Mapping[str, Any] | None) -> Section:
    if missing := _absent(source, "margins", "ECC margins", "compatibility report"):
        return missing
    report = source.data or {}
    min_margin = _sub(gate or {}, "policy").get("min_margin", 0.0)
    section = Section("margins", "ECC margins", "see intervals", "plain")
    if png := plots.ecc_margins(report, min_margin if plots._finite(min_margin) else 0.0):
        section.items.append(Figure("new/old - old/old with bootstrap intervals", png))
    rows = []
    margins, ecc, gated = _sub(report, "margins"), _sub(report, "ecc"), _gated_directions(gate)
    for direction in plots.DIRECTIONS:
        verdicts = _sub(ecc, direction)
        for metric, entry in _sub(margins, direction).items():
            if not isinstance(entry, Mapping):
                continue
            bounds = [_fmt(entry.get(k)) for k in ("margin", "ci_low", "ci_high")]
            verdict = {True: "holds", False: "fails"}.get(verdicts.get(metric), "-")
            rows.append(
                [direction, metric, *bounds, verdict if gated is None or direction in gated else NOT_GATED]
            )
    if rows:
        section.items.append(Table(["direction", "metric", "margin (pp)", "CI low", "CI high", "ECC"], rows))
        weak = [f"{r[0]} {r[1]}" for r in rows if not (_num(r[3]) > 0) and r[5] != NOT_GATED]
        section.status = "all intervals above zero" if not weak else f"{len(weak)} interval(s) reach zero"
        section.tone = "good" if not weak else "warn"
    return section


def _rollout_section(source: Source) -> Section:
    if missing := _absent(source, "rollout", "Rollout and backfill", "rollout state"):
        return missing
    from components.state.rollout_document import migrated

    doc = migrated(source.data or {})  # a run folder an earlier release wrote reads as this version's
    status = str(doc.get("status", "unknown"))
    tone = {"completed": "good", "halted": "bad", "failed": "bad", "rolled_back": "bad"}.get(status, "warn")
    section = Section("rollout", "Rollout and backfill", status, tone)
    row = [status, doc.get("stage"), _pct(doc.get("fraction_backfilled"), 1)]
    section.items.append(Table(["status", "stage", "backfilled"], [row]))
    if png := plots.backfill_curve(doc):
        section.items.append(Figure("Backfill curve", png))
    floors, baseline = _sub(doc, "floors"), _sub(doc, "baseline")
    if floors:
        about = (
            f"Every stage's probe must stay at or above its floor: R@1 {_fmt(floors.get('R@1'))} "
            f"(the probe set's old/old is {_fmt(baseline.get('R@1'))}{_tolerance(doc)}; the evaluation "
            "set's figures in the compatibility matrix come from other queries and are not this floor)."
        )
        section.items.append(Note(about, "muted"))
        if all(_num(floor) <= 0 for floor in floors.values()):
            tolerance = _fmt(doc.get("probe_tolerance"))
            warning = (
                f"Warning: every probe floor is 0 (rollout.probe_tolerance {tolerance} standard errors "
                "reach below 0): no probe can halt this rollout. Lower rollout.probe_tolerance or set "
                "rollout.floors."
            )
            section.items.append(Note(warning, "warn"))
    curve = doc.get("curve")
    if isinstance(curve, list) and curve:
        points = [p for p in curve if isinstance(p, Mapping)]
        rows = [[_pct(p.get("fraction"), 1), _fmt(p.get("t2i_R@1")), _fmt(p.get("i2t_R@1"))] for p in points]
        section.items.append(Table(["backfilled", "t2i R@1", "i2t R@1"], rows))
    if source.path is not None and source.path.parent.name != "rollout":
        section.items.append(Note(f"from {source.path}", "muted"))
    return section


def _examples_section(source: Source) -> Section | None:
    """Retrieval examples searched as the gallery is served after the run; None when not recorded."""
    if source.path is None:
        return None
    doc = source.data or {}
    if problem := source.error or doc.get("error"):
        return Section("examples", "Retrieval examples", "unavailable", "warn", [Note(str(problem))])
    queries = [
        (str(q.get("text", "")), [h for h in q.get("hits") or [] if isinstance(h, Mapping)])
        for q in doc.get("queries") or []
        if isinstance(q, Mapping)
    ]
    found = sum(1 for text, hits in queries if hits and hits[0].get("caption") == text)
    section = Section("examples", "Retrieval examples", f"{found}/{len(queries)} first hits captioned alike")
    about = (
        "Captions of the newest gallery items, searched as the gallery is served after this run; the "
        "first hit should carry the query's caption."
    )
    section.items += [Note(about, "muted"), Hits(queries)]
    return section


def _usage_section(run_dir: Path) -> Section | None:
    """What each step cost (:func:`components.runs.read_usage`); None for a run that recorded none."""
    from components.runs import read_usage

    steps = read_usage(run_dir)
    if not steps:
        return None
    own = ("wall_s", "cpu_s", "peak_rss_mib", "rss_at_start_mib")
    workers = ("workers_cpu_s", "workers_peak_rss_mib")  # "-" for a step that waited for no worker
    rows = [
        [u.get("step"), u.get("outcome"), *(_fmt(u.get(k)) for k in own)]
        + [_fmt(u.get(k)) if u.get("workers_cpu_s") else "-" for k in workers]
        for u in steps
    ]
    peaks = [p for p in (_num(u.get("peak_rss_mib")) for u in steps) if math.isfinite(p)]
    headers = ["step", "outcome", "wall s", "CPU s", "peak RSS MiB", "at start MiB"]
    headers += ["workers CPU s", "workers peak MiB"]
    section = Section("usage", "Resources per step", f"peak {max(peaks):.0f} MiB" if peaks else "recorded")
    section.items.append(Table(headers, rows))
    about = (
        "Peak RSS is each step's own process (VmHWM); at start is what it held before its work (locally, "
        "the warm task host's preloaded modules, shared with every task: a pod imports only its step's); "
        "workers are the processes a step waited for (the training loader's), each up to this peak: a "
        "pod's memory limit holds their sum."
    )
    section.items.append(Note(about, "muted"))
    return section


def _nested_table(value: Any) -> list[list[Any]] | None:
    """A mapping of mappings of numbers (e.g. per-domain recalls; one more level allowed) as a table."""
    if not isinstance(value, Mapping) or not value:
        return None
    if not all(isinstance(v, Mapping) for v in value.values()):
        return None
    flat = {name: _flatten_numbers(inner) for name, inner in value.items()}
    columns = list(dict.fromkeys(k for inner in flat.values() for k in inner))  # first-seen order
    if not columns:
        return None
    rows = [[str(name), *(_fmt(inner.get(c)) for c in columns)] for name, inner in flat.items()]
    return [["", *columns], *rows]


def _flatten_numbers(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix} {key}".strip()
        if isinstance(value, Mapping) and not prefix:
            out.update(_flatten_numbers(value, name))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    return out


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, int | float | str | bool)


def _tolerance(rollout: Mapping[str, Any]) -> str:
    """How far below old/old the floors sit, as the rollout state records it (older states: not stated)."""
    tolerance = rollout.get("probe_tolerance")
    if not isinstance(tolerance, int | float) or isinstance(tolerance, bool):
        return ""
    return f", the floor {_fmt(float(tolerance))} standard error(s) below it unless configured higher"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.3g}" if abs(value) < 1e-3 and value != 0 else f"{value:.2f}"
    return str(value)


def _sub(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``doc[key]`` when it is a mapping, else an empty one."""
    value = doc.get(key)
    return value if isinstance(value, Mapping) else {}


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _pct(part: Any, whole: Any) -> str:
    part_f, whole_f = _num(part), _num(whole)
    if not (math.isfinite(part_f) and math.isfinite(whole_f)) or whole_f == 0:
        return "-"
    return f"{100 * part_f / whole_f:.1f}%"
