"""The typed deployment: every setting of a pipeline config, one pydantic model per section.

A YAML config (``pipelines/configs/*.yaml``) is parsed once into a :class:`Deployment` (by
:func:`pipelines.config.load_config`, which adds the checks that need the model factory, the methods and the
gate); every step, op and command then reads typed attributes, and a KFP op rebuilds the same object from
the JSON string it receives (:meth:`Deployment.coerce`). Each default lives in its field definition (the
local config's values); ``schemas/pipeline_config.schema.json`` and ``pipelines/configs/local.yaml`` are
generated from this model (``make schemas``, checked by tests), so they cannot drift apart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS_FILE = ROOT / "pipelines" / "configs" / "local.yaml"
COMMENT_COLUMN = 37
DEFAULTS_HEADER = """\
# Embedded defaults: every service runs in-process on this machine (milvus-lite, MLflow on
# sqlite, Feast's local registry), CPU, tiny models. `make run` uses this file.
# Generated from components/deployment.py (`make schemas`): every setting, its
# default and what it means; a key left out of a config takes this value. cluster.yaml sets what
# production changes."""


class Section(BaseModel):
    """A config section: unknown keys are refused, values keep their YAML type (no "1" for 1) and are
    immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


class StreamSection(Section):
    """Where the phases of training data come from; the rest synthesises the default stream when missing."""

    uri: str = Field(
        "workspace/stream",
        min_length=1,
        description="a directory with stream.json (img2dataset-style shards)",
    )
    generate_if_missing: bool = Field(True, description="synthesise the default stream on the first run")
    phases: int = Field(5, ge=1, description="synthetic stream: phases generated")
    samples_per_phase: int = Field(2000, ge=1, description="synthetic stream: training pairs per phase")
    eval_per_domain: int = Field(200, ge=1, description="synthetic stream: evaluation pairs per domain")
    gallery_per_domain: int = Field(500, ge=1, description="synthetic stream: gallery items per domain")
    image_size: int = Field(64, ge=16, description="synthetic stream: rendered picture side, px")
    seed: int = 0
    shift: Literal["realistic", "disjoint"] = Field(
        "realistic", description="realistic (shared core words, new items per phase) | disjoint (hard)"
    )
    old_word_share: float = Field(
        0.6, ge=0, le=1, description="realistic: share of a later phase's captions in earlier words only"
    )


class ValidationSection(Section):
    """Data validation of each new phase."""

    max_quarantined_fraction: float = Field(
        0.05, ge=0, le=1, description="a phase with more of its samples quarantined is blocked"
    )


class DriftSection(Section):
    """The drift report against a reference phase."""

    reference_phase: Literal["previous", "first"] = Field("previous", description='"previous" or "first" (0)')
    sample_size: int = Field(500, ge=10, description="samples per side fed to Evidently")
    embeddings: bool = Field(True, description="embedding drift under the production model when one exists")


class TrainingSection(Section):
    """Continual training of the next model (Mod-X and its baselines)."""

    model_config_name: str = Field(
        "cf-tiny",
        alias="model_config",
        description="a model config: cf-* or an open_clip architecture, e.g. ViT-B-32 (`compatflow models`)",
    )
    pretrained: str | None = Field(
        None,
        description="first model's start weights: an open_clip tag of the architecture (weights_dir, then "
        "the Hugging Face cache; never downloaded at run time) or a local .pt/.safetensors file or folder",
    )
    weights_dir: str | None = Field(
        None,
        description="start weights by tag, laid out <ARCH>/<TAG>/ (`compatflow models fetch --to`); "
        "null: <workspace>/weights",
    )
    resize_mode: Literal["shortest", "longest", "squash"] | None = Field(
        None, description="null: the model config's; kept in checkpoints"
    )
    method: Literal["modx", "finetune", "joint"] = "modx"
    alpha: float = Field(
        1.0,
        ge=0,
        description="Mod-X KL weight (paper: 20; with a buffer, 1 learns the newest phase as fast as "
        "fine-tuning and keeps earlier ones best: continual.md run H)",
    )
    replay_buffer_size: int = Field(
        1000, ge=0, description="earlier-phase pairs kept (Mod-X + buffer, paper Table 2); 0: none"
    )
    replay_rows: int = Field(16, ge=0, description="rows of every batch drawn from the buffer")
    steps: int = Field(300, ge=1)
    epochs: float | None = Field(
        None, gt=0, description="passes over the phase instead of `steps` (null: steps)"
    )
    checkpoint_every: int = Field(50, ge=0, description="steps between resumable checkpoints (0: none)")
    batch_size: int = Field(64, ge=2)
    lr: float = Field(5.0e-4, gt=0)
    warmup_fraction: float = Field(0.2, ge=0, le=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    loader_workers: int = Field(
        0,
        ge=0,
        description="processes decoding training images, order kept (0: the training process; a "
        "CPU-trained model on 2 shared cores gains nothing from more: loader.md)",
    )

    @model_validator(mode="after")
    def _replay_rows_fit_the_batch(self) -> TrainingSection:
        rows, batch = self.replay_rows, self.batch_size
        if self.replay_buffer_size > 0 and not 1 <= rows <= batch - 2:
            raise ValueError(
                f"replay_rows is {rows}; with a replay buffer it must be in [1, batch_size - 2] = "
                f"[1, {batch - 2}] (or set replay_buffer_size: 0)"
            )
        return self


class CompatSection(Section):
    """Compatibility training against the production model."""

    scenario: Literal["continual", "foundation"] = "continual"
    foundation_config: str = Field(
        "cf-foundation-minilm", description="scenario foundation: the new model's config (a wider one)"
    )
    method: Literal["bct", "lambda_orth", "bt2", "xbt", "taca", "none"] = Field(
        "bct", description="`compatflow compat methods` (bct + rule: results/compat.md)"
    )
    steps: int = Field(900, ge=1, description="BCT + rule meets the ECC goal both ways at 900, not 300")
    batch_size: int = Field(64, ge=2)
    replay_shards_per_phase: int = Field(
        1, ge=0, description="+ this many validated shards of every earlier phase (0: none)"
    )
    options: dict[str, Any] = Field(
        default_factory=lambda: {"synthesize_unmatched": True},
        description="the method's own settings (`compatflow compat methods`)",
    )


class GateSection(Section):
    """The release gate."""

    policy: str | None = Field(None, description="a gate policy YAML (null: the shipped policy)")


class RegistrySection(Section):
    """The MLflow model registry."""

    tracking_uri: str | None = Field(None, description="null: the workspace's embedded MLflow store (sqlite)")
    model_name: str = Field("compatflow-clip", min_length=1)


class LineageSection(Section):
    """The Feast repo holding the lineage of every gallery item."""

    repo: str | None = Field(None, description="null: a Feast repo inside the workspace")


class IndexSection(Section):
    """The Milvus gallery index."""

    uri: str | None = Field(None, description="null: milvus-lite inside the workspace")
    alias: str | None = Field(
        None,
        min_length=1,
        description="null: gallery_<8 hex>, unique to this deployment (a serving workspace keeps its alias)",
    )


class SloSection(Section):
    """The query latency the backfill may cost (unset: unpaced)."""

    p99_factor: float | None = Field(None, gt=1, description="query p99 <= this x idle during the backfill")
    max_items_per_s: float | None = Field(None, gt=0)


Recall = Literal["R@1", "R@5", "R@10"]
# Standard errors a probe may fall below old/old: beyond a few the floor is 0 for any probe set, no probe can
# halt (the report says so), and a larger number only hides a mistyped one.
MAX_PROBE_TOLERANCE = 1000.0


class RolloutSection(Section):
    """The staged rollout of a released model into the index."""

    fractions: list[float] = Field(
        default_factory=lambda: [0.1, 0.25, 0.5, 1.0], min_length=1, description="backfilled after each stage"
    )
    order: Literal["random", "oldest_first", "lambda_orth", "uncertainty"] = Field(
        "lambda_orth", description="which items are re-embedded first"
    )
    batch_size: int = Field(256, ge=1)
    workers: int = Field(
        1,
        ge=1,
        description="processes (cluster: parallel tasks) re-embedding a backfill stage's rank ranges; "
        "more than 1 needs index.uri on a Milvus server",
    )
    floors: dict[Recall, float] = Field(
        default_factory=dict, description="probe R@K floors above old/old, e.g. {R@1: 20}"
    )
    probe_tolerance: float = Field(
        1.0,
        ge=0,
        le=MAX_PROBE_TOLERANCE,
        allow_inf_nan=False,
        description="standard errors of the probe's old/old R@K a stage may fall below it (0: none)",
    )
    slo: SloSection = Field(
        default_factory=SloSection,
        description="unpaced: e.g. {p99_factor: 1.5} holds query p99 <= 1.5 x idle",
    )

    @field_validator("probe_tolerance", mode="before")
    @classmethod
    def _yaml_number(cls, value: Any) -> Any:
        """A number YAML 1.1 read as text (``1e9``, ``1.0e9``) is refused saying how YAML wants it."""
        if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
            raise ValueError(
                f"{value!r} is text to YAML, not a number: write the exponent with a dot and a sign "
                f"(1.0e+9, not 1e9 or 1.0e9), at most {MAX_PROBE_TOLERANCE:g}"
            )
        return value


CPU_IMAGE = "ghcr.io/compatflow/compatflow-cpu:0.1.0"
GPU_IMAGE = "ghcr.io/compatflow/compatflow-cuda:0.1.0"
IMAGE_HELP = "registry-qualified: REGISTRY/NAME:TAG, optionally @sha256:DIGEST"


class TaskResources(Section):
    """What a CPU task requests on a cluster, and the image it runs."""

    cpu: str = "2"
    memory: str = "8Gi"
    image: str = Field(CPU_IMAGE, description=f"the CPU tasks' container image ({IMAGE_HELP})")

    @field_validator("image")
    @classmethod
    def _qualified(cls, value: str) -> str:
        return qualified_image(value)


class Toleration(Section):
    """A Kubernetes toleration of the GPU pool's taints, as a pod spec writes it (what Kubernetes would refuse
    or silently ignore is refused here)."""

    model_config = ConfigDict(populate_by_name=False)  # tolerationSeconds by that name only

    key: str | None = None
    operator: Literal["Equal", "Exists"] | None = None
    value: str | None = None
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value not in (None, ""):
            raise ValueError(f"value must be empty when operator is Exists, got {self.value!r}")
        if not self.key and self.operator != "Exists":
            raise ValueError("key is empty: an empty key (every taint) needs operator: Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"tolerationSeconds is set, so effect must be NoExecute (got {self.effect!r})")
        return self


class GpuResources(TaskResources):
    """What a GPU task requests, the node pool it is scheduled on, and the image it runs."""

    cpu: str = "8"
    memory: str = "32Gi"
    image: str = Field(GPU_IMAGE, description=f"the GPU tasks' container image ({IMAGE_HELP})")
    accelerator: str | None = None
    accelerator_count: int = Field(0, ge=0)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)

    @model_validator(mode="after")
    def _accelerator_and_count(self) -> GpuResources:
        if self.accelerator and self.accelerator_count < 1:
            raise ValueError("accelerator_count must be at least 1 when accelerator is set")
        if self.accelerator_count > 0 and not self.accelerator:
            raise ValueError(
                f"accelerator_count is {self.accelerator_count} but accelerator is not set: the GPU tasks "
                "would request no GPU (set the accelerator's resource name, e.g. nvidia.com/gpu, or "
                "accelerator_count: 0)"
            )
        return self


class ResourceSection(Section):
    """Per-task requests on a cluster; the local runner ignores them."""

    cpu: TaskResources = Field(default_factory=TaskResources)
    gpu: GpuResources = Field(default_factory=GpuResources)


def qualified_image(value: str) -> str:
    """``value`` when it is a registry-qualified image reference with a tag or a digest, else ValueError: a
    cluster pulls exactly what the config names, never ``docker.io/library/...:latest`` by accident."""
    name, _, digest = value.partition("@")
    registry, slash, rest = name.partition("/")
    tag = rest.rpartition(":")[2] if ":" in rest else ""
    if (
        not slash
        or not ("." in registry or ":" in registry or registry == "localhost")
        or not re.fullmatch(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*", rest.rpartition(":")[0] if tag else rest)
        or not (tag or digest)
        or (tag and not re.fullmatch(r"[\w][\w.-]{0,127}", tag))
        or (digest and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest))
    ):
        raise ValueError(
            f"image {value!r} must be {IMAGE_HELP} (e.g. {CPU_IMAGE}; for kind: "
            "docker.io/library/compatflow-cpu:0.1.0)"
        )
    return value


class Deployment(Section):
    """A whole pipeline config. :meth:`resolved` makes the workspace absolute and every service URI
    explicit (the form a run records and a KFP op receives), and records the workspace it derived them from
    (``resolved_for``): a resolved config whose ``workspace`` is changed afterwards has each URI that is still
    the old workspace's derived one derived again from the new workspace, so no copy goes stale."""

    name: str = "local"
    workspace: str = Field(
        "workspace",
        min_length=1,
        description="state, models, registry, index, run outputs (relative: the cwd)",
    )
    resolved_for: str | None = Field(
        None,
        description="written by resolve: the workspace the service URIs were derived from (a changed "
        "workspace derives them again)",
    )
    stream: StreamSection = Field(default_factory=StreamSection)
    validation: ValidationSection = Field(default_factory=ValidationSection)
    drift: DriftSection = Field(default_factory=DriftSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    compat: CompatSection = Field(default_factory=CompatSection)
    gate: GateSection = Field(default_factory=GateSection)
    registry: RegistrySection = Field(default_factory=RegistrySection)
    lineage: LineageSection = Field(default_factory=LineageSection)
    index: IndexSection = Field(default_factory=IndexSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    resources: ResourceSection = Field(default_factory=ResourceSection)

    @model_validator(mode="before")
    @classmethod
    def _derived_services_follow_the_workspace(cls, data: Any) -> Any:
        """A config resolved for one workspace whose ``workspace`` now names another: each service URI that
        is still the value :meth:`resolved` derived for the old workspace becomes the new workspace's; a URI
        set apart from the workspace (a server, an environment variable's) is kept."""
        if not isinstance(data, Mapping) or not isinstance(data.get("resolved_for"), str):
            return data
        from components.state.workspace import Workspace, WorkspaceError

        workspace = data.get("workspace", cls.model_fields["workspace"].default)
        if not isinstance(workspace, str):
            return data  # the field's own check names it
        try:
            old, new = Workspace(data["resolved_for"]), Workspace(workspace)
        except WorkspaceError:
            return data  # resolved() and Workspace.of refuse this workspace, naming the field
        if old.root == new.root:
            return data
        document, now = dict(data), _derived_services(new)
        for (section, key), derived in _derived_services(old).items():
            given = document.get(section)
            if isinstance(given, BaseModel):  # a section given as its model
                given = given.model_dump(by_alias=True)
            if isinstance(given, Mapping) and given.get(key) == derived:
                document[section] = {**given, key: now[section, key]}
        document["resolved_for"] = str(new.root)
        return document

    @classmethod
    def parse(cls, document: Any, *, source: str) -> Deployment:
        """``document`` (a parsed YAML mapping) checked whole; raises :class:`ConfigError` listing every
        field that breaks the model, one line each, ``<source>: <field>: <why>``."""
        if not isinstance(document, Mapping):
            raise ConfigError(
                f"{source}: a config is a YAML mapping of sections, got {type(document).__name__}"
            )
        try:
            return cls.model_validate(dict(document))
        except ValidationError as err:
            raise ConfigError("\n".join(f"{source}: {line}" for line in error_lines(err))) from None

    @classmethod
    def coerce(cls, value: Deployment | Mapping[str, Any] | str) -> Deployment:
        """A deployment from itself, a mapping, or the JSON string a KFP op receives."""
        if isinstance(value, Deployment):
            return value
        document = json.loads(value) if isinstance(value, str) else value
        return cls.parse(document, source="<config>")

    def to_dict(self) -> dict[str, Any]:
        """The plain mapping with the YAML's key names (``training.model_config``)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        """The form a KFP op receives (keys sorted, so a compiled pipeline is reproducible)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def with_changes(self, **sections: Mapping[str, Any] | str) -> Deployment:
        """A copy with some fields changed: ``workspace="..."`` or ``training={"steps": 5}`` (a section's
        mapping is merged into it); checked like a loaded config."""
        document = self.to_dict()
        for key, value in sections.items():
            document[key] = {**document[key], **value} if isinstance(value, Mapping) else value
        return Deployment.parse(document, source="<changed config>")

    def resolved(self) -> Deployment:
        """The config with every default made explicit (KFP parameters cannot carry nulls; a run records it):
        absolute workspace and stream, the service URIs the :class:`~components.state.workspace.Workspace`
        resolves, the gate policy path, an empty accelerator. :class:`ConfigError` for a refused workspace."""
        from components.gate import DEFAULT_POLICY_PATH
        from components.state.workspace import Workspace, WorkspaceError

        try:
            ws = Workspace.of(self)
        except WorkspaceError as err:
            raise ConfigError(f"config field 'workspace': {err}") from err
        stream = (
            self.stream.uri if "://" in self.stream.uri else str(Path(self.stream.uri).expanduser().resolve())
        )
        gpu = self.resources.gpu
        services = {
            section: getattr(self, section).model_copy(update={key: value})
            for (section, key), value in _derived_services(ws).items()
        }
        return self.model_copy(
            update={
                "workspace": str(ws.root),
                "resolved_for": str(ws.root),
                "stream": self.stream.model_copy(update={"uri": stream}),
                **services,
                "gate": self.gate.model_copy(update={"policy": self.gate.policy or str(DEFAULT_POLICY_PATH)}),
                "resources": self.resources.model_copy(
                    update={"gpu": gpu.model_copy(update={"accelerator": gpu.accelerator or ""})}
                ),
            }
        )


def _derived_services(ws: Any) -> dict[tuple[str, str], str]:
    """The service URIs :meth:`Deployment.resolved` writes, by (section, field), as ``ws`` (a
    :class:`~components.state.workspace.Workspace`) resolves them: the configured value, else the
    environment's, else the workspace's embedded service."""
    return {
        ("registry", "tracking_uri"): ws.mlflow_uri,
        ("lineage", "repo"): str(ws.feast_dir),
        ("index", "uri"): ws.index_uri,
    }


class ConfigError(ValueError):
    """The configuration is unreadable or breaks its model or a rule; the message names the file and every
    field, one per line."""


def error_lines(err: ValidationError) -> list[str]:
    """One ``field: why (got value)`` sentence per pydantic error, the field dotted as in the YAML."""
    lines = []
    for problem in err.errors():
        field = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "missing":
            lines.append(f"{field}: is required")
        elif problem["type"] == "extra_forbidden":
            lines.append(f"{field}: is not a setting of this section (remove it, or check its spelling)")
        elif problem["type"] == "value_error":  # a section's own rule: its sentence says what was given
            lines.append(f"{field}: {problem['ctx']['error']}")
        else:
            lines.append(f"{field}: {problem['msg']} (got {problem['input']!r})")
    return lines


def defaults_yaml() -> str:
    """Every setting with its default and its description as a comment: ``pipelines/configs/local.yaml``
    (a section's line carries the first sentence of its class's docstring, a choice its choices)."""
    lines = [DEFAULTS_HEADER]
    defaults = Deployment()
    for name, field in Deployment.model_fields.items():
        value = getattr(defaults, name)
        if isinstance(value, Section):
            lines.append("")
            lines += _commented(f"{name}:", _first_sentence(type(value).__doc__))
            for key, inner in type(value).model_fields.items():
                line = f"  {inner.alias or key}: {_flow(getattr(value, key))}"
                lines += _commented(line, _described(inner))
        else:
            lines += _commented(f"{name}: {_flow(value)}", _described(field))
    return "\n".join(lines) + "\n"


def _described(field: Any) -> str | None:
    """A field's description, led by its choices when it is one of a few names."""
    choices = [c for c in _literal_choices(field.annotation) if c is not None]
    said = field.description or ""
    if choices and not all(str(c) in said for c in choices):
        said = " | ".join(map(str, choices)) + (f"; {said}" if said else "")
    return said or None


def _literal_choices(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, UnionType):  # an optional choice
        return tuple(c for arg in get_args(annotation) for c in _literal_choices(arg))
    return ()


def _flow(value: Any) -> str:
    """A value as one line of YAML (a nested section or list in flow style)."""
    import yaml

    plain = value.model_dump(mode="json", by_alias=True) if isinstance(value, BaseModel) else value
    text = yaml.safe_dump(plain, default_flow_style=True, sort_keys=False, width=1_000).strip()
    return text.removesuffix("...").strip()


def _commented(line: str, comment: str | None, width: int = 110) -> list[str]:
    """``line`` with ``comment`` from the comment column on, wrapped below it within ``width``."""
    if not comment:
        return [line]
    import textwrap

    column = max(COMMENT_COLUMN, len(line) + 2)
    wrapped = textwrap.wrap(comment, width - column - 2, break_on_hyphens=False) or [comment]
    return [f"{line.ljust(column - 1)} # {wrapped[0]}"] + [
        f"{'':{column - 1}} # {rest}" for rest in wrapped[1:]
    ]


def _first_sentence(doc: str | None) -> str | None:
    text = " ".join((doc or "").split())
    return text.split(". ")[0].rstrip(".") or None


if __name__ == "__main__":  # after changing a model (`make schemas`): local.yaml follows it
    DEFAULTS_FILE.write_text(defaults_yaml())
    print(DEFAULTS_FILE)
