"""Compile the pipeline to KFP IR YAML (what a cluster runs, committed under ``pipelines/compiled/``).

The config compiled for and its run parameters become the pipeline's parameter defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from kfp.dsl.graph_component import GraphComponent

    from components.deployment import Deployment

COMPILED_DIR = Path(__file__).resolve().parent / "compiled"
COMPILED_NAME = "continual_upgrade.yaml"

ConfigRef = Mapping[str, Any] | str | os.PathLike[str] | None


def build_pipeline(settings: dict[str, Any]) -> GraphComponent:
    """The continual-upgrade pipeline built under task ``settings`` (:mod:`pipelines.resources`)."""
    from kfp import dsl

    from pipelines import resources
    from pipelines.continual_upgrade import PIPELINE_DESCRIPTION, PIPELINE_NAME, continual_upgrade_steps

    with resources.using(settings):
        return dsl.pipeline(continual_upgrade_steps, name=PIPELINE_NAME, description=PIPELINE_DESCRIPTION)


def default_run_config(deployment: Deployment) -> str:
    """The resolved config as JSON, a null gate policy kept (the task reads the one shipped in its image)."""
    resolved = deployment.resolved()
    if deployment.gate.policy is None:
        resolved = resolved.model_copy(update={"gate": deployment.gate})
    return resolved.to_json()


def pinned(config: ConfigRef, digests: Mapping[str, str]) -> Deployment:
    """``config``'s deployment, each image kind in ``digests`` pinned: ``NAME:TAG@sha256:...``."""
    import re

    from pipelines import resources
    from pipelines.config import ConfigError

    deployment = resources.compile_settings(config)["config"]
    images = {}
    for kind, digest in digests.items():
        if kind not in ("cpu", "gpu") or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ConfigError(f"--digest {kind}={digest}: give cpu=sha256:<64 hex> and gpu=sha256:<64 hex>")
        section = getattr(deployment.resources, kind)
        images[kind] = section.model_copy(update={"image": f"{section.image.partition('@')[0]}@{digest}"})
    return deployment.model_copy(update={"resources": deployment.resources.model_copy(update=images)})


def compile_pipeline(
    out_dir: Path = COMPILED_DIR, config: ConfigRef = None, digests: Mapping[str, str] | None = None
) -> Path:
    """Write ``continual_upgrade.yaml`` for ``config`` into ``out_dir``, its images pinned to ``digests``."""
    from kfp import compiler

    from components.runs import run_parameters
    from pipelines import resources

    settings = resources.compile_settings(pinned(config, digests) if digests else config)
    pipeline = build_pipeline(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / COMPILED_NAME
    compiler.Compiler().compile(
        pipeline_func=pipeline,
        package_path=str(path),
        pipeline_parameters={
            "config": default_run_config(settings["config"]),
            **run_parameters(settings["config"]),
        },
    )
    return path
