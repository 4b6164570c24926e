"""The ``evaluate`` step: the compatibility report of a candidate against the production model, validated
before it is written (``schemas/compat_report.schema.json``) for the release gate."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from components.state.run_dir import COMPAT_REPORT_FILE as REPORT_FILE

log = logging.getLogger(__name__)


def model_ref(path: str | Path) -> dict[str, Any]:
    """``{name, version, config, sha256, path}`` of a checkpoint or compatible-model directory."""
    from compat.models import read_sidecar
    from compat.production import backbone_path, identity, model_root

    root = model_root(path)
    backbone = backbone_path(root)  # a compatible model's config is its ``new`` part's
    config = read_sidecar(backbone)["config_name"] if backbone.is_dir() else ""
    ident = identity(root)
    return {
        "name": root.name,
        "version": ident["version"],
        "config": config,
        "sha256": ident["sha256"],
        "path": str(root.resolve()),
    }


def evaluate(
    old: str | Path,
    new: str | Path,
    eval_shards: str | Sequence[str],
    out_dir: str | Path,
    *,
    independent: str | Path | None = None,
    ks: Sequence[int] = (1, 5, 10),
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    device: str = "cpu",
    max_items: int | None = None,
    scenario: str | None = None,
    data_phase: int | None = None,
) -> dict[str, Any]:
    """Compute, validate and write ``out_dir/compat_report.json``; return the report. ``new`` is a
    compatible-model directory or a plain checkpoint (method ``none``); ``max_items`` keeps the first N."""
    from compat.compat_training import decode_size
    from compat.data.loader import expand_urls, load_captioned_set
    from compat.device import resolve_device
    from compat.evaluation import REPORT_SCHEMA, compat_report
    from compat.io import write_json_atomic
    from compat.methods.model import CompatModel
    from compat.methods.none import independent_model
    from compat.models import load_checkpoint
    from compat.production import identity, load_encoder, space_id_of
    from schemas import validate

    dev = resolve_device(device)
    urls = expand_urls(eval_shards)
    old_model = load_encoder(old, device=dev)
    candidate = load_encoder(new, device=dev)
    if not isinstance(candidate, CompatModel):
        from compat.methods.config import MethodConfig

        config = MethodConfig(version=identity(new)["version"], old_space_id=space_id_of(old, old_model))
        candidate = independent_model(candidate, int(old_model.embed_dim), config)
    ind = load_checkpoint(Path(independent), device=dev) if independent is not None else None
    # images decoded no larger than the largest model input (a big picture never decoded whole)
    data = load_captioned_set(urls, image_size=decode_size(old_model, candidate, *([ind] if ind else [])))
    if max_items is not None:
        data.keys, data.images = data.keys[:max_items], data.images[:max_items]
        data.captions, data.metas = data.captions[:max_items], data.metas[:max_items]
    log.info("evaluate: %d images from %d shard(s)", len(data), len(urls))
    meta: dict[str, Any] = {"old_model": model_ref(old), "new_model": model_ref(new)}
    if scenario is not None:
        meta["scenario"] = scenario
    if data_phase is not None:
        meta["data_phase"] = int(data_phase)
    report = compat_report(
        old_model,
        candidate,
        data,
        independent=ind,
        ks=ks,
        n_bootstrap=n_bootstrap,
        confidence=confidence,
        seed=seed,
        device=dev,
        meta=meta,
    )
    if independent is not None:
        report["independent_model"] = model_ref(independent)
    out_path = Path(out_dir) / REPORT_FILE
    validate(report, REPORT_SCHEMA, source=str(out_path))
    write_json_atomic(out_path, report)
    log.info("evaluate: wrote %s (ECC %s)", out_path, "passed" if report["ecc_passed"] else "failed")
    return report
