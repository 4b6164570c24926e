"""Compatibility methods behind one contract (:mod:`compat.methods.base`), registered by name.

Each method lives in ``compat/methods/<name>.py`` and registers itself with :func:`register_method`; the
pipeline config picks one by name (``compat.method``). Importing this package is cheap: a method module
(and torch) is imported when the method is first asked for.

    method = get_method("lambda_orth")
    model = method.fit(new_bundle, old_bundle, batches, method.make_config({"steps": 500}))
    model.save("out/compat")
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from compat.methods.base import CompatMethod

_NOT_METHODS = {"base", "config", "contract", "layers", "model", "run", "training"}  # the shared parts
_REGISTRY: dict[str, type[CompatMethod]] = {}
M = TypeVar("M", bound="type[CompatMethod]")


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator registering a :class:`~compat.methods.base.CompatMethod` subclass under ``name``.

    The name must equal the module's name (``compat/methods/<name>.py``) so that it can be found lazily.
    """

    def decorate(cls: M) -> M:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"compatibility method {name!r} is already registered by {existing.__module__}")
        cls.name = name
        cls.model_class.method = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _module_names() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_METHODS
    )


def get_method(name: str) -> CompatMethod:
    """An instance of the method registered as ``name`` (its module is imported on first use)."""
    if name not in _REGISTRY and name in _module_names():
        importlib.import_module(f"{__name__}.{name}")
    if name not in _REGISTRY:
        raise KeyError(f"unknown compatibility method {name!r}; available: {', '.join(available_methods())}")
    return _REGISTRY[name]()


def available_methods() -> list[str]:
    """Names of every method shipped in ``compat/methods`` (plus any registered from elsewhere)."""
    for module in _module_names():
        if module not in _REGISTRY:
            importlib.import_module(f"{__name__}.{module}")
    return sorted(_REGISTRY)


__all__ = ["available_methods", "get_method", "register_method"]
