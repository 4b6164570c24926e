"""What orders a backfill, stored with each gallery row when it is written, and the stage filters built on it.

Every row carries its keys (:data:`components.adapters.index.ORDER_FIELDS`, README.md "A gallery of any
size"), so no rollout reads and ranks the gallery before it starts; ``key_lambda_orth`` follows lambda-orth
Sec. 3.6 (the k-means clusters standing for the classes whose means the paper measures). A stage reaching the
cumulative fraction F is a filter (:class:`Selection`): for ``random`` a window of width F * 2^63 of
``order_key`` from a seeded offset; otherwise ``(key, order_key) < cut(F)``, the cut read off a uniform
sample of about :data:`SAMPLE_ROWS` rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compat.backfill import fit_centres, order_keys, order_scores  # noqa: F401 - the rollout's key functions
from components.adapters.index import KEY_SPACE
from components.adapters.index import key_window as _window  # the index's filter vocabulary

SAMPLE_ROWS = 4096  # rows a plan reads to place its cuts and fit the centres
KEY_FIELDS = {
    "oldest_first": "embedded_at",
    "lambda_orth": "key_lambda_orth",
    "uncertainty": "key_uncertainty",
}


def save_centres(path: Path, centres: np.ndarray) -> None:
    """Keep a collection's centres (``.npy``, written atomically) for the rows written into it later."""
    from compat.io import atomic_write

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:  # a handle: np.save would add ".npy" to the temporary name
            np.save(handle, np.asarray(centres, dtype=np.float32))

    atomic_write(path, write)


def load_centres(path: str | Path | None) -> np.ndarray | None:
    """A collection's centres (None: it has none, its rows get no score)."""
    return np.load(path, allow_pickle=False) if path and Path(path).is_file() else None


def _literal(value: Any) -> str:
    """A number as a filter literal equal to the stored value (float32 keys read back exactly)."""
    return str(int(value)) if isinstance(value, (int, np.integer)) else repr(float(np.float32(value)))


@dataclass(frozen=True)
class Selection:
    """The items of the first stages of a rollout's order, as filters (see the module doc).

    ``cuts[j]`` is the ``(key, order_key)`` pair below which the first ``fractions[j]`` of the gallery lie
    (None: the whole gallery); ``offset`` starts the ``random`` window."""

    policy: str
    fractions: tuple[float, ...]
    offset: int = 0
    cuts: tuple[tuple[float | int, int] | None, ...] = ()

    @classmethod
    def of(cls, order: Mapping[str, Any], fractions: Sequence[float]) -> Selection:
        """The selection a rollout state's ``order`` record describes."""
        cuts = tuple(None if c is None else (c[0], int(c[1])) for c in order.get("cuts") or ())
        return cls(order["policy"], tuple(fractions), int(order.get("offset") or 0), cuts)

    def to_record(self) -> dict[str, Any]:
        return {"offset": self.offset, "cuts": [None if c is None else list(c) for c in self.cuts]}

    def upto(self, j: int) -> str:
        """A filter for the items of stages ``1..j`` (``j`` = 0: none; the last stage: every item)."""
        if j <= 0:
            return "order_key < 0"
        if self.policy == "random":
            return _window(self.offset, round(self.fractions[j - 1] * KEY_SPACE))
        cut = self.cuts[j - 1]
        if cut is None:
            return "order_key >= 0"
        field, value = KEY_FIELDS[self.policy], _literal(cut[0])
        return f"({field} < {value} or ({field} == {value} and order_key < {cut[1]}))"

    def _random_window(self, j: int) -> tuple[int, int]:
        """Where stage ``j``'s ``order_key`` window starts past the offset, and its width (``random``)."""
        lo = round(self.fractions[j - 2] * KEY_SPACE) if j > 1 else 0
        return lo, round(self.fractions[j - 1] * KEY_SPACE) - lo

    def stage(self, j: int) -> str:
        """A filter for the items of stage ``j`` alone."""
        if self.policy == "random":
            lo, width = self._random_window(j)
            return _window(self.offset + lo, width)
        return self.upto(j) if j == 1 else f"({self.upto(j)}) and not ({self.upto(j - 1)})"

    def slices(self, j: int, n: int) -> list[str]:
        """Stage ``j`` as ``n`` filters that split its items by ``order_key`` (for ``random``: its window cut
        into ``n`` windows), disjoint and together the whole stage."""
        if self.policy == "random":
            lo, width = self._random_window(j)
            edges = [lo + width * i // n for i in range(n + 1)]
            return [_window(self.offset + a, b - a) for a, b in zip(edges, edges[1:], strict=False)]
        stage = self.stage(j)
        return [
            f"({stage}) and {_window(KEY_SPACE * i // n, KEY_SPACE * (i + 1) // n - KEY_SPACE * i // n)}"
            for i in range(n)
        ]


def sample_filter(n_items: int, rows: int = SAMPLE_ROWS) -> str:
    """A filter matching about ``rows`` of a collection of ``n_items``, uniformly by hash."""
    if n_items <= rows:
        return "order_key >= 0"
    return f"order_key < {math.ceil(KEY_SPACE * rows / n_items)}"


def plan_selection(
    policy: str, fractions: Sequence[float], seed: int, sample: Sequence[Mapping[str, Any]]
) -> Selection:
    """The :class:`Selection` of ``policy``: ``random`` from ``seed`` alone; the others with their cuts placed
    on ``sample`` (rows with ``order_key`` and the order's key field)."""
    if policy == "random":
        offset = int(order_keys([f"compatflow-random-order-{seed}"])[0])
        return Selection(policy, tuple(fractions), offset)
    field = KEY_FIELDS[policy]
    pairs = sorted((r.get(field) or 0, int(r["order_key"])) for r in sample)
    cuts = []
    for f in fractions:
        i = int(round(f * len(pairs)))
        cuts.append(None if f >= 1.0 or i >= len(pairs) else pairs[i])
    return Selection(policy, tuple(fractions), 0, tuple(cuts))
