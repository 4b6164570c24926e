"""Method settings: the fields every method shares, and typed construction from a config mapping."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compat.methods.contract import CompatError


@dataclass
class MethodConfig:
    """Settings shared by every method; each method subclasses it with its own (documented) defaults."""

    steps: int = 300
    lr: float = 1e-4
    seed: int = 0
    device: str = "cpu"
    version: str = "candidate"
    old_space_id: str = "production"
    log_every: int = 50

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise ``ValueError`` naming a setting out of its range (each method checks its own)."""


_EXPECTED = {  # a setting's type -> (whether a value is one, what the error says it expected)
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and int(v) == v, "an integer"),
    float: (lambda v: not isinstance(v, bool) and isinstance(v, (int, float)), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if annotation not in _EXPECTED:
        return value
    accepts, expected = _EXPECTED[annotation]
    if not accepts(value):
        raise CompatError(f"{where}: expected {expected}, got {value!r}")
    return annotation(value)


def config_from_mapping(
    config_class: type[MethodConfig], values: Mapping[str, Any] | None, source: str = "config"
) -> MethodConfig:
    """Build ``config_class`` from ``values``; unknown keys and wrong types raise :class:`CompatError`."""
    values = dict(values or {})
    hints = typing.get_type_hints(config_class)
    known = {f.name for f in dataclasses.fields(config_class)}
    if unknown := sorted(set(values) - known):
        raise CompatError(
            f"{source}: unknown setting(s) {unknown} for {config_class.__name__}; known: {sorted(known)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{source}: {k}") for k, v in values.items()}
    config = config_class(**kwargs)
    try:
        config.validate()
    except ValueError as exc:
        raise CompatError(f"{source}: {exc}") from exc
    return config
