"""Extension point: modules placed in this package extend ``rollback`` and ``status`` without edits elsewhere.

A plugin module (any ``components/plugins/<name>.py`` not starting with ``_``) may define:

* ``on_rollback(event: dict) -> None`` -- called, in module-name order, after the registry moved the
  ``production`` alias back. ``event`` has ``workspace``, ``model_name``, ``tracking_uri``,
  ``from_version``, ``to_version``, ``previous_version`` and ``rolled_back_at``. Raise to report a failure.
* ``status(workspace: components.workspace.Workspace) -> dict`` -- merged (recursively) into the
  document of ``compatflow status`` (e.g. ``{"gallery": {"count": ..., "by_version": {...}}}``).

A failing plugin never hides the others: every call runs and every failure is reported.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def modules() -> list[ModuleType]:
    """The plugin modules of this package, sorted by name."""
    found = sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
    return [importlib.import_module(f"{__name__}.{m.name}") for m in found if not m.name.startswith("_")]


def hooks(name: str) -> list[tuple[str, Callable[..., Any]]]:
    """``(qualified name, function)`` of every plugin defining ``name``."""
    out = []
    for module in modules():
        function = getattr(module, name, None)
        if callable(function):
            out.append((f"{module.__name__}.{name}", function))
    return out


def call_all(
    functions: list[tuple[str, Callable[..., Any]]], *args: Any, **kwargs: Any
) -> list[dict[str, Any]]:
    """Call each function; returns ``{"hook", "ok", "result" | "error"}`` for every one, failures included."""
    outcomes: list[dict[str, Any]] = []
    for qualified, function in functions:
        try:
            outcomes.append({"hook": qualified, "ok": True, "result": function(*args, **kwargs)})
        except Exception as err:  # noqa: BLE001 - reported to the caller, never swallowed
            log.error("plugin hook %s failed: %s", qualified, err)
            outcomes.append({"hook": qualified, "ok": False, "error": f"{type(err).__name__}: {err}"})
    return outcomes
