"""The gate policy: the shipped default (``default_policy.yaml``, beside it) with a YAML policy merged over
it, checked whole when it is loaded."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_POLICY_PATH = Path(__file__).resolve().parent / "default_policy.yaml"
SEVERITIES = ("none", "low", "medium", "high")


class PolicyError(ValueError):
    """The gate policy is unreadable or invalid; the message names the file and the fields."""


@dataclass(frozen=True)
class GatePolicy:
    """Resolved release-gate thresholds (see ``components/gate/default_policy.yaml``)."""

    directions: tuple[str, ...]
    ks: tuple[int, ...]
    min_margin: float
    require_ci_lower_above_zero: bool
    min_eval_images: int
    min_eval_captions: int
    retention_floor: float
    retention_reference: str
    max_drift_severity: str
    require_drift: bool
    require_validation: bool
    source: str = "default"

    def to_dict(self) -> dict[str, Any]:
        """The policy in its YAML layout (what ``gate.json`` records)."""
        return {
            "schema_version": 1,
            "directions": list(self.directions),
            "ks": list(self.ks),
            "min_margin": self.min_margin,
            "require_ci_lower_above_zero": self.require_ci_lower_above_zero,
            "min_eval_images": self.min_eval_images,
            "min_eval_captions": self.min_eval_captions,
            "retention": {"floor": self.retention_floor, "reference": self.retention_reference},
            "max_drift_severity": self.max_drift_severity,
            "require_drift": self.require_drift,
            "require_validation": self.require_validation,
        }

    @classmethod
    def from_mapping(cls, overrides: Mapping[str, Any] | None = None, source: str = "<policy>") -> GatePolicy:
        """Merge ``overrides`` over the shipped default, validate, and build the policy."""
        import schemas

        base = read_yaml(DEFAULT_POLICY_PATH, "default policy")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise PolicyError(f"{source}: a policy must be a mapping of keys, got {type(overrides).__name__}")
        merged = merge_policy(base, dict(overrides or {}))
        errors = schemas.schema_errors(merged, "gate_policy")
        errors += [f"{path}: {value!r} is not a finite number" for path, value in non_finite(merged)]
        errors += [f"{key}: required" for key in sorted(set(base) - set(merged))]
        if errors:
            raise PolicyError(
                f"{source} is not a valid gate policy (schemas/gate_policy.schema.json):\n  "
                + "\n  ".join(errors)
            )
        return cls(
            directions=tuple(merged["directions"]),
            ks=tuple(int(k) for k in merged["ks"]),
            min_margin=float(merged["min_margin"]),
            require_ci_lower_above_zero=bool(merged["require_ci_lower_above_zero"]),
            min_eval_images=int(merged["min_eval_images"]),
            min_eval_captions=int(merged["min_eval_captions"]),
            retention_floor=float(merged["retention"]["floor"]),
            retention_reference=str(merged["retention"]["reference"]),
            max_drift_severity=str(merged["max_drift_severity"]),
            require_drift=bool(merged["require_drift"]),
            require_validation=bool(merged["require_validation"]),
            source=source,
        )


def load_gate_policy(path: str | Path | None = None) -> GatePolicy:
    """The shipped default (``path`` None) or a YAML policy merged over it; raises :class:`PolicyError`."""
    if path is None:
        return GatePolicy.from_mapping(None, source=str(DEFAULT_POLICY_PATH))
    path = Path(path)
    return GatePolicy.from_mapping(read_yaml(path, "gate policy"), source=str(path))


def merge_policy(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_policy(dict(merged[key]), dict(value))
        else:
            merged[key] = value
    return merged


def read_yaml(path: Path, what: str) -> Any:
    import yaml

    try:
        text = path.read_text()
    except OSError as err:
        raise PolicyError(f"cannot read the {what} {path}: {err}") from err
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PolicyError(f"{what} {path} is not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise PolicyError(f"{what} {path} must be a YAML mapping of keys")
    return doc


def non_finite(doc: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Paths of every NaN / infinite number in a nested document."""
    if isinstance(doc, float):
        return [] if math.isfinite(doc) else [(prefix or "<root>", doc)]
    if isinstance(doc, Mapping):
        items = doc.items()
    elif isinstance(doc, list | tuple):
        items = enumerate(doc)
    else:
        return []
    found: list[tuple[str, float]] = []
    for key, value in items:
        found += non_finite(value, f"{prefix}.{key}" if prefix else str(key))
    return found
