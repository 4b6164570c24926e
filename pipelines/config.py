"""Pipeline configuration: YAML files under ``pipelines/configs/`` checked against
``schemas/pipeline_config.schema.json``. ``local`` and ``cluster`` share every key and differ only in
values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """The configuration file is unreadable or breaks its schema; the message names the file and fields."""


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config (``local``, ``cluster``)."""
    candidate = Path(name_or_path)
    if candidate.is_file():
        return candidate
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a shipped config ({known})")


def load_config(name_or_path: str | Path) -> dict[str, Any]:
    """Read and validate a pipeline config; returns the parsed mapping."""
    import yaml

    import schemas

    path = resolve_config_path(name_or_path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the config: {err}") from err
    errors = schemas.schema_errors(document, "pipeline_config")
    if errors:
        raise ConfigError(
            f"{path} does not match schemas/pipeline_config.schema.json:\n  " + "\n  ".join(errors)
        )
    training = document["training"]
    if training["replay_buffer_size"] > 0 and not 1 <= training["replay_rows"] <= training["batch_size"] - 2:
        raise ConfigError(
            f"{path}: training.replay_rows is {training['replay_rows']}; with a replay buffer it must be in "
            f"[1, training.batch_size - 2] = [1, {training['batch_size'] - 2}] (or set replay_buffer_size: 0)"
        )
    compat = document["compat"]
    reserved = sorted({"steps", "device", "version", "old_space_id"} & set(compat["options"]))
    if reserved:
        raise ConfigError(
            f"{path}: compat.options may not set {reserved}: steps is compat.steps, device is "
            "training.device, and the pipeline sets version and old_space_id"
        )
    if compat["options"]:
        from compat.methods import get_method
        from compat.methods.base import CompatError

        try:
            get_method(compat["method"]).make_config(compat["options"], source=f"{path}: compat.options")
        except CompatError as err:
            raise ConfigError(str(err)) from err
    return document


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """The config with every default made explicit: absolute workspace, service URIs, policy path.

    KFP parameters cannot carry nulls, and an explicit config is what a run records, so the
    pipeline always receives the resolved form.
    """
    import copy

    resolved = copy.deepcopy(config)
    workspace = Path(resolved["workspace"]).expanduser()
    resolved["workspace"] = str(workspace if "://" in str(workspace) else workspace.resolve())
    root = resolved["workspace"]
    defaults = {
        ("registry", "tracking_uri"): f"sqlite:///{root}/mlflow.db",
        ("lineage", "repo"): f"{root}/feast",
        ("index", "uri"): f"{root}/milvus/gallery.db",
        ("gate", "policy"): str(
            Path(__file__).resolve().parents[1] / "components" / "policies" / "gate_default.yaml"
        ),
    }
    for (section, key), value in defaults.items():
        if resolved[section][key] is None:
            resolved[section][key] = value
    if resolved["resources"]["gpu"]["accelerator"] is None:
        resolved["resources"]["gpu"]["accelerator"] = ""
    stream_uri = resolved["stream"]["uri"]
    if "://" not in stream_uri:
        resolved["stream"]["uri"] = str(Path(stream_uri).expanduser().resolve())
    return resolved
