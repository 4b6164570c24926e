"""The known-geometry upgrade the rollout tests run: its probe set, the old gallery indexed, the CLI
arguments, and the gallery check."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.synthetic_upgrade import MODULE as SYNTH_MODULE
from benchmarks.synthetic_upgrade import synthetic_upgrade
from components import rollout as ro
from components.adapters.index import GalleryIndex

N, Q, SEED = 400, 200, 3
OPTS = {"n_items": str(N), "n_queries": str(Q), "seed": str(SEED)}


SYNTH_QUERY = f"{SYNTH_MODULE}:synthetic_query_encoder"


UPGRADE = synthetic_upgrade(n_items=N, n_queries=Q, seed=SEED)


PROBE = ro.ProbeSet(UPGRADE.query_texts, [[UPGRADE.item_ids[p[0]]] for p in UPGRADE.positives])


def _index_old(paths: ro.RolloutPaths, index: GalleryIndex) -> None:
    UPGRADE.index_old_gallery(index, paths, OPTS, source_uris=[f"shard#{i}" for i in UPGRADE.item_ids])


def _assert_gallery(
    index: GalleryIndex, vectors: np.ndarray, version: str, collection: str | None = None
) -> None:
    """Every item has exactly one vector, of ``version``, equal to its row of ``vectors``."""
    assert index.count(collection) == N
    assert index.count_by_version(collection) == {version: N}
    got = _vectors(index, collection)
    assert len(got) == N
    assert np.allclose(np.stack([got[i] for i in UPGRADE.item_ids]), vectors, atol=1e-6)


def _run_args(ws: Path, *where: str) -> list[str]:
    """``rollout run`` of v2 with the known-geometry encoders on workspace ``ws`` (``where``: its flags)."""
    return [
        "rollout",
        "run",
        *where,
        "--new-version",
        "v2",
        "--encoders",
        f"{SYNTH_MODULE}:synthetic_encoders",
        "--query-factory",
        SYNTH_QUERY,
        "--probe",
        str(ws / "probe.json"),
        *[f"--option={k}={v}" for k, v in OPTS.items()],
    ]


def _vectors(index: GalleryIndex, collection: str | None = None) -> dict[str, np.ndarray]:
    rows = index.fetch(UPGRADE.item_ids, collection)
    return {r["item_id"]: np.asarray(r["vector"], dtype=np.float32) for r in rows}
