"""The validation step of one data phase: read, check, run the suites, route, summarize.

Two passes keep memory flat for phases of any size: the first reads every sample's facts (duplicate keys
are only known once every shard is read), the second re-reads the shards and writes each sample, unchanged,
to an accepted or a quarantine shard. ``validation.json`` is written last: it marks a finished run."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat.io import write_json_atomic
from compat.progress import track
from components.data.validation.checks import CheckTimings, Reason, inspect_sample
from components.data.validation.policy import ValidationPolicy
from components.data.validation.quarantine import (
    AtomicTarWriter,
    accepted_name,
    quarantine_name,
    quarantine_sample,
    remove_stale_outputs,
)
from components.data.validation.shard_reader import SampleGroup, ShardReader
from components.data.validation.suite import facts_frame, run_suite, suite_path
from components.state.run_dir import VALIDATION_FILE as SUMMARY_FILE
from schemas import validate

logger = logging.getLogger(__name__)

CHECKS_VERSION = 4  # bump when a check changes meaning: earlier summaries are then recomputed
TRANSPARENT_KEYS_LISTED = 20  # keys of accepted pictures stored with transparency named in the summary


class ShardSpecError(ValueError):
    """The shard pattern(s) matched no file."""


@dataclass(frozen=True)
class Shard:
    index: int
    name: str  # as the pattern matched it (a path or an fsspec URL); used in every message
    url: str  # what is read: an absolute local path or an fsspec URL
    size: int
    version: int | str  # changes when the shard does: mtime in ns (local) or fsspec's ukey (remote)


@dataclass
class ValidationSummary:
    """The result of :func:`validate_phase`: the ``validation.json`` document plus run-local facts."""

    out_dir: Path
    document: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    reused: bool = False

    def __getattr__(self, name: str) -> Any:
        """The document's fields read as attributes (``total``, ``passed``, ``blocked``, ``shards``, ...)."""
        if name != "document" and name in self.__dict__.get("document", {}):
            return self.document[name]
        raise AttributeError(name)

    @property
    def path(self) -> Path:
        return self.out_dir / SUMMARY_FILE

    @property
    def accepted_paths(self) -> list[Path]:
        """Absolute paths of the accepted shards (``accepted_shards`` holds them relative to ``out_dir``)."""
        return [self.out_dir / p for p in self.document["accepted_shards"]]

    @property
    def quarantine_paths(self) -> list[Path]:
        return [self.out_dir / p for p in self.document["quarantine_shards"]]

    def to_dict(self) -> dict[str, Any]:
        return self.document


def resolve_shards(shard_spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Shard]:
    """Sorted, unique shard files of the patterns, expanded as training expands them."""
    from compat.data.loader import LoaderError, expand_urls
    from compat.data.shards import ShardError, is_local, local_path, stat_url

    specs = [shard_spec] if isinstance(shard_spec, (str, os.PathLike)) else list(shard_spec)
    if not specs:
        raise ShardSpecError("no shard pattern given")
    found: dict[str, str] = {}
    for spec in specs:
        text = os.fspath(spec)
        try:
            urls = expand_urls(text)
        except LoaderError as exc:
            raise ShardSpecError(
                f"no shard file matches {text!r} (local paths are read relative to {os.getcwd()}; {exc}); "
                "pass a glob such as 'data/phase-01/shard-*.tar' or a URL such as 's3://bucket/phase-01/*.tar'"
            ) from exc
        for url in urls:
            found.setdefault(os.path.abspath(local_path(url)) if is_local(url) else url, url)
    shards = []
    for index, (url, name) in enumerate(sorted(found.items(), key=lambda item: item[1])):
        try:
            size, version = stat_url(url)
        except ShardError as exc:
            raise ShardSpecError(f"shard {name!r} cannot be validated: {exc}") from exc
        shards.append(Shard(index=index, name=name, url=url, size=size, version=version))
    return shards


def validate_phase(
    shard_spec: str | list[str], out_dir: Path, policy: ValidationPolicy | None = None, *, force: bool = False
) -> ValidationSummary:
    """Validate one data phase's shards into ``out_dir``; an unchanged rerun returns the finished summary."""
    policy = policy or ValidationPolicy()
    shards = resolve_shards(shard_spec)
    out_dir = Path(out_dir)
    fingerprint = _fingerprint(shards, policy)
    if not force:
        previous = _finished_summary(out_dir, fingerprint)
        if previous is not None:
            logger.info("validation of %d shards is up to date in %s", len(shards), previous.path)
            return previous

    (out_dir / SUMMARY_FILE).unlink(missing_ok=True)  # present again only once this run has finished
    timings: dict[str, float] = {}
    start = time.perf_counter()
    facts, reasons, shard_stats, check_timings = _inspect(shards, policy)
    timings["read_and_check_s"] = time.perf_counter() - start
    timings["decode_s"], timings["other_checks_s"] = check_timings.decode_s, check_timings.other_s

    start = time.perf_counter()
    frame = facts_frame(facts)
    sample_run = run_suite("samples", frame, policy.suite_parameters())
    for row, found in sample_run.row_reasons.items():
        reasons.setdefault(row, []).extend(found)
    phase_run = run_suite("phase", frame[~frame["row"].isin(list(reasons))], policy.suite_parameters())
    timings["gx_s"] = time.perf_counter() - start

    start = time.perf_counter()
    _write_outputs(shards, out_dir, facts, reasons, shard_stats, policy)
    outputs = {kind: [s[kind] for s in shard_stats if s[kind]] for kind in ("accepted", "quarantine")}
    removed = remove_stale_outputs(out_dir, set(outputs["accepted"]) | set(outputs["quarantine"]))
    if removed:
        logger.info("removed %d output shards of an earlier run: %s", len(removed), ", ".join(removed))
    timings["write_s"] = time.perf_counter() - start

    records = sample_run.records + phase_run.records
    document = _summary_document(
        shard_spec, shards, policy, fingerprint, facts, reasons, shard_stats, records, outputs
    )
    validate(document, "validation", source=str(out_dir / SUMMARY_FILE))
    write_json_atomic(out_dir / SUMMARY_FILE, document)
    counts = (document["total"], len(shards), document["passed"], document["quarantined"])
    share = 100 * document["quarantined_fraction"]
    logger.info("validated %d samples in %d shards: %d passed, %d quarantined (%.2f%%)", *counts, share)
    for reason in document["blocked_reasons"]:
        logger.error("blocked: %s", reason)
    return ValidationSummary(out_dir=out_dir, document=document, timings=timings)


def _inspect(shards: list[Shard], policy: ValidationPolicy):
    """Pass 1: facts and Python-check reasons per sample, and what each shard yielded."""
    facts: list[dict[str, Any]] = []
    reasons: dict[int, list[Reason]] = {}
    stats: list[dict[str, Any]] = []
    timings = CheckTimings()

    def groups() -> Iterator[tuple[Shard, SampleGroup]]:
        for shard in shards:
            reader = ShardReader(shard.url, shard.name, policy.member_limits())
            for group in reader:
                yield shard, group
            stats.append({"samples": reader.samples, "members": reader.members, "error": reader.error})
            if reader.error:
                logger.error("%s: %s", shard.name, reader.error)

    for shard, group in track(groups(), "validate: reading samples", unit="samples"):
        row = len(facts)
        sample_facts, found = inspect_sample(group, shard.name, shard.index, row, policy, timings)
        facts.append(sample_facts)
        if found:
            reasons[row] = found
    return facts, reasons, stats, timings


def _write_outputs(
    shards: list[Shard],
    out_dir: Path,
    facts: list[dict[str, Any]],
    reasons: dict[int, list[Reason]],
    stats: list[dict[str, Any]],
    policy: ValidationPolicy,
) -> None:
    """Pass 2: re-read each shard and write every sample, unchanged, to its accepted or quarantine shard
    (named in its ``stats`` entry)."""
    first_row = 0
    written = track(
        zip(shards, stats, strict=True), "validate: writing shards", total=len(shards), unit="shards"
    )
    for shard, stat in written:
        accepted = AtomicTarWriter(out_dir / accepted_name(shard.index))
        quarantine = AtomicTarWriter(out_dir / quarantine_name(shard.index))
        reader = ShardReader(shard.url, shard.name, policy.member_limits())
        changed = f"{shard.name} changed while it was being validated; rerun the validation"
        try:
            for group in reader:
                row = first_row + group.index
                if group.index >= stat["samples"] or facts[row]["key"] != group.key:
                    raise RuntimeError(changed)
                if row in reasons:
                    quarantine_sample(quarantine, group, shard.name, reasons[row])
                else:
                    accepted.add_sample(group)
            if reader.samples != stat["samples"]:
                raise RuntimeError(changed)
        except BaseException:
            accepted.abort()
            quarantine.abort()
            raise
        stat["accepted"] = accepted_name(shard.index) if accepted.commit() else None
        stat["quarantine"] = quarantine_name(shard.index) if quarantine.commit() else None
        stat["passed"], stat["quarantined"] = accepted.samples, quarantine.samples
        first_row += stat["samples"]


def _summary_document(
    shard_spec,
    shards: list[Shard],
    policy: ValidationPolicy,
    fingerprint: str,
    facts: list[dict[str, Any]],
    reasons: dict[int, list[Reason]],
    stats: list[dict[str, Any]],
    records: list[dict[str, Any]],
    outputs: dict[str, list[str]],
) -> dict[str, Any]:
    total, quarantined = len(facts), len(reasons)
    fraction = quarantined / total if total else 0.0
    by_reason = Counter(code for found in reasons.values() for code in dict.fromkeys(r.code for r in found))
    problems = _problems(facts, reasons, policy.max_problems_listed)
    blocked_reasons = [
        f"{shard.name}: shard is not fully readable "
        f"({stat['samples']} samples read before the damage): {stat['error']}"
        for shard, stat in zip(shards, stats, strict=True)
        if stat["error"]
    ]
    if fraction > policy.max_quarantined_fraction:
        blocked_reasons.append(
            f"quarantined fraction {fraction:.2%} ({quarantined} of {total} samples) exceeds "
            f"the threshold {policy.max_quarantined_fraction:.2%}"
        )
    blocked_reasons += _expectation_failures(records)
    accepted = [f for row, f in enumerate(facts) if row not in reasons]
    stat_keys = ("samples", "members", "passed", "quarantined", "error", "accepted", "quarantine")
    return {
        "schema_version": 1,
        "shard_spec": [
            os.fspath(s) for s in ([shard_spec] if isinstance(shard_spec, (str, os.PathLike)) else shard_spec)
        ],
        "total": total,
        "passed": total - quarantined,
        "quarantined": quarantined,
        "quarantined_fraction": fraction,
        "by_reason": dict(sorted(by_reason.items())),
        "captions": _caption_facts(accepted, policy.max_caption_tokens),
        "images": _image_facts(accepted),
        "blocked": bool(blocked_reasons),
        "blocked_reasons": blocked_reasons,
        "shards": [
            {"name": shard.name, **{k: stat[k] for k in stat_keys}}
            for shard, stat in zip(shards, stats, strict=True)
        ],
        "expectations": records,
        "problems": problems[: policy.max_problems_listed],
        "problems_total": len(problems),
        "policy": policy.model_dump(mode="json"),
        "accepted_shards": outputs["accepted"],
        "quarantine_shards": outputs["quarantine"],
        "fingerprint": fingerprint,
    }


def _problems(
    facts: list[dict[str, Any]], reasons: dict[int, list[Reason]], listed: int
) -> list[dict[str, Any]]:
    """One entry per reason of each quarantined sample; the first ``listed`` are logged."""
    problems = [
        {
            "shard": facts[row]["shard"],
            "key": facts[row]["key"],
            "sample_index": facts[row]["sample_index"],
            "reason": r.code,
            "message": f"{facts[row]['shard']}: key {facts[row]['key']}: {r.message}",
        }
        for row in sorted(reasons)
        for r in reasons[row]
    ]
    for problem in problems[:listed]:
        logger.warning("%s", problem["message"])
    if len(problems) > listed:
        logger.warning(
            "... and %d more problems (all listed in the reason.json members of the quarantine shards)",
            len(problems) - listed,
        )
    return problems


def _expectation_failures(records: list[dict[str, Any]]) -> list[str]:
    """An expectation that could not run, or a phase expectation that failed, as a blocking reason."""
    blocked = []
    for record in records:
        target = f"{record['type']}({record['column']})" if record["column"] else record["type"]
        if record["exception"]:
            blocked.append(f"{record['suite']} expectation {target} could not run: {record['exception']}")
        elif record["suite"] == "phase" and not record["success"]:
            blocked.append(
                f"phase expectation {target} failed on the accepted samples: observed "
                f"{json.dumps(record['observed_value'])}, expected {json.dumps(record['kwargs'])}"
            )
    return blocked


def _caption_facts(accepted: list[dict[str, Any]], context: int) -> dict[str, Any]:
    """How many accepted captions the text context cuts (logged when any)."""
    tokens = [f["caption_tokens"] for f in accepted if f["caption_tokens"] is not None]
    over = sum(t > context for t in tokens)
    if over:
        cut = f"{over} of {len(tokens)} accepted captions are longer than the {context}-token context"
        logger.warning("%s (the tokenizer cuts them)", cut)
    return {"context_tokens": context, "over_context": over, "max_tokens": max(tokens, default=None)}


def _image_facts(accepted: list[dict[str, Any]]) -> dict[str, Any]:
    """Accepted pictures stored with transparency (logged when any)."""
    transparent = [f["key"] for f in accepted if f.get("image_transparent")]
    if transparent:  # readers here matte it on white; a reader converting to RGB shows what lies beneath
        logger.warning(
            f"{len(transparent)} of {len(accepted)} accepted pictures are stored with transparency (e.g. key "
            f"{transparent[0]}): readers that convert them to RGB without a background see black; import "
            "them with `compatflow data import`, which stores them matted on white"
        )
    return {"transparent": len(transparent), "transparent_keys": transparent[:TRANSPARENT_KEYS_LISTED]}


def _fingerprint(shards: list[Shard], policy: ValidationPolicy) -> str:
    """Identity of a run's inputs: shard names, sizes, mtimes, the policy, the suites, the step version."""
    digest = hashlib.sha256()
    inputs = [[s.name, s.url, s.size, s.version] for s in shards]
    suites = [hashlib.sha256(suite_path(n).read_bytes()).hexdigest() for n in ("samples", "phase")]
    digest.update(json.dumps([CHECKS_VERSION, inputs, policy.model_dump(), suites], sort_keys=True).encode())
    return digest.hexdigest()


def _finished_summary(out_dir: Path, fingerprint: str) -> ValidationSummary | None:
    """The summary of an earlier finished run over the same inputs, if all its outputs are still there."""
    try:
        document = json.loads((out_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("fingerprint") != fingerprint:
        return None
    outputs = document.get("accepted_shards", []) + document.get("quarantine_shards", [])
    if not all((out_dir / p).is_file() for p in outputs):
        return None
    return ValidationSummary(out_dir=out_dir, document=document, reused=True)
