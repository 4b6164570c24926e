"""Validation of every split of a phase (train, eval, gallery) with one policy, summarized in one document.

Train is validated into ``out_dir`` itself (the layout every reader knows), every other split into
``out_dir/<split>/``; ``validation.json`` is then rewritten as the train document plus ``splits``, blocked
when any split is. A failing gallery item lands in its split's quarantine only, so nothing indexes it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compat.io import write_json_atomic
from components.data.validation.phase import SUMMARY_FILE, ValidationSummary, validate_phase
from components.data.validation.policy import ValidationPolicy
from schemas import validate

logger = logging.getLogger(__name__)

TRAIN = "train"


def split_dir(out_dir: Path, split: str) -> Path:
    """Where ``split`` is validated: ``out_dir`` for train, ``out_dir/<split>`` for any other."""
    return Path(out_dir) if split == TRAIN else Path(out_dir) / split


def validate_splits(
    splits: Mapping[str, str | os.PathLike | Sequence[str | os.PathLike]],
    out_dir: Path,
    policy: ValidationPolicy | None = None,
    *,
    force: bool = False,
) -> ValidationSummary:
    """Validate each split's shards (``splits`` maps a name to its patterns and must hold ``train``; a split
    with no shards is recorded with no samples); the returned summary is the combined document's."""
    if TRAIN not in splits:
        raise ValueError(f"validate_splits needs the train split; got {sorted(splits)}")
    for name in splits:
        if name in ("", ".", "..", "accepted", "quarantine") or "/" in name or "\\" in name:
            raise ValueError(f"split name {name!r} must be a plain directory name (not accepted/quarantine)")
    policy = policy or ValidationPolicy()
    out_dir = Path(out_dir)
    results: dict[str, ValidationSummary | None] = {}
    # Captions cut at the text context are counted in every split but judged in train only: evaluation
    # queries and gallery captions are measured, not learnt from, and a small split would trip on one caption.
    counted_only = policy.replace(max_over_context_fraction=1.0)
    for name, shards in splits.items():  # train last: its validation.json is the one rewritten below
        if name != TRAIN:
            results[name] = _validate(shards, split_dir(out_dir, name), counted_only, force)
    train = _validate(splits[TRAIN], out_dir, policy, force)
    if train is None:
        raise ValueError("the train split has no shards")
    results = {TRAIN: train, **results}
    # A reused train summary is the combined document of an earlier run: keep only the train split's reasons.
    prefixes = tuple(f"{name} split: " for name in splits if name != TRAIN)
    entries = {
        name: _split_entry(name, result, out_dir, policy, prefixes) for name, result in results.items()
    }
    document = {k: v for k, v in train.document.items() if k != "splits"}
    document["blocked_reasons"] = [  # the train split's first, as they are; the others' named
        reason if name == TRAIN else f"{name} split: {reason}"
        for name, entry in entries.items()
        for reason in entry["blocked_reasons"]
    ]
    document["blocked"] = bool(document["blocked_reasons"])
    document["splits"] = entries
    validate(document, "validation", source=str(out_dir / SUMMARY_FILE))
    write_json_atomic(out_dir / SUMMARY_FILE, document)
    for name, entry in document["splits"].items():
        counts = (entry["total"], entry["passed"], entry["quarantined"])
        blocked = " (blocked)" if entry["blocked"] else ""
        logger.info("%s split: %d samples, %d passed, %d quarantined%s", name, *counts, blocked)
    return ValidationSummary(out_dir=out_dir, document=document, timings=train.timings, reused=train.reused)


def _validate(shards: Any, out_dir: Path, policy: ValidationPolicy, force: bool) -> ValidationSummary | None:
    patterns = shards if isinstance(shards, (str, os.PathLike)) else list(shards)
    return None if patterns == [] else validate_phase(patterns, out_dir, policy, force=force)


def _split_entry(
    name: str,
    result: ValidationSummary | None,
    out_dir: Path,
    policy: ValidationPolicy,
    prefixes: tuple[str, ...],
) -> dict[str, Any]:
    no_samples = {  # a split with no shards
        **dict.fromkeys(("total", "passed", "quarantined"), 0),
        "quarantined_fraction": 0.0,
        "by_reason": {},
        "captions": {"context_tokens": policy.max_caption_tokens, "over_context": 0, "max_tokens": None},
        "blocked_reasons": [],
        "accepted_shards": [],
        "quarantine_shards": [],
    }
    doc = result.document if result is not None else no_samples
    own_reasons = [r for r in doc["blocked_reasons"] if not r.startswith(prefixes)]
    counts = ("total", "passed", "quarantined", "quarantined_fraction", "by_reason", "captions")
    return {
        "dir": os.path.relpath(split_dir(out_dir, name), out_dir),
        **{k: doc[k] for k in counts},
        "images": doc.get("images", {"transparent": 0, "transparent_keys": []}),
        "blocked": bool(own_reasons),
        "blocked_reasons": own_reasons,
        "accepted_shards": doc["accepted_shards"],
        "quarantine_shards": doc["quarantine_shards"],
    }


def split_accepted_paths(summary: ValidationSummary, split: str) -> list[Path]:
    """Absolute paths of the accepted shards of ``split`` in a :func:`validate_splits` summary."""
    entry = summary.document.get("splits", {}).get(split)
    if entry is None:
        raise KeyError(
            f"{summary.path} has no {split!r} split; known: {sorted(summary.document.get('splits', {}))}"
        )
    base = summary.out_dir / entry["dir"]
    return [base / p for p in entry["accepted_shards"]]
