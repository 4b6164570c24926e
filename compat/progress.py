"""Progress of long steps, one reporter for the whole process: live rich bars on a terminal, plain log lines
otherwise (KFP logs, files, pipes), nothing when quiet.

Every long step reports through :func:`task` (a context manager whose handle takes ``advance(n, **fields)``)
or :func:`track` (wraps an iterable). The mode comes from ``$COMPATFLOW_PROGRESS`` at the time a step starts:
``auto`` (the default: ``bar`` when stderr is a terminal, else ``plain``), ``bar``, ``plain`` or ``quiet``
(``compatflow -q`` sets it, and task subprocesses inherit it). Plain lines go to the ``compat.progress``
logger every ``$COMPATFLOW_PROGRESS_EVERY_S`` seconds (10 by default), each starting with
:data:`LINE_MARK`::

    [progress] training: 120/500 steps (24%), 12.3 steps/s, ETA 31 s, loss 1.234

and one last line when a step that lasted that long ends. Bars of steps that run at the same time (an
encoding inside a rollout stage) stack in one live display on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MODE_ENV = "COMPATFLOW_PROGRESS"
EVERY_ENV = "COMPATFLOW_PROGRESS_EVERY_S"
MODES = ("auto", "bar", "plain", "quiet")
LINE_MARK = "[progress] "
DEFAULT_EVERY_S = 10.0
log = logging.getLogger("compat.progress")


def mode() -> str:
    """The reporting mode now: ``bar``, ``plain`` or ``quiet`` (``auto`` resolved against stderr)."""
    chosen = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if chosen not in MODES:
        log.warning("%s=%r is not one of %s; using auto", MODE_ENV, chosen, ", ".join(MODES))
        chosen = "auto"
    if chosen == "auto":
        with contextlib.suppress(AttributeError, ValueError):  # a replaced or closed stderr is no terminal
            return "bar" if sys.stderr.isatty() else "plain"
        return "plain"
    return chosen


def _every_s() -> float:
    try:
        value = float(os.environ.get(EVERY_ENV, DEFAULT_EVERY_S))
    except ValueError:
        return DEFAULT_EVERY_S
    return value if math.isfinite(value) and value > 0 else DEFAULT_EVERY_S


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _fields_text(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


class _Display:
    """The process's one rich live display; steps add their bars to it and it stops when the last ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.progress: Any = None
        self.users = 0

    def add(self, description: str, total: int | None, completed: int, unit: str) -> int:
        with self.lock:
            if self.progress is None:
                self.progress = _new_progress()
                self.progress.start()
            self.users += 1
            return self.progress.add_task(description, total=total, completed=completed, unit=unit, info="")

    def update(self, task_id: int, **kwargs: Any) -> None:
        with self.lock:
            self.progress.update(task_id, **kwargs)

    def remove(self, task_id: int) -> None:
        with self.lock:
            self.progress.remove_task(task_id)
            self.users -= 1
            if self.users == 0:
                self.progress.stop()
                self.progress = None


def _new_progress() -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Items per second, in the step's unit."""

        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:,.1f} {task.fields['unit']}/s", style="cyan")

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
        transient=True,
    )


_DISPLAY = _Display()


class Task:
    """One long step's progress: ``advance`` it as work completes; ``fields`` (a loss, a stage) are shown."""

    def __init__(
        self, description: str, total: int | None, unit: str, completed: int = 0, enabled: bool = True
    ) -> None:
        self.description, self.total, self.unit = description, total, unit
        self.done, self.fields = completed, {}
        self._start_done = completed
        self.mode = mode() if enabled else "quiet"  # e.g. every rank of a distributed run but the first
        self.every_s = _every_s()
        self.start = self._last = time.monotonic()
        self._logged = False
        self._bar = _DISPLAY.add(description, total, completed, unit) if self.mode == "bar" else None

    def advance(self, n: int = 1, **fields: Any) -> None:
        """``n`` more items done; ``fields`` replace the shown values of the same names."""
        self.done += n
        self.fields.update(fields)
        if self._bar is not None:
            _DISPLAY.update(self._bar, completed=self.done, info=_fields_text(self.fields))
        elif self.mode == "plain" and (now := time.monotonic()) - self._last >= self.every_s:
            self._last = now
            self._line(now)

    def set(self, **fields: Any) -> None:
        """Show ``fields`` (e.g. ``loss=0.83``) with the step's progress from now on."""
        self.fields.update(fields)
        if self._bar is not None:
            _DISPLAY.update(self._bar, info=_fields_text(self.fields))

    def rate(self, now: float | None = None) -> float:
        """Items per second since the step started (items done before a resume not counted)."""
        elapsed = (now or time.monotonic()) - self.start
        return (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0

    def _line(self, now: float) -> None:
        self._logged = True
        rate = self.rate(now)
        parts = [f"{self.done}/{self.total} {self.unit}" if self.total else f"{self.done} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.0f}%)"
        parts.append(f"{rate:,.1f} {self.unit}/s")
        if self.total and rate > 0:
            parts.append(f"ETA {_duration(max(self.total - self.done, 0) / rate)}")
        if self.fields:
            parts.append(_fields_text(self.fields))
        log.info("%s%s: %s", LINE_MARK, self.description, ", ".join(parts))

    def close(self) -> None:
        """End the step: its bar goes; a plain step that lasted ``every_s`` logs its last line."""
        if self._bar is not None:
            _DISPLAY.remove(self._bar)
            self._bar = None
        elif self.mode == "plain" and (self._logged or time.monotonic() - self.start >= self.every_s):
            done = f"{self.done} {self.unit} in {_duration(time.monotonic() - self.start)}"
            rate = f"{self.rate():.1f} {self.unit}/s"
            extra = f", {_fields_text(self.fields)}" if self.fields else ""
            log.info("%s%s: done, %s (%s)%s", LINE_MARK, self.description, done, rate, extra)
            self._logged = False


def task(
    description: str, total: int | None = None, unit: str = "items", completed: int = 0
) -> contextlib.closing[Task]:
    """Report a long step while the block runs: ``with task("indexing", total=n) as t: ... t.advance(k)``."""
    return contextlib.closing(Task(description, total, unit, completed))


class Tracked(Generic[T]):
    """An iterable that reports its progress as it is consumed (:func:`track`); ``set`` shows fields."""

    def __init__(self, items: Iterable[T], description: str, total: int | None, unit: str) -> None:
        self.items, self.description, self.unit = items, description, unit
        self.total = total if total is not None or not hasattr(items, "__len__") else len(items)  # type: ignore[arg-type]
        self.fields: dict[str, Any] = {}  # shown from the start, also when set before the iteration
        self._task: Task | None = None

    def set(self, **fields: Any) -> None:
        """Show ``fields`` (e.g. ``loss=0.83``) with the progress."""
        self.fields.update(fields)
        if self._task is not None:
            self._task.set(**fields)

    def __iter__(self) -> Iterator[T]:
        with task(self.description, self.total, self.unit) as self._task:
            self._task.fields.update(self.fields)
            try:
                for item in self.items:
                    yield item
                    self._task.advance(1)
            finally:
                self._task = None


def track(items: Iterable[T], description: str, total: int | None = None, unit: str = "items") -> Tracked[T]:
    """``items``, reporting progress as they are consumed (see the module docstring)."""
    return Tracked(items, description, total, unit)
