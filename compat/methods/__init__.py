"""Compatibility methods behind one contract (:mod:`compat.methods.base`), registered by name.

:data:`METHODS` maps each method's name (``compat.method`` in the pipeline config) to its one module, whose
class :func:`register_method` registers (refusing a name or module the list does not hold, so the two cannot
drift apart). A method's module (and torch) is imported when the method is first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from compat.methods.base import CompatMethod

METHODS: Mapping[str, str] = MappingProxyType(
    {  # method name -> the module whose class registers it (imported on first use)
        "bct": "compat.methods.bct",
        "bt2": "compat.methods.bt2",
        "lambda_orth": "compat.methods.lambda_orth",
        "none": "compat.methods.none",
        "taca": "compat.methods.taca",
        "xbt": "compat.methods.xbt",
        "xbt_base": "compat.methods.xbt_base",
    }
)
_REGISTRY: dict[str, type[CompatMethod]] = {}
M = TypeVar("M", bound="type[CompatMethod]")


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator registering a :class:`~compat.methods.base.CompatMethod` subclass under ``name``.

    ``name`` must be listed in :data:`METHODS` with the module the class is defined in.
    """

    def decorate(cls: M) -> M:
        module = METHODS.get(name)
        if module is None:
            raise ValueError(
                f"compatibility method {name!r} is not listed in compat.methods.METHODS: "
                f"add {name!r}: {cls.__module__!r} there"
            )
        if cls.__module__ != module:
            raise ValueError(
                f"compatibility method {name!r} is defined in {module} (compat.methods.METHODS), "
                f"not in {cls.__module__}"
            )
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"compatibility method {name!r} is already registered by {module}.{existing.__qualname__}"
            )
        cls.name = name
        cls.model_class.method = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_method(name: str) -> CompatMethod:
    """An instance of the method ``name`` (its module is imported on first use)."""
    module = METHODS.get(name)
    if module is None:
        raise KeyError(f"unknown compatibility method {name!r}; available: {', '.join(available_methods())}")
    if name not in _REGISTRY:
        importlib.import_module(module)
    if name not in _REGISTRY:
        raise LookupError(f"{module} registers no method {name!r}: decorate its class with @register_method")
    return _REGISTRY[name]()


def available_methods() -> list[str]:
    """Names of every method (the keys of :data:`METHODS`); no method's module is imported."""
    return sorted(METHODS)


__all__ = ["METHODS", "available_methods", "get_method", "register_method"]
