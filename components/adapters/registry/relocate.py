"""A copied or moved workspace's MLflow store pointed at its own artifacts.

MLflow keeps a local store's artifact locations as absolute ``file:`` URIs (the experiment's, each run's, each
model version's source): a relative one is resolved against the working folder of whichever process reads it
(MLflow 3.17), not against the store, so it cannot be stored relative to the workspace. A workspace copied
elsewhere therefore names the original's ``mlartifacts`` folder, and plain MLflow on the copy would write
into the original's. :func:`rebase_artifacts` rewrites those URIs to the copy's own folder; it is the one
write compatflow makes to MLflow's tables itself (MLflow has no call that changes an artifact location).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)

# (table, column) of MLflow's sqlite schema that hold artifact URIs; tables an older schema lacks are skipped
ARTIFACT_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
    ("logged_models", "artifact_location"),
)


def rebase_artifacts(db: Path, artifacts_dir: Path, experiment: str) -> str | None:
    """Point the store ``db`` at ``artifacts_dir`` when its ``experiment`` names another workspace's
    artifacts folder (one of the same name elsewhere: the workspace was copied or moved). Every artifact URI
    under the old folder is rewritten, in one transaction. Returns the old folder's URI, or None when there
    was nothing to change (no such experiment, already here, or a location compatflow did not choose)."""
    here = artifacts_dir.as_uri()
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection, connection:  # one transaction
        row = connection.execute(
            "SELECT artifact_location FROM experiments WHERE name = ?", (experiment,)
        ).fetchone()
        old = row[0] if row and row[0] else ""
        local = old.startswith("file:") and Path(unquote(urlparse(old).path)).name == artifacts_dir.name
        if not local or old == here:
            return None
        tables = {n for (n,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for table, column in ARTIFACT_COLUMNS:
            if table in tables:
                connection.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 - our names
                    f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                    (here, len(old) + 1, old, len(old) + 1, old + "/"),
                )
    log.warning("this workspace's MLflow store named the artifacts at %s: it now names %s", old, here)
    return old
