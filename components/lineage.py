"""Gallery-item lineage in Feast: which model version and embedding space wrote each item's vector.

The indexing and backfill stages call :meth:`LineageStore.write_items` after each upsert; on-call
and the backfill planner call :meth:`LineageStore.get_items` / :meth:`LineageStore.versions_by_item`.
Offline rows are append-only parquet parts (one file per write, renamed into place, so a crash
never leaves a half-written file); the online store (sqlite by default) holds the newest row per item.

The repo written to is the workspace's (:attr:`components.workspace.Workspace.lineage_dir`); a repo
definition configured elsewhere (``lineage.repo``: on a cluster a ConfigMap volume, read-only) is only read:
its ``feature_store.yaml`` (and ``items.py`` when it has one) is copied into the written repo, again whenever
it changes, so the offline parts and any path relative to the repo land on the workspace volume.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ITEM_COLUMNS = (
    "item_id",
    "caption",
    "image_uri",
    "model_version",
    "space_id",
    "embedded_at",
    "phase",
    "domain",
)
REQUIRED = ("item_id", "model_version", "space_id")


class LineageError(ValueError):
    """Bad lineage input or a repo that is not set up; the message says which field or what to run."""


class LineageStore:
    """The Feast feature repo at ``repo_dir`` (a workspace's ``feast/`` directory), made from the repo
    ``definition`` (a folder with ``feature_store.yaml``, read and never written) when one is given, else
    from the shipped template (:mod:`components.feature_repo`)."""

    def __init__(self, repo_dir: str | Path, *, definition: str | Path | None = None) -> None:
        self.repo_dir = Path(repo_dir).resolve()
        self.definition = Path(definition).resolve() if definition is not None else None
        if self.definition == self.repo_dir:
            self.definition = None
        self._store: Any = None

    @classmethod
    def of(cls, workspace: Any) -> LineageStore:
        """The lineage of a :class:`~components.workspace.Workspace`: its repo, made from its definition."""
        return cls(workspace.lineage_dir, definition=workspace.lineage_definition)

    @property
    def items_dir(self) -> Path:
        from components.feature_repo import items  # Feast definitions; imported lazily (slow)

        return self.repo_dir / items.ITEMS_SOURCE_DIR

    @property
    def store(self) -> Any:
        """The ``feast.FeatureStore`` of this repo (the repo must have been scaffolded)."""
        if self._store is None:
            if not (self.repo_dir / "feature_store.yaml").is_file():
                raise LineageError(
                    f"{self.repo_dir} has no feature_store.yaml: call LineageStore.apply() first"
                )
            from feast import FeatureStore

            self._store = FeatureStore(repo_path=str(self.repo_dir))
        return self._store

    def scaffold(self) -> None:
        """Make the repo: without a definition, copy the template's ``feature_store.yaml`` and ``items.py``
        when missing (never overwrites); with one, copy its files (``items.py``: the template's when it has
        none) whenever they differ, reading the definition only."""
        from components.feature_repo import REPO_FILES, REPO_TEMPLATE_DIR

        self.repo_dir.mkdir(parents=True, exist_ok=True)
        if self.definition is None:
            for name in REPO_FILES:
                target = self.repo_dir / name
                if not target.exists():
                    shutil.copyfile(REPO_TEMPLATE_DIR / name, target)
        else:
            if not (self.definition / "feature_store.yaml").is_file():
                raise LineageError(
                    f"the lineage repo definition {self.definition} has no feature_store.yaml (config field "
                    "lineage.repo: the folder the Feast ConfigMap is mounted at)"
                )
            for name in REPO_FILES:
                source = self.definition / name
                _copy_if_changed(
                    source if source.is_file() else REPO_TEMPLATE_DIR / name, self.repo_dir / name
                )
        (self.repo_dir / "data").mkdir(exist_ok=True)
        self.items_dir.mkdir(parents=True, exist_ok=True)

    def apply(self) -> None:
        """Scaffold the repo and register the entity and feature view (idempotent)."""
        from components.feature_repo import items

        self.scaffold()
        self.store.apply([items.item, items.gallery_items])
        log.info("feast repo %s applied (feature view %s)", self.repo_dir, items.ITEMS_VIEW)

    def write_items(self, items: Any) -> int:
        """Record item vectors written by a model: append offline, upsert online; returns the row count.

        ``items`` is a pandas DataFrame or an iterable of mappings with ``item_id``,
        ``model_version`` and ``space_id`` (required) and ``caption``, ``image_uri``,
        ``embedded_at`` (default: now), ``phase``, ``domain``. The newest row per item wins.
        """
        from components.feature_repo import items as defs

        frame = _normalise(items)
        if frame.empty:
            return 0
        self.items_dir.mkdir(parents=True, exist_ok=True)
        _write_part(frame, self.items_dir)
        self.store.write_to_online_store(defs.ITEMS_VIEW, frame)
        log.info(
            "lineage: recorded %d items (versions %s)", len(frame), sorted(frame["model_version"].unique())
        )
        return len(frame)

    def sync_with_index(self, index_rows: Iterable[Mapping[str, Any]]) -> int:
        """Record indexed items whose model version or space differs from their lineage; returns the count.

        ``index_rows`` are gallery rows (``item_id``, ``model_version``, ``space_id``, ``embedded_at`` in
        epoch ms, ``phase``, ``source_uri``), e.g. after a backfill or a rollback. Caption, image URI and
        domain carry over from the item's newest lineage row.
        """
        import pandas as pd

        latest = self.latest_offline().set_index("item_id")
        changed = []
        for row in index_rows:
            item = str(row["item_id"])
            known = latest.loc[item] if item in latest.index else None
            version, space = str(row["model_version"]), str(row["space_id"])
            if known is not None and (known["model_version"], known["space_id"]) == (version, space):
                continue
            changed.append(
                {
                    "item_id": item,
                    "model_version": version,
                    "space_id": space,
                    "embedded_at": pd.to_datetime(int(row["embedded_at"]), unit="ms", utc=True),
                    "phase": row.get("phase"),
                    "caption": None if known is None else known["caption"],
                    "image_uri": row.get("source_uri") if known is None else known["image_uri"],
                    "domain": None if known is None else known["domain"],
                }
            )
        return self.write_items(changed)

    def get_items(self, item_ids: Iterable[str]) -> list[dict[str, Any]]:
        """Online lineage of ``item_ids`` in order; unknown items come back with ``None`` features."""
        from components.feature_repo import items as defs

        ids = [str(i) for i in item_ids]
        if not ids:
            return []
        response = self.store.get_online_features(
            features=defs.FEATURES, entity_rows=[{"item_id": i} for i in ids]
        ).to_dict()
        rows = []
        for index, item_id in enumerate(ids):
            row = {"item_id": item_id}
            for name in defs.FEATURE_NAMES:
                row[name] = response[name][index]
            if isinstance(row["embedded_at"], int):  # (online rows from before it was an int: datetimes)
                row["embedded_at"] = _from_micros(row["embedded_at"]).to_pydatetime()
            rows.append(row)
        return rows

    def versions_by_item(self, item_ids: Iterable[str] | None = None) -> dict[str, str | None]:
        """``{item_id: model_version}``: online for the given ids, else every item from the offline rows."""
        if item_ids is not None:
            return {row["item_id"]: row["model_version"] for row in self.get_items(item_ids)}
        latest = self.latest_offline()
        return dict(zip(latest["item_id"], latest["model_version"], strict=True))

    def version_counts(self) -> dict[str, int]:
        """Items per model version (from the offline rows' newest entry per item)."""
        return dict(Counter(self.versions_by_item().values()))

    def latest_offline(self) -> Any:
        """The newest offline row per item as a DataFrame (empty when nothing was written)."""
        import pandas as pd
        import pyarrow.dataset as ds

        parts = sorted(self.items_dir.glob("*.parquet")) if self.items_dir.is_dir() else []
        if not parts:
            return pd.DataFrame(columns=[*ITEM_COLUMNS, "written_at"])
        frame = (
            ds.dataset([str(p) for p in parts], format="parquet", schema=_arrow_schema())
            .to_table()
            .to_pandas()
        )
        frame = frame.sort_values(["written_at", "embedded_at"], kind="stable")
        frame["embedded_at"] = _from_micros(frame["embedded_at"])
        return frame.drop_duplicates("item_id", keep="last").reset_index(drop=True)


def sync_from_index(
    repo_dir: str | Path, uri: str, alias: str, *, definition: str | Path | None = None
) -> int:
    """Bring the lineage in ``repo_dir`` (made from ``definition``, see :class:`LineageStore`) in line with
    the collection serving ``alias`` at the Milvus ``uri`` (after a backfill, a blue-green switch or a
    rollback); returns the rows written."""
    from components.index import GalleryIndex

    with GalleryIndex(uri, alias) as index:
        fields = ("model_version", "space_id", "embedded_at", "phase", "source_uri")
        rows = [row for batch in index.iter_rows(fields) for row in batch]
    store = LineageStore(repo_dir, definition=definition)
    store.apply()
    return store.sync_with_index(rows)


def _normalise(items: Any) -> Any:
    """A DataFrame with every lineage column typed, checked, one (newest) row per item."""
    import pandas as pd

    frame = items.copy() if isinstance(items, pd.DataFrame) else pd.DataFrame([dict(r) for r in _rows(items)])
    if frame.empty:
        return frame
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise LineageError(f"lineage rows lack required column(s) {missing}; each row needs {list(REQUIRED)}")
    unknown = sorted(set(frame.columns) - set(ITEM_COLUMNS))
    if unknown:
        raise LineageError(f"lineage rows have unknown column(s) {unknown}; allowed: {list(ITEM_COLUMNS)}")
    for column in REQUIRED:
        bad = frame[column].isna() | (frame[column].astype(str).str.len() == 0)
        if bad.any():
            raise LineageError(
                f"lineage column {column!r} is empty for item(s) {frame.loc[bad, 'item_id'].tolist()[:5]}"
            )
    now = datetime.now(UTC)
    for column in ("caption", "image_uri", "domain"):
        if column not in frame.columns:
            frame[column] = None
    if "embedded_at" not in frame.columns:
        frame["embedded_at"] = now
    embedded = pd.to_datetime(frame["embedded_at"], utc=True).fillna(pd.Timestamp(now))
    frame["embedded_at"] = _to_micros(embedded)
    frame["phase"] = pd.array(
        frame["phase"] if "phase" in frame.columns else [None] * len(frame), dtype="Int64"
    )
    for column in ("item_id", "model_version", "space_id", "caption", "image_uri", "domain"):
        frame[column] = (
            frame[column].map(lambda v: None if v is None or v is pd.NA else str(v)).astype(object)
        )
    frame["written_at"] = pd.Timestamp(now)
    frame = frame.sort_values("embedded_at", kind="stable").drop_duplicates("item_id", keep="last")
    return frame[[*ITEM_COLUMNS, "written_at"]].reset_index(drop=True)


def _to_micros(times: Any) -> Any:
    """UTC datetimes as int64 epoch microseconds (how lineage stores ``embedded_at``)."""
    import pandas as pd

    return ((times - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(microseconds=1)).astype("int64")


def _from_micros(values: Any) -> Any:
    import pandas as pd

    return pd.to_datetime(values, unit="us", utc=True)


def _rows(items: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    for row in items:
        if not isinstance(row, Mapping):
            raise LineageError(f"lineage rows must be mappings, got {type(row).__name__}")
        yield row


def _arrow_schema() -> Any:
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("item_id", pa.string()),
            ("caption", pa.string()),
            ("image_uri", pa.string()),
            ("model_version", pa.string()),
            ("space_id", pa.string()),
            ("embedded_at", pa.int64()),  # epoch us (parts written as timestamp[us] read the same)
            ("phase", pa.int64()),
            ("domain", pa.string()),
            ("written_at", ts),
        ]
    )


def _write_part(frame: Any, directory: Path) -> Path:
    """One parquet part, written under a hidden name and renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, schema=_arrow_schema(), preserve_index=False)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    final = directory / f"part-{stamp}-{uuid.uuid4().hex[:8]}.parquet"
    tmp = directory / f".{final.name}.tmp"
    pq.write_table(table, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    tmp.replace(final)
    return final


def _copy_if_changed(source: Path, target: Path) -> None:
    """``target`` made equal to ``source`` (temp file + rename) unless it already is."""
    data = source.read_bytes()
    if target.is_file() and target.read_bytes() == data:
        return
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
