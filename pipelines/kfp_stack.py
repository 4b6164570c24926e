"""kfp's task setters (``set_cpu_request``, ``set_memory_limit``, ``set_accelerator_type`` and the like) learn
their own name from ``inspect.stack()``, which reads the source lines around every frame of the stack and,
for each frame, searches every loaded module: a fraction of a second in a small process, minutes in one that
holds torch, Great Expectations, Evidently and Feast (a test session, a long-lived service that builds the
pipeline). :func:`name_callers_without_source` makes kfp ask ``inspect.stack(0)``, which names the same
callers without reading any source; ``benchmarks/pipeline_build.py`` measures both."""

from __future__ import annotations

import inspect
import types


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    return inspect.stack(0)


def name_callers_without_source() -> None:
    """Point kfp's ``pipeline_task`` module (its only use of :mod:`inspect` is naming a setter's caller) at
    a source-free :func:`inspect.stack`; idempotent."""
    from kfp.dsl import pipeline_task

    if getattr(pipeline_task.inspect, "stack", None) is not _stack:
        pipeline_task.inspect = types.SimpleNamespace(stack=_stack)
