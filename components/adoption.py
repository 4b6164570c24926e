"""Adoption: a team's Milvus collection and the model that made it become production version 1.

:func:`prove` re-embeds a seeded sample of the team's items and compares with their stored vectors before
anything is written; :func:`adopt` then copies every row's vector, unchanged, into a collection of
compatflow's schema with its lineage. The team's collection is only read.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compat.data.images import read_image_file
from compat.io import atomic_write, own_folder, utc_now, write_json_atomic
from components.serving.record import DEFAULT_FACTORY, read_serving, write_serving

log = logging.getLogger(__name__)

QUERY_WINDOW = 16_384  # Milvus serves offset + limit up to this (maxQueryResultWindow): the sample's reach
FLOAT_VECTOR = 101  # pymilvus DataType.FLOAT_VECTOR
UNIT_TOLERANCE = 1e-3  # stored vectors this close to unit norm rank the same under IP, L2 and COSINE
ADOPT_STEP = "adopt"
SUMMARY_FILE = "adoption.json"
MLFLOW_SCHEMES = ("models:/", "runs:/")  # --weights read from an MLflow registry or run
REPORT_FILE = "adoption.md"  # the on-call note


class AdoptionRefused(RuntimeError):
    """The collection or the model cannot be adopted; the message names the field and what to do. Nothing
    was written."""


@dataclass(frozen=True)
class Source:
    """The team's collection and where its fields are (their names, not compatflow's)."""

    uri: str
    collection: str
    id_field: str
    vector_field: str
    image_field: str | None = None
    image_template: str | None = None  # e.g. "/data/{id}.jpg", when no field holds the image's path
    caption_field: str | None = None

    def __post_init__(self) -> None:
        if not self.image_field and not self.image_template:
            raise AdoptionRefused(
                "give --image-field (a field holding each image's path) or --image-template"
            )
        if self.image_template and "{id}" not in self.image_template:
            raise AdoptionRefused(
                f"--image-template {self.image_template!r} must name the item's id as {{id}}"
            )

    def image_uri(self, row: dict[str, Any]) -> str:
        if self.image_field:
            return str(row.get(self.image_field) or "")
        return str(self.image_template).format(id=row[self.id_field])

    @property
    def fields(self) -> list[str]:
        named = [self.id_field, self.vector_field, self.image_field, self.caption_field]
        return [f for f in dict.fromkeys(named) if f]


@dataclass
class Proof:
    """What the sample showed: per-item cosines (stored vs re-embedded) and the unreadable images."""

    threshold: float
    max_unreadable: float
    n_sample: int
    n_unreadable: int
    cosine_min: float = float("nan")
    cosine_p5: float = float("nan")
    cosine_median: float = float("nan")
    reasons: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.reasons

    def summary(self) -> str:
        return (
            f"{self.n_sample} sampled items, {self.n_unreadable} unreadable images; cosine stored vs "
            f"re-embedded: min {self.cosine_min:.4f}, p5 {self.cosine_p5:.4f}, median "
            f"{self.cosine_median:.4f} (threshold {self.threshold})"
        )


# -- the team's collection, read only -----------------------------------------------------------------------
def check_source(client: Any, source: Source, embed_dim: int) -> dict[str, Any]:
    """The collection's shape, refused before any read: it must exist and be loaded, hold the named fields
    and a float vector of the model's dimension under a metric compatflow's cosine ranks the same. Returns
    ``{"dim", "metric", "count"}``."""
    name = source.collection
    if not client.has_collection(name):
        raise AdoptionRefused(f"--collection {name!r} does not exist at {source.uri}")
    state = str(client.get_load_state(name).get("state", ""))
    if not state.endswith("Loaded"):
        raise AdoptionRefused(
            f"--collection {name!r} is not loaded ({state}): load it as it is served (compatflow does not "
            "load or change the team's collection)"
        )
    fields = {str(f["name"]): f for f in client.describe_collection(name)["fields"]}
    for attribute in ("id_field", "vector_field", "image_field", "caption_field"):
        value, option = getattr(source, attribute), "--" + attribute.replace("_", "-")
        if value and value not in fields:
            raise AdoptionRefused(f"{option} {value!r} is not a field of {name!r} (it has {sorted(fields)})")
    vector = fields[source.vector_field]
    if int(vector["type"]) != FLOAT_VECTOR:
        raise AdoptionRefused(f"--vector-field {source.vector_field!r} is not a FLOAT_VECTOR field")
    dim = int(vector["params"]["dim"])
    if dim != int(embed_dim):
        raise AdoptionRefused(
            f"--vector-field {source.vector_field!r} holds {dim}-d vectors but the model embeds "
            f"{embed_dim}-d: this model cannot have made them (check --arch and --weights)"
        )
    metric = ""
    for index_name in client.list_indexes(name, field_name=source.vector_field):
        metric = str(client.describe_index(name, index_name).get("metric_type", ""))
    return {"dim": dim, "metric": metric or "COSINE", "count": _count(client, name)}


def _count(client: Any, collection: str) -> int:
    return int(client.query(collection, filter="", output_fields=["count(*)"])[0]["count(*)"])


def scratch(workspace: Any) -> Path:
    """The workspace's ``tmp`` folder, made without following a link (:func:`compat.io.own_folder`)."""
    workspace.root.mkdir(parents=True, exist_ok=True)
    os.close(own_folder(workspace.root, workspace.tmp_dir.name))
    return workspace.tmp_dir


def local_weights(weights: str, tracking_uri: str | None, into: Path) -> str:
    """``weights`` itself, or for an MLflow ``models:/`` or ``runs:/`` URI the one weights file (a state dict
    as open_clip or torch saves it, or safetensors) among its artifacts, downloaded into ``into``."""
    from compat.models.pretrained import WEIGHT_SUFFIXES

    if not weights.startswith(MLFLOW_SCHEMES):
        return weights
    import mlflow.artifacts
    from mlflow import MlflowClient

    try:
        uri = weights
        # a models:/ URI resolved here: MLflow's own resolution reads its default registry
        if weights.startswith("models:/"):
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            name, at, alias = weights[len("models:/") :].partition("@")
            if at:
                version = str(client.get_model_version_by_alias(name, alias).version)
            else:
                name, _, version = name.rpartition("/")
            uri = client.get_model_version_download_uri(name, version)
        folder = mlflow.artifacts.download_artifacts(
            artifact_uri=uri, dst_path=str(into), tracking_uri=tracking_uri
        )
    except Exception as err:  # noqa: BLE001 - MLflow raises many kinds; the refusal names the URI and why
        raise AdoptionRefused(f"--weights {weights!r}: cannot download it from MLflow ({err})") from err
    found = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix.lower() in WEIGHT_SUFFIXES)
    if len(found) != 1:
        names = ", ".join(str(p.relative_to(folder)) for p in found) or "none"
        raise AdoptionRefused(
            f"--weights {weights!r}: its artifacts must hold one weights file ({'/'.join(WEIGHT_SUFFIXES)}), "
            f"found {names}: name the file's own artifact URI"
        )
    return str(found[0])


def read_sample(client: Any, source: Source, size: int, count: int, seed: int) -> list[dict[str, Any]]:
    """About ``size`` rows at seeded offsets (8 windows), within the first :data:`QUERY_WINDOW` positions: a
    bounded read whatever the collection's size."""
    reach = min(count, QUERY_WINDOW)
    if reach == 0:
        return []
    if reach <= size:  # a collection no larger than the sample is read whole
        starts, per = [0], reach
    else:
        per = -(-size // 8)
        starts = sorted({int(s) for s in np.random.default_rng(seed).integers(0, reach - per + 1, size=8)})
    rows: dict[Any, dict[str, Any]] = {}
    for start in starts:
        for row in client.query(
            source.collection, filter="", output_fields=source.fields, offset=start, limit=per
        ):
            rows[row[source.id_field]] = dict(row)
    return list(rows.values())[:size]


def unit(vectors: np.ndarray) -> np.ndarray:
    v = np.asarray(vectors, dtype=np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def prove(
    bundle: Any,
    rows: list[dict[str, Any]],
    source: Source,
    metric: str,
    *,
    threshold: float = 0.99,
    max_unreadable: float = 0.05,
) -> Proof:
    """Re-embed the sample's images with ``bundle`` and compare with their stored vectors (cosine after L2
    normalisation). Fails when the median or p5 is below ``threshold``, more than ``max_unreadable`` of the
    images cannot be read, or the metric ranks otherwise than cosine (IP or L2 on vectors off unit norm)."""
    proof = Proof(threshold, max_unreadable, len(rows), 0)
    if not rows:
        proof.reasons.append(f"--collection {source.collection!r} holds no rows to prove the model on")
        return proof
    stored = np.asarray([row[source.vector_field] for row in rows], dtype=np.float32)
    norms = np.linalg.norm(stored, axis=1)
    if metric.upper() != "COSINE" and np.abs(norms - 1).max() > UNIT_TOLERANCE:
        proof.reasons.append(
            f"the collection is searched with {metric} on vectors not of unit norm (norms {norms.min():.3f}"
            f"..{norms.max():.3f}): compatflow searches by cosine, which would rank them otherwise"
        )
    images, kept = [], []
    for j, row in enumerate(rows):
        try:
            images.append(read_image_file(source.image_uri(row), bundle.image_size))
            kept.append(j)
        except Exception as err:  # noqa: BLE001 - counted against the stated fraction, each named in the log
            log.warning("image of %s unreadable: %s", row[source.id_field], err)
    proof.n_unreadable = len(rows) - len(kept)
    if proof.n_unreadable > max_unreadable * len(rows):
        proof.reasons.append(
            f"{proof.n_unreadable} of {len(rows)} sampled images cannot be read (more than "
            f"{max_unreadable:.0%}): check --image-field/--image-template and that this machine reads them"
        )
    if kept:
        fresh = bundle.encode_images(images).numpy()
        cosines = np.sum(unit(stored[kept]) * unit(fresh), axis=1)
        proof.cosine_min = float(cosines.min())
        proof.cosine_p5 = float(np.percentile(cosines, 5))
        proof.cosine_median = float(np.median(cosines))
        if proof.cosine_median < threshold or proof.cosine_p5 < threshold:
            proof.reasons.append(
                f"the model does not reproduce the stored vectors: median cosine {proof.cosine_median:.4f}, "
                f"p5 {proof.cosine_p5:.4f}, below {threshold}: check --arch and --weights (and the images)"
            )
    return proof


# -- the adoption -------------------------------------------------------------------------------------------
def _refuse_workspace_taken(workspace: Any, registry: Any) -> None:
    """Ownership, before the proof: the workspace serves nothing yet and its registry holds no version of the
    model (the adopted one is version 1)."""
    if read_serving(workspace.serving_path) is not None:
        raise AdoptionRefused(
            f"workspace {workspace.root} already serves a gallery ({workspace.serving_path}): adopt into a "
            "new workspace"
        )
    name = registry.model_name
    if registry.exists() and registry.client.search_model_versions(f"name='{name}'", max_results=1):
        raise AdoptionRefused(
            f"the registry {registry.tracking_uri} already holds versions of {name}: adopt into a new "
            "workspace or another registry.model_name"
        )


def adopt(
    workspace: Any,
    source: Source,
    *,
    arch: str,
    weights: str,
    model_name: str,
    sample_size: int = 256,
    seed: int = 0,
    threshold: float = 0.99,
    max_unreadable: float = 0.05,
    page_size: int = 1000,
    tracking_uri: str | None = None,
    on_proof: Any = None,
) -> dict[str, Any]:
    """Prove, then adopt; returns the summary also written to the run folder, or raises
    :class:`AdoptionRefused` with nothing written. The alias and serving record move only after the copy and
    the registration, so a failure before then serves nothing half made."""
    from components.adapters.index import GalleryIndex
    from components.adapters.registry import Registry
    from components.rollout.operations import deployment_owner
    from components.rollout.types import RolloutPaths
    from components.runs import record_phase

    bundle = _built_model(workspace, arch, weights, tracking_uri)
    started = time.monotonic()
    run_id = f"adopt-{time.strftime('%Y%m%d-%H%M%S')}"
    version = "1"
    registry = Registry(workspace, model_name=model_name)
    paths = RolloutPaths.for_workspace(workspace)
    _refuse_workspace_taken(workspace, registry)
    with GalleryIndex(source.uri) as source_index:
        client = source_index.client
        shape = check_source(client, source, bundle.embed_dim)
        sample = read_sample(client, source, sample_size, shape["count"], seed)
        proof = prove(
            bundle, sample, source, shape["metric"], threshold=threshold, max_unreadable=max_unreadable
        )
        if on_proof is not None:
            on_proof(proof)
        if not proof.passed:
            raise AdoptionRefused("; ".join(proof.reasons) + "; nothing was written")
        proof_s = time.monotonic() - started
        owner = deployment_owner(workspace, legacy=False)  # the copy is marked as this deployment's
        with GalleryIndex(workspace.index_uri, alias=workspace.index_alias, owner=owner) as target:
            if (taken := target.serving_collection()) is not None:  # ownership, before the first write
                raise AdoptionRefused(
                    f"alias {target.alias!r} at {target.uri} already points at {taken!r}, which this "
                    "workspace does not serve: give the workspace another index.alias"
                )
            copy_started = time.monotonic()
            collection, copied = copy_rows(
                client, source, target, workspace, version, sample, page_size, seed
            )
            copy_s = time.monotonic() - copy_started
            registered = _register(registry, bundle, workspace, run_id, arch, weights, source, proof)
            if registered["version"] != version:
                raise RuntimeError(f"the registry numbered the adopted model {registered['version']}, not 1")
            model_dir = registry.local_copy(version)
            target.switch_alias(collection)  # the adopted model answers queries from now on
            record = write_serving(
                paths.serving,
                uri=target.uri,
                alias=target.alias,
                collection=collection,
                space=version,  # a plain checkpoint's space is its version (compat.production.space_id_of)
                dim=shape["dim"],
                query_model={"version": version, "uri": str(model_dir), "factory": DEFAULT_FACTORY},
            )
    if source.caption_field:
        _write_probe(paths.probe, source, sample)
    registry.promote(version, rollout=None)  # the first production model: the served index is its own
    registry.end_run(registered["mlflow_run_id"])
    record_phase(workspace, 0, "succeeded", run_id)
    summary = {
        "run_id": run_id,
        "adopted_at": utc_now(),
        "source": asdict(source),
        "model": {"arch": arch, "weights": weights, "version": version, "dir": str(model_dir)},
        "proof": {**asdict(proof), "passed": True},
        "collection": collection,
        "alias": record.alias,
        "n_items": copied,
        "seconds": {"proof": proof_s, "copy": copy_s},
        "seconds_per_item": {"proof": proof_s / max(1, len(sample)), "copy": copy_s / max(1, copied)},
        "untouched": f"{source.uri}#{source.collection} (read only)",
    }
    folder = workspace.run_dir(run_id) / ADOPT_STEP
    write_json_atomic(folder / SUMMARY_FILE, summary)
    atomic_write(folder / REPORT_FILE, lambda tmp: tmp.write_text(on_call_note(summary, proof)))
    return summary


def _built_model(workspace: Any, arch: str, weights: str, tracking_uri: str | None) -> Any:
    """The team's model, ``arch`` with ``weights`` (:func:`local_weights`), or a refusal."""
    from compat.models import build_model

    with tempfile.TemporaryDirectory(dir=scratch(workspace)) as tmp:
        try:
            return build_model(arch, pretrained=local_weights(weights, tracking_uri, Path(tmp)))
        except (KeyError, ValueError, OSError) as err:
            raise AdoptionRefused(f"--arch {arch!r} / --weights {weights!r}: {err}") from err


def _write_probe(path: Path, source: Source, sample: list[dict[str, Any]]) -> None:
    """The rollout's probe set: the sample's captions, each finding its own item."""
    probe = [(str(r[source.id_field]), str(r.get(source.caption_field) or "")) for r in sample]
    write_json_atomic(path, {"texts": [c for _, c in probe if c], "positives": [[i] for i, c in probe if c]})


def on_call_note(summary: dict[str, Any], proof: Proof) -> str:
    """The adoption for whoever is on call: what serves now, what the proof saw, what was left alone and how
    to go back."""
    source, model = summary["source"], summary["model"]
    team = f"{source['uri']}#{source['collection']}"
    seconds, per_item = summary["seconds"], summary["seconds_per_item"]
    lines = [
        f"# Adoption {summary['run_id']} ({summary['adopted_at']})",
        "",
        f"- Serving: alias `{summary['alias']}` -> `{summary['collection']}`, {summary['n_items']:,} "
        f"items, all of model version {model['version']} (production), copied from `{team}` without "
        "re-embedding.",
        f"- Model: `{model['arch']}` weights `{model['weights']}`, registered as version "
        f"{model['version']} (`{model['dir']}`).",
        f"- Proof: {proof.summary()}.",
        f"- Cost: proof {seconds['proof']:.1f} s, copy with lineage {seconds['copy']:.1f} s "
        f"({1e3 * per_item['copy']:.2f} ms per item).",
        f"- Untouched: `{team}` (read only: no row, field, index or alias of it changed).",
        f"- To go back: point the team's service at `{team}` again; it depends on nothing here.",
    ]
    return "\n".join(lines) + "\n"


def copy_rows(
    client: Any,
    source: Source,
    target: Any,
    workspace: Any,
    version: str,
    sample: list[dict[str, Any]],
    page_size: int,
    seed: int,
) -> tuple[str, int]:
    """Every row's vector (L2-normalised, never re-embedded) into a new collection of compatflow's schema,
    a page at a time, each page's lineage written before its rows; the centres (the rows' order keys) fitted
    on the proof's sample. Returns the collection and the rows copied, checked against the source's count."""
    from compat.backfill import fit_centres
    from components.adapters.index import make_rows, query_batches
    from components.adapters.lineage import LineageStore
    from components.rollout.keys import save_centres
    from components.rollout.types import RolloutPaths

    sample_vectors = unit(np.asarray([r[source.vector_field] for r in sample]))
    collection = target.create_collection(version, int(sample_vectors.shape[1]))
    centres = fit_centres(sample_vectors, seed=seed)
    save_centres(RolloutPaths.for_workspace(workspace).centres(collection), centres)
    lineage = LineageStore.of(workspace)
    lineage.apply()
    copied = 0
    try:
        for page in query_batches(client, source.collection, source.fields, page_size):
            ids = [str(r[source.id_field]) for r in page]
            uris = [source.image_uri(r) for r in page]
            captions = [str(r.get(source.caption_field) or "") if source.caption_field else "" for r in page]
            lineage.write_items(  # first: no copied row lacks its lineage
                {"item_id": i, "model_version": version, "space_id": version, "caption": c, "image_uri": u}
                for i, u, c in zip(ids, uris, captions, strict=True)
            )
            vectors = unit(np.asarray([r[source.vector_field] for r in page]))
            rows = make_rows(ids, vectors, version, version, source_uris=uris, centres=centres)
            copied += target.upsert(rows, collection, insert=True)
        target.flush(collection, wait_indexed=True)
        held = target.count(collection)
        want = _count(client, source.collection)
        if held != want or copied != want:
            raise RuntimeError(
                f"copied {copied} rows ({held} held) but {source.collection!r} holds {want}: it changed "
                "during the copy; adopt again once it is still (the copy is dropped)"
            )
    except BaseException:  # nothing serves the copy yet: dropped, and a run again starts a new one
        target.drop(collection)
        raise
    return collection, copied


def _register(
    registry: Any,
    bundle: Any,
    workspace: Any,
    run_id: str,
    arch: str,
    weights: str,
    source: Source,
    proof: Proof,
) -> dict[str, Any]:
    """The model saved as this project's checkpoint and registered (the adoption's record as its gate)."""
    from compat.models import save_checkpoint
    from components.gate.decision import GateDecision, Reason

    with tempfile.TemporaryDirectory(dir=scratch(workspace)) as tmp:
        save_checkpoint(bundle, Path(tmp) / "model", version="1", extra={"adopted_from": weights})
        mlflow_run = registry.start_run(run_id, params={"adopted": True, "arch": arch})
        gate = GateDecision(
            decision="pass",
            reasons=[Reason(code="adopted", message=f"adopted: {proof.summary()}")],
            checks=[],
            bootstrap=True,
            decided_at=utc_now(),
        )
        info = registry.register_candidate(
            mlflow_run,
            Path(tmp) / "model",
            data_phase=0,
            method="bootstrap",
            gate=gate,
            tags={
                "adopted_from": f"{source.uri}#{source.collection}",
                "adoption.cosine_median": proof.cosine_median,
            },
        )
    return {**info, "version": str(info["version"]), "mlflow_run_id": mlflow_run}
