"""The gate policy: its typed model, from which ``schemas/gate_policy.schema.json`` is generated (``make
schemas``), and its loader: the shipped default (``default_policy.yaml``, beside it) with a YAML policy merged
over it, checked whole when it is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, PrivateAttr, field_validator

from components.state.documents import validated
from schemas import SchemaError

DEFAULT_POLICY_PATH = Path(__file__).resolve().parent / "default_policy.yaml"
Severity = Literal["none", "low", "medium", "high"]
SEVERITIES: tuple[str, ...] = get_args(Severity)
_CONFIG = ConfigDict(
    extra="forbid", frozen=True, strict=True, allow_inf_nan=False, use_attribute_docstrings=True
)


class PolicyError(ValueError):
    """The gate policy is unreadable or invalid; the message names the file and the fields."""


class Retention(BaseModel):
    """New/new retention: the candidate's own space must keep this share of a reference R@K."""

    model_config = _CONFIG
    floor: float = Field(ge=0, le=1)
    """new/new R@K must be >= floor x reference R@K."""
    reference: Literal["auto", "independent", "old"]
    """auto: the independent new model's new/new when reported, else old/old; independent; old: old/old."""


class GatePolicy(BaseModel):
    """Thresholds of the release gate. A user policy is merged over the shipped default
    (components/gate/default_policy.yaml) key by key; the resolved policy must have every key. Unknown keys
    are refused so that a typo cannot relax the gate."""

    model_config = ConfigDict(**_CONFIG, title="Release gate policy")
    schema_version: Literal[1]
    directions: list[Literal["t2i", "i2t"]] = Field(min_length=1, json_schema_extra={"uniqueItems": True})
    """Directions in which the ECC (and retention) must hold."""
    ks: list[PositiveInt] = Field(min_length=1, json_schema_extra={"uniqueItems": True})
    """K of the R@K metrics that must pass."""
    min_margin: float
    """new/old minus old/old must be strictly greater than this, in percentage points."""
    require_ci_lower_above_zero: bool
    """The bootstrap interval's lower bound of every required margin must be > 0."""
    min_eval_images: PositiveInt
    min_eval_captions: PositiveInt
    retention: Retention
    max_drift_severity: Severity
    require_drift: bool
    require_validation: bool
    _source: str = PrivateAttr(default="<policy>")  # where it was read (gate.json's policy_source)

    @field_validator("directions", "ks")
    @classmethod
    def _unique(cls, items: list[Any]) -> list[Any]:
        if len(set(items)) != len(items):
            raise ValueError(f"has repeated items: {items}")
        return items

    @property
    def source(self) -> str:
        return self._source

    @classmethod
    def from_mapping(cls, overrides: Mapping[str, Any] | None = None, source: str = "<policy>") -> GatePolicy:
        """Merge ``overrides`` over the shipped default and check the whole; raises :class:`PolicyError`."""
        if overrides is not None and not isinstance(overrides, Mapping):
            raise PolicyError(f"{source}: a policy must be a mapping of keys, got {type(overrides).__name__}")
        merged = merge_policy(read_yaml(DEFAULT_POLICY_PATH, "default policy"), overrides or {})
        try:
            policy = validated(cls, merged, source)
        except SchemaError as err:
            raise PolicyError(str(err)) from None
        policy._source = source
        return policy


def load_gate_policy(path: str | Path | None = None) -> GatePolicy:
    """The shipped default (``path`` None) or a YAML policy merged over it; raises :class:`PolicyError`."""
    overrides = None if path is None else read_yaml(Path(path), "gate policy")
    return GatePolicy.from_mapping(overrides, source=str(DEFAULT_POLICY_PATH if path is None else path))


def merge_policy(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` merged into ``base`` key by key (nested mappings too); returns ``base``."""
    for key, value in overrides.items():
        nested = isinstance(value, Mapping) and isinstance(base.get(key), Mapping)
        base[key] = merge_policy(dict(base[key]), value) if nested else value
    return base


def read_yaml(path: Path, what: str) -> Any:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise PolicyError(f"cannot read the {what} {path}: {err}") from err
    except yaml.YAMLError as err:
        raise PolicyError(f"{what} {path} is not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise PolicyError(f"{what} {path} must be a YAML mapping of keys")
    return doc
