"""The rollout state document (``rollout_state.json``): its typed model, from which
``schemas/rollout_state.schema.json`` is generated (``make schemas``), with the one reader every process uses
(the rollout engine, the search service, ``compatflow status``), which brings a file an earlier release wrote
to this version on read, and its writer.

Written atomically after every batch by :mod:`components.rollout`. Stage 0 is the query-model switch;
stages 1..k reach the configured fractions of the gallery in the recorded order. Metrics are percentages.
Version 2 names a rollout's and a stage's progress ``status`` (version 1: ``state``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from compat.io import read_json, utc_now, write_json_atomic
from components.state.workspace import map_paths, resolved_path, stored_path

SCHEMA_VERSION = 2
# the paths a rollout state names, stored relative to the workspace (components.state.workspace)
PATHS = ("gallery.uri", "order.centres", "query_model.uri", "new_query_model.uri", "previous_query_model.uri")

Percent = Annotated[float, Field(ge=0, le=100)]
MetricName = Annotated[str, StringConstraints(pattern=r"^R@[0-9]+$")]


def _has_r1(metrics: dict[str, float]) -> dict[str, float]:
    if "R@1" not in metrics:
        raise ValueError("R@1 is missing")
    return metrics


Metrics = Annotated[dict[MetricName, Percent], AfterValidator(_has_r1)]
Status = Literal["pending", "running", "halted", "completed", "rolled_back"]


class _Record(BaseModel):
    # every key the engine writes is declared here; an assignment is checked as a read is
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def document(self) -> dict[str, Any]:
        """The record as its file holds it: the keys it was read or made with, and those set since."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class ModelRef(_Record):
    version: str = Field(min_length=1)
    uri: str | None = None
    factory: str | None = None
    options: dict[str, Any] | None = None
    side: Literal["old", "new"] | None = None


class OrderRecord(_Record):
    """A stage as a filter on the keys each row carries (components.rollout.keys)."""

    policy: Literal["random", "oldest_first", "lambda_orth", "uncertainty"]
    seed: int
    offset: int | None = Field(default=None, ge=0, description="random: where the order_key window starts")
    cuts: list[tuple[float, int] | None] | None = Field(
        default=None, description="per fraction, the (key, order_key) pair the stages below it end at"
    )
    centres: str | None = Field(default=None, description="the centres the written rows are keyed against")
    sample: int | None = Field(default=None, ge=0, description="rows the plan read to place the cuts")
    n_clusters: int | None = Field(default=None, ge=1)


class Cursor(_Record):
    position: int = Field(ge=0, description="items written so far")
    batches: int = Field(ge=0, description="slices written so far")
    ranges: list[tuple[int, int]] | None = Field(default=None, description="the running stage's slice ranges")


class GalleryRecord(_Record):
    uri: str
    alias: str
    source_collection: str
    source_space: str
    collection: str = Field(description="Collection the new vectors are written to.")
    keyed: bool | None = Field(default=None, description="the source's rows carry order keys")
    source_previous: dict[str, Any] | None = Field(default=None, description="the record's rollback target")
    space: str
    dim: int = Field(ge=1)
    transform: str | None = None
    versions_before: dict[str, Annotated[int, Field(ge=0)]]
    versions_after: dict[str, Annotated[int, Field(ge=0)]] | None = None


class Pace(_Record):
    """What the backfill ran at (components.rollout.pacing)."""

    p99_factor: float | None = None
    max_items_per_s: float | None = None
    latency_from: Literal["service", "searches"] | None = Field(
        default=None, description="service: users' queries from the services' /metrics; searches: timed"
    )
    idle_p99_ms: float | None = None
    last_p99_ms: float | None = None
    items_per_s_allowed: float | None = None
    slowdowns: int = Field(default=0, ge=0)
    slept_s: float = Field(default=0.0, ge=0)


class WorkerRecord(_Record):
    """One worker's share of a stage: its slice range and what it wrote (components.rollout.workers)."""

    slices: tuple[int, int]
    written: int | None = Field(default=None, ge=0)
    seconds: float | None = Field(default=None, ge=0)
    items_per_s: float | None = Field(default=None, ge=0)
    cpu_seconds: float | None = Field(default=None, ge=0)
    peak_rss_mib: float | None = Field(default=None, ge=0)
    pace: Pace | None = None


class StageRecord(_Record):
    stage: int = Field(ge=0)
    fraction: float = Field(ge=0, le=1)
    target_position: int = Field(ge=0)
    status: Literal["pending", "running", "accepted", "halted"]
    kind: Literal["query_switch", "backfill", "fill"]
    probe: Metrics | None = None
    items_per_s: float | None = Field(default=None, ge=0)
    seconds: float | None = Field(default=None, ge=0, description="the stage's last run: writes, probe")
    started_at: str | None = None
    finished_at: str | None = None
    workers: list[WorkerRecord] | None = None


class CurvePoint(_Record):
    fraction: float = Field(ge=0, le=1)
    t2i_r1: Percent = Field(alias="t2i_R@1")


class RolloutState(_Record):
    """Durable progress of a gallery rollout (staged partial backfill or blue-green)."""

    model_config = ConfigDict(title="Rollout state")
    schema_version: Literal[2]
    rollout_id: str = Field(pattern=r"^[0-9a-f]{12}$")
    status: Status
    mode: Literal["staged", "blue_green"]
    created_at: str | None = None
    updated_at: str | None = None
    new_version: str = Field(min_length=1, description="The registry version rolled out.")
    stage: int = Field(ge=0)
    fractions: list[Annotated[float, Field(gt=0, le=1)]] = Field(min_length=1)
    n_items: int = Field(ge=1)
    fraction_backfilled: float = Field(ge=0, le=1)
    batch_size: int = Field(ge=1)
    workers: int = Field(default=1, ge=1, description="processes a stage's slices are spread over")
    plan_seconds: float | None = Field(default=None, ge=0, description="reading the sample, placing the cuts")
    order: OrderRecord
    cursor: Cursor
    query_model: ModelRef = Field(description="The query model serving now.")
    previous_query_model: ModelRef
    new_query_model: ModelRef
    gallery: GalleryRecord
    ks: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    baseline: Metrics = Field(description="old/old on the probe set, before the rollout")
    floors: Metrics
    probe_tolerance: float | None = Field(default=None, ge=0)
    stages: list[StageRecord] = Field(min_length=1)
    curve: list[CurvePoint]
    restored: bool = Field(description="false while a halted stage still awaits its previous vectors")
    halt_reason: str | None
    rollback: dict[str, Any] | None = None
    pace: Pace | None = None

    def stage_record(self, j: int) -> StageRecord:
        """The record of stage ``j`` (a blue-green fill has stage 1 alone)."""
        return next(rec for rec in self.stages if rec.stage == j)

    @classmethod
    def read(
        cls, path: str | Path, damaged: Callable[[str], Exception], root: Path | None = None
    ) -> RolloutState | None:
        """The rollout state at ``path`` (an earlier version's brought to this one), or None when there is no
        file; the paths it names resolve against ``root`` (:data:`PATHS`). A file that cannot be read or
        parsed raises ``damaged(reason)``, one that does not match raises SchemaError naming each field."""
        from components.state.documents import validated

        document = read_json(path, damaged)
        if document is None:
            return None
        document = migrated(document)
        if root is not None:
            document = map_paths(document, PATHS, lambda value: resolved_path(root, value))
        return validated(cls, document, str(path))

    def write(self, path: Path, root: Path) -> None:
        """Save the state atomically, the paths it names relative to ``root``."""
        self.updated_at = utc_now()
        write_json_atomic(path, map_paths(self.document(), PATHS, lambda value: stored_path(root, value)))


UNDER_WAY = ("pending", "running", "halted")  # a rollout whose candidate may answer over a mixed gallery


def unpromoted(status: str | None, version: str | None, production: str | None) -> bool:
    """Whether a rollout of ``version`` at ``status`` is a change not yet promoted: under way (its run killed
    or failed mid-backfill), or completed for a version that is not ``production`` (its run killed after the
    backfill, before the promotion). `compatflow run` finishes such a change and `compatflow rollback` undoes
    it."""
    if status in UNDER_WAY:
        return True
    return status == "completed" and version is not None and str(version) != str(production)


def migrated(document: Any) -> Any:
    """``document`` brought to :data:`SCHEMA_VERSION` (version 1 named the statuses ``state``; an earlier
    release repeated ``new_version`` as ``model_version``); anything else is returned as it is, for
    validation to refuse."""
    if not isinstance(document, dict):
        return document
    document = {key: value for key, value in document.items() if key != "model_version"}
    if document.get("schema_version") != 1:
        return document
    document = _renamed({**document, "schema_version": SCHEMA_VERSION}, "state", "status")
    if isinstance(document.get("stages"), list):
        document["stages"] = [_renamed(stage, "state", "status") for stage in document["stages"]]
    if "rollback" in document:
        document["rollback"] = _renamed(document["rollback"], "from_state", "from_status")
    return document


def _renamed(record: Any, old: str, new: str) -> Any:
    """``record`` with its key ``old`` named ``new`` (in place in the order); anything else as it is."""
    if not isinstance(record, dict):
        return record
    return {new if key == old else key: value for key, value in record.items()}
