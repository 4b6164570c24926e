"""A deployment section handed on to a runtime settings object with every field accounted for: the section
owns each setting's default, and a field nobody maps is refused instead of dropped on its way
(:meth:`components.rollout.types.RolloutConfig.from_section`,
:meth:`components.training.continual.TrainingSettings.from_section`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any


def section_values(section: Any, prefix: str = "") -> dict[str, Any]:
    """A config section's values by dotted field path, nested sections flattened (``slo.p99_factor``)."""
    from pydantic import BaseModel

    values: dict[str, Any] = {}
    for name, value in dict(section).items():
        if isinstance(value, BaseModel):
            values.update(section_values(value, f"{prefix}{name}."))
        else:
            values[f"{prefix}{name}"] = value
    return values


def mapped_settings(
    section: Any,
    fields: Mapping[str, str],
    *,
    name: str,
    owner: str,
    table: str,
    not_carried: Collection[str] = (),
) -> dict[str, Any]:
    """``{setting: value}`` for each ``setting: section path`` of ``fields``, read from ``section`` (the
    deployment's ``name`` section). A section field neither mapped nor ``not_carried`` raises TypeError naming
    it and ``table``; a section lacking a mapped field is refused as not a ``name`` section."""
    values = section_values(section)
    unmapped = sorted(values.keys() - set(fields.values()) - set(not_carried))
    if unmapped:
        listed = ", ".join(f"{name}.{path}" for path in unmapped)
        raise TypeError(f"{owner} does not map {listed}: add it to {table}")
    missing = sorted(set(fields.values()) - values.keys())
    if missing:
        raise TypeError(f"not a {name} section: no {', '.join(missing)}")
    return {setting: values[path] for setting, path in fields.items()}
