"""What every step function shares: the ``step`` decorator (the typed deployment, lock, failure record), the
registry of a deployment, and the files a step copies into its run directory."""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from components.deployment import Deployment

# What a step accepts as its config: the deployment, its mapping, or the JSON string a KFP op receives.
Config = Deployment | Mapping[str, Any] | str


F = TypeVar("F", bound=Callable[..., Any])


def step(name: str) -> Callable[[F], F]:
    """Name a step function ``f(deployment, run_dir, ...)``: it receives the typed deployment (from whatever
    form the caller has, :meth:`Deployment.coerce`) and runs under the workspace's shared step lock
    (:func:`components.state.lock.step_lock`). What it cost is kept in ``<run_dir>/usage/step-<name>.json``
    (:func:`components.steps.usage.measured`, :func:`components.runs.record_usage`). When it raises,
    ``<run_dir>/failure.json`` records the step, the exception and what to do next
    (:func:`components.runs.record_failure`), for the report, ``outcome.json`` and the CLI."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(config: Config, run_dir: Path | None = None, *args: Any, **kwargs: Any) -> Any:
            from components.runs import record_usage
            from components.state.lock import step_lock
            from components.state.workspace import Workspace
            from components.steps.usage import measured

            usage: dict[str, Any] = {"outcome": "ok"}
            try:
                deployment = Deployment.coerce(config)
                with step_lock(Workspace.of(deployment)), measured(usage):
                    return fn(deployment, run_dir, *args, **kwargs)
            except Exception as error:
                from components.runs import record_failure

                usage["outcome"] = type(error).__name__
                if run_dir is not None:
                    record_failure(Path(run_dir), name, error)
                raise
            finally:
                if run_dir is not None and "wall_s" in usage:
                    record_usage(Path(run_dir), name, usage)  # best effort: never the step's outcome

        return run  # type: ignore[return-value]

    return decorate


def registry_of(config: Config) -> Any:
    """The deployment's model registry (:class:`components.adapters.registry.Registry`)."""
    from components.adapters.registry import Registry
    from components.state.workspace import Workspace

    deployment = Deployment.coerce(config)
    return Registry(Workspace.of(deployment), model_name=deployment.registry.model_name)


def run_params(deployment: Deployment) -> dict[str, Any]:
    """The settings a phase's MLflow run records as parameters (``training.lr``, ``compat.options.<key>``,
    ...): what trained the candidate and how it was made compatible. The same for every step of a run, so
    each step may log them (MLflow refuses only a changed value)."""
    unrecorded = {"weights_dir", "resize_mode", "checkpoint_every", "device", "loader_workers"}  # how it ran
    training = deployment.training.model_dump(by_alias=True, exclude=unrecorded)
    return {
        "training": {key: "" if value is None else value for key, value in training.items()},
        "compat": deployment.compat.model_dump(exclude={"replay_shards_per_phase"}),
    }


@contextlib.contextmanager
def live_metrics(deployment: Deployment, run_dir: Path, prefix: str) -> Iterator[Any]:
    """A step-record logger into the run's MLflow run (``<prefix><name>`` at step n, see
    :meth:`components.adapters.registry.Tracking.step_logger`), flushed when the block ends, raising or
    not."""
    registry = registry_of(deployment)
    live = registry.step_logger(registry.start_run(Path(run_dir).name, params=run_params(deployment)), prefix)
    try:
        yield live
    finally:
        live.flush()


def checkpoint_dir_of(path: str) -> str:
    """A checkpoint directory from a directory or its ``model.json``."""
    candidate = Path(path)
    return str(candidate.parent if candidate.name == "model.json" else candidate)


def model_dir_in(path: str) -> str:
    """The model directory inside a step's model artifact (``<artifact>/model`` or the artifact itself)."""
    nested = Path(path) / "model"
    return str(nested if nested.is_dir() else checkpoint_dir_of(path))


def copy_summaries(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).is_file() and (src / name).resolve() != (dst / name).resolve():
            shutil.copyfile(src / name, dst / name)


def log_metrics(metrics: Any, values: Mapping[str, float]) -> None:
    """Log ``values`` on a KFP ``Metrics`` output and write them to its file as JSON too: kfp.local's cache
    takes an output artifact without a file for a lost one, so a task with metrics would never be a cache hit
    (a resubmitted or resumed run would train again). On a cluster the file is the artifact's content."""
    import json

    for key, value in values.items():
        metrics.log_metric(key, float(value))
    path = Path(metrics.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: float(value) for key, value in values.items()}, indent=1) + "\n")
