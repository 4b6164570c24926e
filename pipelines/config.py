"""Pipeline configuration: YAML files under ``pipelines/configs/``, parsed once into the typed
:class:`~components.deployment.Deployment` and checked whole when loaded."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.deployment import ConfigError, Deployment

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config (``local``, ``cluster``)."""
    for candidate in (Path(name_or_path), CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a shipped config ({known})")


def setting_option(setting: str) -> str:
    """The option of ``compatflow train continual`` that sets a training setting."""
    return "--config" if setting == "config_name" else "--" + setting.replace("_", "-")


def generate_stream_of(stream: Any, out: str | Path | None = None, **options: Any) -> dict[str, Any]:
    """Write (or complete) the synthetic stream a ``stream`` section describes into ``out`` (its ``uri``)."""
    from compat.data.synth import generate_stream

    settings = stream.model_dump(exclude={"uri", "generate_if_missing"})
    return generate_stream(out or stream.uri, **settings, **options)


def load_config(name_or_path: str | Path, *, local_paths: bool = True, training: bool = True) -> Deployment:
    """Read a pipeline config and check all of it, so that a mistake costs seconds, not a run; ConfigError
    names every problem's file and field. ``local_paths`` False: the files it names are not checked (a
    cluster's tasks read them); ``training`` False: nor what only training reads (its check imports torch).
    """
    import yaml

    path = resolve_config_path(name_or_path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the config: {err}") from err
    deployment = Deployment.parse(document, source=str(path))
    return check(deployment, source=str(path), local_paths=local_paths, training=training)


def check(
    deployment: Deployment, *, source: str, local_paths: bool = True, training: bool = True
) -> Deployment:
    """``deployment`` when the code that uses its fields accepts them; else :class:`ConfigError` with what a
    well-typed config gets wrong by that code, as ``field: why`` sentences."""
    problems = []
    if training:
        problems += _model_problems(deployment, local_paths=local_paths) + _compat_problems(deployment.compat)
    if local_paths:
        problems += _gate_problems(deployment.gate)
    problems += _rollout_problems(deployment.rollout)
    if problems:
        raise ConfigError("\n".join(f"{source}: {problem}" for problem in problems))
    return deployment


def _model_problems(deployment: Deployment, *, local_paths: bool = True) -> list[str]:
    """Model config names as the model factory resolves them; with ``local_paths``, the pretrained weights."""
    from compat.models.factory import config_path, read_config, resize_mode_of
    from compat.models.pretrained import PretrainedError, resolve_pretrained

    training = deployment.training
    problems = []
    for field, name in (
        ("training.model_config", training.model_config_name),
        ("compat.foundation_config", deployment.compat.foundation_config),
    ):
        try:
            resize_mode_of(read_config(name), str(config_path(name)))
        except (KeyError, ValueError) as err:
            problems.append(f"{field}: {err.args[0] if isinstance(err, KeyError) else err}")
    if local_paths and not problems:
        model_config = read_config(training.model_config_name)
        pretrained = training.pretrained or model_config.get("pretrained")
        where = "training.pretrained" if training.pretrained else str(config_path(training.model_config_name))
        from components.state.workspace import Workspace, WorkspaceError

        try:
            weights = [Workspace.of(deployment).weights_dir]
        except WorkspaceError:
            weights = []  # the workspace field's own check names it
        try:
            if pretrained:
                resolve_pretrained(
                    pretrained, arch=model_config.get("open_clip_model"), where=where, weights_dirs=weights
                )
        except PretrainedError as err:
            problems.append(str(err))
    return problems


def _compat_problems(compat: Any) -> list[str]:
    """The method's options, by the method's own config class (imports torch, so only when there are any)."""
    reserved = sorted({"steps", "device", "version", "old_space_id"} & set(compat.options))
    if reserved:
        return [
            f"compat.options may not set {reserved}: steps is compat.steps, device is training.device, "
            "and the pipeline sets version and old_space_id"
        ]
    if not compat.options:
        return []
    from compat.methods import get_method
    from compat.methods.contract import CompatError

    try:
        get_method(compat.method).make_config(compat.options, source="compat.options")
    except CompatError as err:
        return [str(err)]
    return []


def _gate_problems(gate: Any) -> list[str]:
    """The gate policy, read and checked by the gate's own loader (null: the shipped policy)."""
    from components.gate import PolicyError, load_gate_policy

    try:
        load_gate_policy(gate.policy)
    except PolicyError as err:
        return [f"gate.policy: {err}"]
    return []


def _rollout_problems(rollout: Any) -> list[str]:
    """Each rollout setting checked alone by :class:`components.rollout.RolloutConfig`, so that every
    mistake is reported under its own field."""
    from components.deployment import RolloutSection
    from components.rollout import RolloutConfig

    problems = []
    for field in ("fractions", "order", "batch_size"):
        try:
            RolloutConfig.from_section(
                RolloutSection(), new_version="config-check", **{field: getattr(rollout, field)}
            )
        except (TypeError, ValueError) as err:
            message = str(err)
            problems.append(
                f"rollout.{message}" if message.startswith(f"{field} ") else f"rollout.{field}: {message}"
            )
    return problems


def resolve(config: Deployment | Mapping[str, Any]) -> Deployment:
    """The config with every default made explicit (KFP parameters carry no nulls); a mapping is checked."""
    if not isinstance(config, Deployment):
        config = check(Deployment.parse(config, source="<config>"), source="<config>")
    return config.resolved()
