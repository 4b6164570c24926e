"""Gallery-item lineage in Feast: which model version and embedding space wrote each item's vector.

Rows are pushed into the online store (the newest row per item); offline rows are append-only parquet parts,
one per write (Feast's own offline push to a file source rewrites the whole file each time). A repo definition
configured elsewhere (``lineage.repo``, e.g. a read-only ConfigMap) is only read: copied in when it changes.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from itertools import chain, islice
from pathlib import Path
from typing import Any

from compat.io import atomic_write

log = logging.getLogger(__name__)

# Each lineage column and its Arrow type (embedded_at: epoch us; parts written as timestamp[us] read alike).
_COLUMN_TYPES = {
    "item_id": "string",
    "caption": "string",
    "image_uri": "string",
    "model_version": "string",
    "space_id": "string",
    "embedded_at": "int64",
    "phase": "int64",
    "domain": "string",
}
ITEM_COLUMNS = tuple(_COLUMN_TYPES)
REQUIRED = ("item_id", "model_version", "space_id")
_CARRIED = ("caption", "image_uri", "domain")  # what a sync keeps from an item's lineage
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class LineageError(ValueError):
    """Bad lineage input or a repo that is not set up; the message says which field or what to run."""


class LineageStore:
    """The Feast feature repo at ``repo_dir`` (a workspace's ``feast/`` directory), made from the repo
    ``definition`` (a folder with ``feature_store.yaml``, read and never written) when one is given, else
    from the shipped template (:mod:`components.adapters.feature_repo`)."""

    def __init__(self, repo_dir: str | Path, *, definition: str | Path | None = None) -> None:
        self.repo_dir = Path(repo_dir).resolve()
        self.definition = Path(definition).resolve() if definition is not None else None
        if self.definition == self.repo_dir:
            self.definition = None
        self._store: Any = None

    @classmethod
    def of(cls, workspace: Any) -> LineageStore:
        return cls(workspace.lineage_dir, definition=workspace.lineage_definition)

    @property
    def items_dir(self) -> Path:
        from components.adapters.feature_repo import items  # Feast definitions; imported lazily (slow)

        return self.repo_dir / items.ITEMS_SOURCE_DIR

    @property
    def store(self) -> Any:
        """The ``feast.FeatureStore`` of this repo (made by :meth:`apply`)."""
        if self._store is None:
            if not (self.repo_dir / "feature_store.yaml").is_file():
                raise LineageError(
                    f"{self.repo_dir} has no feature_store.yaml: call LineageStore.apply() first"
                )
            from feast import FeatureStore

            self._store = FeatureStore(repo_path=str(self.repo_dir))
        return self._store

    def apply(self) -> None:
        """Make the repo and register the entity and feature view (idempotent). Without a definition, the
        template's ``feature_store.yaml`` and ``items.py`` are copied when missing (never overwritten); with
        one, its files (``items.py``: the template's when it has none) whenever they differ, reading the
        definition only."""
        from components.adapters.feature_repo import REPO_FILES, REPO_TEMPLATE_DIR, items

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
        self.store.apply([items.item, items.items_push, items.gallery_items])
        log.info("feast repo %s applied (feature view %s)", self.repo_dir, items.ITEMS_VIEW)

    def write_items(self, items: Any) -> int:
        """Record item vectors written by a model (a DataFrame or mappings of :data:`ITEM_COLUMNS`, the
        :data:`REQUIRED` ones given, ``embedded_at`` default now): append offline, upsert online; returns the
        row count. The newest row per item wins."""
        from feast.data_source import PushMode

        from components.adapters.feature_repo import items as defs

        frame = _normalise(items)
        if frame.empty:
            return 0
        self.items_dir.mkdir(parents=True, exist_ok=True)
        _write_part(frame, self.items_dir)  # offline: one append-only part (Feast's file store rewrites)
        self.store.push(defs.ITEMS_PUSH, frame, to=PushMode.ONLINE)
        log.info(
            "lineage: recorded %d items (versions %s)", len(frame), sorted(frame["model_version"].unique())
        )
        return len(frame)

    def sync_with_index(self, index_rows: Iterable[Mapping[str, Any]], *, batch_size: int = 2000) -> int:
        """Record indexed items whose model version or space differs from their online lineage (caption, image
        URI and domain carried over), a batch at a time; returns the count. A sync killed between the offline
        and the online write leaves the online store behind, so the next sync writes those items again."""
        written = 0
        for rows in _chunks(index_rows, batch_size):
            changed = []
            for row, known, agrees in self._compared(rows, ("model_version", "space_id", *_CARRIED)):
                if agrees:
                    continue
                item = {name: known[name] for name in _CARRIED} | {name: row[name] for name in REQUIRED}
                if known["model_version"] is None:  # not in the lineage yet: the index's own source
                    item["image_uri"] = row.get("source_uri")
                embedded_at = _EPOCH + timedelta(milliseconds=int(row["embedded_at"]))
                changed.append({**item, "embedded_at": embedded_at, "phase": row.get("phase")})
            written += self.write_items(changed)
        return written

    def _compared(
        self, rows: list[Mapping[str, Any]], names: tuple[str, ...]
    ) -> Iterator[tuple[Mapping[str, Any], dict[str, Any], bool]]:
        """Each index row of a batch with its online lineage (``names``, one keyed read for the batch) and
        whether the two name the same model version and space."""
        known = self._online([str(row["item_id"]) for row in rows], names)
        for position, row in enumerate(rows):
            had = {name: known[name][position] for name in names}
            yield row, had, all(had[f] == str(row[f]) for f in ("model_version", "space_id"))

    def _online(self, item_ids: list[str], names: Iterable[str]) -> dict[str, list[Any]]:
        """``{feature: [value per id]}`` from the online store (``None`` where an item has none)."""
        from components.adapters.feature_repo import items as defs

        if not item_ids:
            return {name: [] for name in names}
        response = self.store.get_online_features(
            features=[f"{defs.ITEMS_VIEW}:{name}" for name in names],
            entity_rows=[{"item_id": i} for i in item_ids],
        ).to_dict()
        return {name: response[name] for name in names}

    def check_against_index(self, index_rows: Iterable[Mapping[str, Any]], *, batch_size: int = 2000) -> dict:
        """Whether the online lineage of every indexed item names the model version and space its index row
        does, streamed in batches: items per model version in the index and in their lineage (``"none"``: an
        item it lacks), the count that disagree, up to five of their ids, and ``agree``."""
        index, lineage, disagreeing, examples = Counter[str](), Counter[str](), 0, []
        for rows in _chunks(index_rows, batch_size):
            for row, known, agrees in self._compared(rows, ("model_version", "space_id")):
                index[str(row["model_version"])] += 1
                lineage[known["model_version"] or "none"] += 1
                if not agrees:
                    disagreeing += 1
                    if len(examples) < 5:
                        examples.append(str(row["item_id"]))
        return _agreement(index, lineage, disagreeing, examples)

    def get_items(self, item_ids: Iterable[str]) -> list[dict[str, Any]]:
        """Online lineage of ``item_ids`` in order; unknown items come back with ``None`` features."""
        from components.adapters.feature_repo import items as defs

        ids = [str(i) for i in item_ids]
        known = self._online(ids, defs.FEATURE_NAMES)
        rows = [{"item_id": i, **{name: known[name][p] for name in known}} for p, i in enumerate(ids)]
        for row in rows:
            if isinstance(row["embedded_at"], int):  # (online rows from before it was an int: datetimes)
                row["embedded_at"] = _EPOCH + timedelta(microseconds=row["embedded_at"])
        return rows

    def has_items(self) -> bool:
        """Whether any offline lineage row was written."""
        return self.items_dir.is_dir() and any(self.items_dir.glob("*.parquet"))


SLICE_ROWS = 20_000  # rows a sync or check reads per slice of the gallery


def sync_from_index(
    repo_dir: str | Path, uri: str, alias: str, *, definition: str | Path | None = None, workers: int = 1
) -> int:
    """Bring the lineage in ``repo_dir`` in line with the collection serving ``alias`` (after a halt, a
    blue-green switch or a rollback), read by :func:`over_slices`; returns the rows written."""
    LineageStore(repo_dir, definition=definition).apply()
    return sum(over_slices("sync_with_index", str(repo_dir), definition, uri, alias, workers))


def check_from_index(
    repo_dir: str | Path, uri: str, alias: str, *, definition: str | Path | None = None, workers: int = 1
) -> dict[str, Any]:
    """:meth:`LineageStore.check_against_index` of the collection serving ``alias``, read by
    :func:`over_slices`, the slices' answers added up."""
    parts = over_slices("check_against_index", str(repo_dir), definition, uri, alias, workers)
    index = sum((Counter(part["index"]) for part in parts), Counter())
    lineage = sum((Counter(part["lineage"]) for part in parts), Counter())
    examples = [e for part in parts for e in part["examples"]][:5]
    return _agreement(index, lineage, sum(part["disagreeing"] for part in parts), examples)


def _agreement(index: Counter[str], lineage: Counter[str], disagreeing: int, examples: list[str]) -> dict:
    return {
        "index": dict(sorted(index.items())),
        "lineage": dict(sorted(lineage.items())),
        "disagreeing": disagreeing,
        "examples": examples,
        "agree": disagreeing == 0,
    }


def over_slices(work: str, repo: str, definition: Any, uri: str, alias: str, workers: int) -> list[Any]:
    """:class:`LineageStore` method ``work`` (:func:`_read_slices`) over the serving collection cut into
    slices of about :data:`SLICE_ROWS` rows by ``order_key``: in this process, or spread over ``workers``
    processes when the index is a server (a milvus-lite directory opens in one process only). A collection
    written before per-row keys is one slice."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from components.adapters.index import GalleryIndex, is_remote, key_slices

    with GalleryIndex(uri, alias) as index:
        collection = index.serving_collection()
        if collection is None:
            return []
        keyed = index.has_order_keys(collection)
        n = index.count(collection)
    filters = key_slices(max(1, n // SLICE_ROWS)) if keyed else [""]
    if workers <= 1 or len(filters) == 1 or not is_remote(uri):
        return [_read_slices(work, repo, definition, uri, alias, filters)]
    shares = [filters[i::workers] for i in range(min(workers, len(filters)))]
    with ProcessPoolExecutor(len(shares), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_read_slices, work, repo, definition, uri, alias, share) for share in shares]
        return [future.result() for future in futures]


def _read_slices(work: str, repo: str, definition: Any, uri: str, alias: str, filters: list[str]) -> Any:
    """``LineageStore.<work>`` of the serving collection's rows that match any of ``filters``."""
    from components.adapters.index import GalleryIndex

    store = LineageStore(repo, definition=definition)
    with GalleryIndex(uri, alias) as index:
        return getattr(store, work)(chain.from_iterable(index_rows(index, filter=f) for f in filters))


def index_rows(index: Any, collection: str | None = None, filter: str = "") -> Iterator[dict[str, Any]]:
    """The rows of ``collection`` (default: the one ``index`` serves) that match ``filter``, with the fields
    lineage compares, read in batches."""
    fields = ("model_version", "space_id", "embedded_at", "phase", "source_uri")
    for batch in index.iter_rows(fields, collection, filter):
        yield from batch


def _chunks(rows: Iterable[Mapping[str, Any]], size: int) -> Iterator[list[Mapping[str, Any]]]:
    checked = _rows(rows)
    while chunk := list(islice(checked, size)):
        yield chunk


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
    for column in ITEM_COLUMNS:
        if column not in frame.columns:
            frame[column] = None  # (no embedded_at: now)
    embedded = pd.to_datetime(frame["embedded_at"], utc=True).fillna(pd.Timestamp(now))
    frame["embedded_at"] = ((embedded - _EPOCH) // pd.Timedelta(microseconds=1)).astype("int64")
    frame["phase"] = pd.array(frame["phase"], dtype="Int64")
    for column in (*REQUIRED, *_CARRIED):
        frame[column] = (
            frame[column].map(lambda v: None if v is None or v is pd.NA else str(v)).astype(object)
        )
    frame["written_at"] = pd.Timestamp(now)
    frame = frame.sort_values("embedded_at", kind="stable").drop_duplicates("item_id", keep="last")
    return frame[[*ITEM_COLUMNS, "written_at"]].reset_index(drop=True)


def _rows(items: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    for row in items:
        if not isinstance(row, Mapping):
            raise LineageError(f"lineage rows must be mappings, got {type(row).__name__}")
        yield row


def _arrow_schema() -> Any:
    import pyarrow as pa

    columns = [(name, pa.type_for_alias(kind)) for name, kind in _COLUMN_TYPES.items()]
    return pa.schema([*columns, ("written_at", pa.timestamp("us", tz="UTC"))])


def _write_part(frame: Any, directory: Path) -> Path:
    """One parquet part, written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, schema=_arrow_schema(), preserve_index=False)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    final = directory / f"part-{stamp}-{uuid.uuid4().hex[:8]}.parquet"
    return atomic_write(final, lambda tmp: pq.write_table(table, tmp))


def _copy_if_changed(source: Path, target: Path) -> None:
    """``target`` made equal to ``source``, atomically, unless it already is."""
    data = source.read_bytes()
    if not (target.is_file() and target.read_bytes() == data):
        atomic_write(target, lambda tmp: tmp.write_bytes(data))
