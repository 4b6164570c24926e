"""What every step function shares: the ``step`` decorator (lock, failure record), the config and its
workspace and registry, and the files a step copies into its run directory."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

Config = dict[str, Any] | str


F = TypeVar("F", bound=Callable[..., Any])


def step(name: str) -> Callable[[F], F]:
    """Name a step function ``f(config, run_dir, ...)``: it runs under the workspace's shared step lock
    (:func:`components.lock.step_lock`); when it raises, ``<run_dir>/failure.json`` records the step, the
    exception and what to do next (:func:`components.runs.record_failure`), for the report, ``outcome.json``
    and the CLI."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(config: Config, run_dir: Path | None = None, *args: Any, **kwargs: Any) -> Any:
            from components.lock import step_lock

            try:
                with step_lock(as_config(config)["workspace"]):
                    return fn(config, run_dir, *args, **kwargs)
            except Exception as error:
                from components.runs import record_failure

                if run_dir is not None:
                    record_failure(Path(run_dir), name, error)
                raise

        return run  # type: ignore[return-value]

    return decorate


def as_config(config: Config) -> dict[str, Any]:
    """The resolved config, from a mapping or the JSON string the KFP components receive."""
    return json.loads(config) if isinstance(config, str) else config


def workspace_of(config: dict[str, Any]) -> Any:
    from components.workspace import Workspace

    return Workspace.from_config(config)


def registry_of(config: dict[str, Any]) -> Any:
    from components.registry import Registry

    return Registry(workspace_of(config), model_name=config["registry"]["model_name"])


def read_json_or_none(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def checkpoint_dir_of(path: str) -> str:
    """A checkpoint directory from a directory or its ``model.json``."""
    candidate = Path(path)
    return str(candidate.parent if candidate.name == "model.json" else candidate)


def model_dir_in(path: str) -> str:
    """The model directory inside a stage's model artifact (``<artifact>/model`` or the artifact itself)."""
    nested = Path(path) / "model"
    return str(nested if nested.is_dir() else checkpoint_dir_of(path))


def copy_summaries(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).is_file() and (src / name).resolve() != (dst / name).resolve():
            shutil.copyfile(src / name, dst / name)
