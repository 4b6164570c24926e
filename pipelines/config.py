"""Pipeline configuration: YAML files under ``pipelines/configs/``, checked whole when loaded (against
``schemas/pipeline_config.schema.json``, then by the rules of the code that uses each field). ``local``
and ``cluster`` share every key and differ only in values."""

from __future__ import annotations

from collections.abc import Mapping
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


def load_config(name_or_path: str | Path, *, local_paths: bool = True) -> dict[str, Any]:
    """Read a pipeline config and check all of it, before any step runs; returns the parsed mapping.

    First the schema; then, on a config that matches it, the rules each step applies when it starts,
    asked of the code that owns them (:func:`_problems`), so that a mistake costs seconds, not a run.
    Raises :class:`ConfigError` with every problem found, one line each naming the file and the field.
    ``local_paths`` False leaves out the files the config names (``gate.policy``): for a config compiled
    for a cluster, whose tasks read those paths in their own containers.
    """
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
    problems = _problems(document, local_paths=local_paths)
    if problems:
        raise ConfigError("\n".join(f"{path}: {problem}" for problem in problems))
    return document


def _problems(document: dict[str, Any], *, local_paths: bool) -> list[str]:
    """What a schema-valid config gets wrong, as ``field: why`` sentences, in the config's order."""
    problems = _training_problems(document["training"])
    problems += _model_problems(document, local_paths=local_paths)
    problems += _compat_problems(document["compat"])
    if local_paths:
        problems += _gate_problems(document["gate"])
    problems += _rollout_problems(document["rollout"])
    problems += gpu_errors(document["resources"]["gpu"])
    return problems


def _training_problems(training: dict[str, Any]) -> list[str]:
    if training["replay_buffer_size"] > 0 and not 1 <= training["replay_rows"] <= training["batch_size"] - 2:
        return [
            f"training.replay_rows is {training['replay_rows']}; with a replay buffer it must be in "
            f"[1, training.batch_size - 2] = [1, {training['batch_size'] - 2}] (or set replay_buffer_size: 0)"
        ]
    return []


def _model_problems(document: dict[str, Any], *, local_paths: bool = True) -> list[str]:
    """Model config names and their settings, as the model factory resolves them; the pretrained start
    weights (when ``local_paths``: they must be on this machine)."""
    from compat.models.factory import config_path, read_config, resize_mode_of
    from compat.models.pretrained import PretrainedError, resolve_pretrained

    problems = []
    for field, name in (
        ("training.model_config", document["training"]["model_config"]),
        ("compat.foundation_config", document["compat"]["foundation_config"]),
    ):
        try:
            config_path(name)
            resize_mode_of(read_config(name), str(config_path(name)))
        except KeyError as err:
            problems.append(f"{field}: {err.args[0]}")
        except ValueError as err:
            problems.append(f"{field}: {err}")
    if local_paths and not problems:
        name = document["training"]["model_config"]
        model_config = read_config(name)
        pretrained = document["training"].get("pretrained") or model_config.get("pretrained")
        where = "training.pretrained" if document["training"].get("pretrained") else f"{config_path(name)}"
        try:
            if pretrained:
                resolve_pretrained(pretrained, arch=model_config.get("open_clip_model"), where=where)
        except PretrainedError as err:
            problems.append(str(err))
    return problems


def _compat_problems(compat: dict[str, Any]) -> list[str]:
    """The method's options, by the method's own config class (imports torch, so only when there are any)."""
    reserved = sorted({"steps", "device", "version", "old_space_id"} & set(compat["options"]))
    if reserved:
        return [
            f"compat.options may not set {reserved}: steps is compat.steps, device is training.device, "
            "and the pipeline sets version and old_space_id"
        ]
    if not compat["options"]:
        return []
    from compat.methods import get_method
    from compat.methods.contract import CompatError

    try:
        get_method(compat["method"]).make_config(compat["options"], source="compat.options")
    except CompatError as err:
        return [str(err)]
    return []


def _gate_problems(gate: dict[str, Any]) -> list[str]:
    """The gate policy, read and checked by the gate's own loader (null: the shipped policy)."""
    from components.gate import PolicyError, load_policy

    try:
        load_policy(gate["policy"])
    except PolicyError as err:
        return [f"gate.policy: {err}"]
    return []


def _rollout_problems(rollout: dict[str, Any]) -> list[str]:
    """Each rollout setting by the rule :class:`components.rollout.RolloutConfig` applies at rollout time.

    One setting at a time (the others left at their defaults), so that every mistake is reported, each
    under its own field.
    """
    from components.rollout import RolloutConfig

    problems = []
    for field, argument in (("fractions", "fractions"), ("order", "policy"), ("batch_size", "batch_size")):
        try:
            RolloutConfig(new_version="config-check", **{argument: rollout[field]})
        except (TypeError, ValueError) as err:
            message = str(err)
            problems.append(
                f"rollout.{message}" if message.startswith(f"{field} ") else f"rollout.{field}: {message}"
            )
    return problems


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """The config with every default made explicit: absolute workspace, service URIs, policy path.

    KFP parameters cannot carry nulls, and an explicit config is what a run records, so the
    pipeline always receives the resolved form.
    """
    import copy

    resolved = copy.deepcopy(config)
    workspace = Path(resolved["workspace"]).expanduser()
    if "://" not in str(workspace):
        from components.workspace import WorkspaceError, check_root

        try:
            workspace = check_root(workspace)
        except WorkspaceError as err:
            raise ConfigError(f"config field 'workspace': {err}") from err
    resolved["workspace"] = str(workspace)
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


TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def gpu_errors(gpu: Mapping[str, Any]) -> list[str]:
    """What Kubernetes would refuse, or silently ignore, in a schema-valid ``resources.gpu`` section.

    One sentence per mistake, naming the field; empty when the section is usable (:func:`load_config` runs it
    on every config it reads; :mod:`pipelines.resources` again before compiling).
    """
    errors = []
    accelerator, count = gpu["accelerator"] or "", gpu["accelerator_count"]
    if accelerator and count < 1:
        errors.append(
            "resources.gpu.accelerator_count must be at least 1 when resources.gpu.accelerator is set"
        )
    if count > 0 and not accelerator:
        errors.append(
            f"resources.gpu.accelerator_count is {count} but resources.gpu.accelerator is not set: the GPU "
            "tasks would request no GPU (set the accelerator's resource name, e.g. nvidia.com/gpu, or "
            "accelerator_count: 0)"
        )
    for i, toleration in enumerate(gpu["tolerations"]):
        where = f"resources.gpu.tolerations[{i}]"
        unknown = set(toleration) - TOLERATION_FIELDS
        if unknown:
            errors.append(
                f"{where} has unknown fields {sorted(unknown)} (allowed: {sorted(TOLERATION_FIELDS)})"
            )
        key, operator, value = toleration.get("key"), toleration.get("operator"), toleration.get("value")
        effect, seconds = toleration.get("effect"), toleration.get("tolerationSeconds")
        for name, given in (("key", key), ("value", value)):
            if given is not None and not isinstance(given, str):
                errors.append(f"{where}.{name} must be a string, got {given!r} (quote it in YAML)")
        if operator not in (None, "Equal", "Exists"):
            errors.append(f"{where}.operator is {operator!r}: use Equal or Exists")
        if effect not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            errors.append(f"{where}.effect is {effect!r}: use NoSchedule, PreferNoSchedule or NoExecute")
        if operator == "Exists" and value not in (None, ""):
            errors.append(f"{where}.value must be empty when operator is Exists, got {value!r}")
        if not key and operator != "Exists":
            errors.append(f"{where}.key is empty: an empty key (every taint) needs operator: Exists")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)):
            errors.append(f"{where}.tolerationSeconds must be an integer, got {seconds!r}")
        elif seconds is not None and effect != "NoExecute":
            errors.append(f"{where}.tolerationSeconds is set, so effect must be NoExecute (got {effect!r})")
    return errors
