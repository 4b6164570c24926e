"""Read-only answers from an embedded MLflow sqlite store: aliases, a version's facts and tags, a registered
model's tag, read from its tables with :mod:`sqlite3` instead of through MLflow, whose import alone costs
a second (``compatflow status`` and ``search`` read a few rows). Writes always go through MLflow."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DELETED = "Deleted_Internal"  # MLflow's stage of a deleted version still in the table


def _connect(db: Path) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30))


def _value(db: Path, query: str, *params: str) -> str | None:
    """The first column of the first row ``query`` answers, as text, or None."""
    with _connect(db) as c:
        row = c.execute(query, params).fetchone()
    return None if row is None else str(row[0])


def alias_version(db: Path, model: str, alias: str) -> str | None:
    """The version ``alias`` points at, or None."""
    return _value(
        db, "SELECT version FROM registered_model_aliases WHERE name = ? AND alias = ?", model, alias
    )


def version_info(db: Path, model: str, version: str) -> dict[str, Any] | None:
    """What :meth:`~components.adapters.registry.Registry.version_info` returns, or None when not held."""
    with _connect(db) as c:
        row = c.execute(
            "SELECT version, run_id, source, creation_time FROM model_versions "
            "WHERE name = ? AND version = ? AND current_stage != ?",
            (model, str(version), DELETED),
        ).fetchone()
        if row is None:
            return None
        aliases = c.execute(
            "SELECT alias FROM registered_model_aliases WHERE name = ? AND version = ?", (model, row[0])
        ).fetchall()
        tags = c.execute(
            "SELECT key, value FROM model_version_tags WHERE name = ? AND version = ?", (model, row[0])
        ).fetchall()
    return version_record(*row, [a for (a,) in aliases], tags)


def version_record(
    version: Any, run_id: str, source: str, created_ms: int, aliases: Iterable[str], tags: Any
) -> dict[str, Any]:
    """A version's facts as :meth:`~components.adapters.registry.Registry.version_info` returns them."""
    return {
        "version": str(version),
        "run_id": run_id,
        "source": source,
        "created_at": datetime.fromtimestamp(created_ms / 1000, UTC).isoformat(timespec="seconds"),
        "aliases": sorted(aliases),
        "tags": dict(tags),
    }


def model_tag(db: Path, model: str, key: str) -> str | None:
    """A tag of the registered model, or None."""
    return _value(db, "SELECT value FROM registered_model_tags WHERE name = ? AND key = ?", model, key)
