"""What a rollout is made of: its configuration, encoders, probe set, paths and errors."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from components.serving.record import QueryEncoder

if TYPE_CHECKING:
    from components.deployment import RolloutSection

DEFAULT_KS: tuple[int, ...] = (1, 5, 10)
# Rows upserted between flushes. Milvus answers a search over unflushed (growing) rows by brute force: with
# thousands of them every query slows down several-fold (measured in benchmarks/results/backfill.md, part E),
# while a flush of up to ~1,000 rows costs about as much as a few searches.
DEFAULT_FLUSH_ROWS = 1024


class RolloutError(RuntimeError):
    """The rollout cannot start or continue; the message says why and what to do."""


class RangesPending(Exception):
    """A backfill stage's rank ranges wait for workers that run elsewhere (``RolloutConfig.range_tasks``)."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        super().__init__(f"{len(ranges)} rank range(s) wait for their workers")
        self.ranges = ranges


@dataclass(frozen=True)
class ItemRef:
    """What a gallery encoder needs to re-embed one item."""

    item_id: str
    source_uri: str = ""
    phase: int = 0
    embedded_at: int = 0
    model_version: str = ""


GalleryEncoder = Callable[[Sequence[ItemRef]], np.ndarray]
VectorTransform = Callable[[np.ndarray], np.ndarray]


@dataclass
class ProbeSet:
    """Held-out text queries and the gallery item ids relevant to each."""

    texts: list[str]
    positives: list[list[str]]

    def __post_init__(self) -> None:
        if not self.texts:
            raise ValueError("probe set: no queries; a rollout needs held-out queries to score each stage")
        if len(self.texts) != len(self.positives):
            raise ValueError(f"probe set: {len(self.texts)} texts but {len(self.positives)} positive lists")
        for i, pos in enumerate(self.positives):
            if not pos:
                raise ValueError(f"probe set: query {i} ({self.texts[i]!r}) has no relevant item")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ProbeSet:
        """Read ``{"texts": [...], "positives": [[item_id, ...], ...]}``."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RolloutError(f"cannot read the probe set {path}: {exc}") from exc
        if not isinstance(doc, dict) or not {"texts", "positives"} <= doc.keys():
            raise RolloutError(f"{path}: a probe set is an object with 'texts' and 'positives'")
        try:
            return cls([str(t) for t in doc["texts"]], [[str(p) for p in pos] for pos in doc["positives"]])
        except ValueError as exc:
            raise RolloutError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {"texts": self.texts, "positives": self.positives}


@dataclass
class RolloutEncoders:
    """The serving contract of a release, as callables. ``new_query`` output goes through ``query_transform``
    (a backward adapter, a truncation) when given; ``gallery_transform`` maps stored old vectors into the
    serving space (forward adapter, zero-padding), applied to a copy of the gallery in stage 0. ``space`` and
    ``transform_tag`` (recorded in each row) name the contract; ``recipe`` the factory and arguments they
    were built from, so that backfill workers in other processes build the same ones."""

    old_query: QueryEncoder
    new_query: QueryEncoder
    new_gallery: GalleryEncoder
    query_transform: VectorTransform | None = None
    gallery_transform: VectorTransform | None = None
    space: str | None = None
    transform_tag: str = ""
    recipe: dict[str, Any] | None = None  # {"factory": "module:function", "args": {...}}

    def serving_queries(self, texts: Sequence[str]) -> np.ndarray:
        q = np.asarray(self.new_query(list(texts)), dtype=np.float32)
        return np.asarray(self.query_transform(q), dtype=np.float32) if self.query_transform else q


@dataclass(kw_only=True)
class RolloutConfig:
    """What to roll out and how: the deployment's ``rollout`` section (:meth:`from_section`: the section owns
    their defaults) and the run's own settings. ``query_model`` describes the new query encoder (``version``,
    ``uri``, ``factory``); ``floors`` can only raise the probe's floors
    (:func:`components.rollout.plan.probe_floors`)."""

    # the deployment's rollout section
    order: str  # the backfill order (rollout.order)
    fractions: tuple[float, ...]
    batch_size: int
    workers: int  # processes a backfill stage's rank ranges are re-embedded by (1: this process)
    floors: dict[str, float]
    probe_tolerance: float  # standard errors a stage's probe may fall below old/old
    slo_p99_factor: float | None  # query p99 the backfill may cause, x idle (None: unpaced)
    max_items_per_s: float | None  # a cap on the backfill rate (all workers together)
    # the run's own
    new_version: str
    query_model: dict[str, Any] = field(default_factory=dict)
    space: str | None = None
    seed: int = 0
    range_tasks: bool = False  # the ranges are run by pipeline tasks: run() returns while any is pending
    # the engine's own (no config key)
    ks: tuple[int, ...] = DEFAULT_KS
    n_clusters: int | None = None
    flush_rows: int = DEFAULT_FLUSH_ROWS  # rows written between flushes (0: at stage ends only)

    @classmethod
    def from_section(cls, section: RolloutSection, **fields: Any) -> RolloutConfig:
        """The deployment's ``rollout`` section, then ``fields``: the run's own settings, the engine's, and
        any section setting a test or benchmark overrides by its name here. A section field RolloutConfig
        lacks is refused (TypeError), so a new rollout setting cannot be dropped on its way to the engine."""
        slo = section.slo
        settings = section.model_dump(exclude={"slo"})
        settings.update(slo_p99_factor=slo.p99_factor, max_items_per_s=slo.max_items_per_s)
        return cls(**{**settings, **fields})

    def __post_init__(self) -> None:
        """The run's own settings and the fractions' order (the section checks its other settings)."""
        if not self.new_version:
            raise ValueError("new_version is required (the model version that writes the new vectors)")
        self.query_model = {"version": self.new_version, **self.query_model}
        self.fractions = tuple(float(f) for f in self.fractions)
        f = self.fractions
        if (
            not f
            or any(b <= a for a, b in zip(f, f[1:], strict=False))
            or f[0] <= 0
            or abs(f[-1] - 1.0) > 1e-12
        ):
            raise ValueError(
                f"fractions must increase strictly within (0, 1] and end at 1.0 (every item gets "
                f"its new vector), got {list(f)}"
            )
        if self.flush_rows < 0:
            raise ValueError(f"flush_rows must be >= 0 (0: flush at stage ends only), got {self.flush_rows}")
        self.ks = tuple(sorted({int(k) for k in self.ks}))
        if not self.ks or self.ks[0] < 1:
            raise ValueError(f"ks must be positive, got {self.ks}")


@dataclass(frozen=True)
class RolloutPaths:
    """Where a rollout keeps its state, its work files and finds the serving record and the running services:
    a workspace's (:meth:`for_workspace`)."""

    state: Path
    serving: Path
    work_root: Path
    services: Path
    probe: Path
    lineage: Path | None = None  # the item lineage repo the rollout's writers record in (None: none)
    lineage_definition: Path | None = None

    @classmethod
    def for_workspace(cls, workspace: Any = None) -> RolloutPaths:
        """The paths :class:`components.state.workspace.Workspace` gives a workspace (or a folder)."""
        from components.state.workspace import Workspace

        ws = Workspace.coerce(workspace)
        return cls(
            state=ws.rollout_state_path,
            serving=ws.serving_path,
            work_root=ws.rollout_dir,
            services=ws.services_dir,
            probe=ws.probe_path,
            lineage=ws.lineage_dir,
            lineage_definition=ws.lineage_definition,
        )

    def lineage_spec(self) -> dict[str, str | None] | None:
        """Where a worker records the lineage of the rows it writes (None: no lineage repo)."""
        if self.lineage is None:
            return None
        definition = str(self.lineage_definition) if self.lineage_definition else None
        return {"repo": str(self.lineage), "definition": definition}

    @property
    def root(self) -> Path:
        """The folder that paths stored in the state files are relative to (the workspace)."""
        return self.state.parent

    def archived_states(self) -> list[Path]:
        """The state files of earlier rollouts, archived in their work folders, oldest name first."""
        return sorted(self.work_root.glob(f"*/{self.state.name}"))

    def archived_state(self, rollout_id: str) -> Path:
        return self.work(rollout_id) / self.state.name

    def centres(self, collection: str) -> Path:
        """The centres the rows of ``collection`` are keyed against (:mod:`components.rollout.keys`)."""
        return self.work_root / "centres" / f"{collection}.npy"

    def work(self, rollout_id: str) -> Path:
        """One rollout's work files (its centres, archived state, workers' spec and cursors)."""
        return self.work_root / rollout_id


def item_ref(row: Mapping[str, Any]) -> ItemRef:
    """The :class:`ItemRef` of an index row."""
    return ItemRef(
        str(row["item_id"]),
        str(row["source_uri"]),
        int(row["phase"]),
        int(row["embedded_at"]),
        str(row["model_version"]),
    )
