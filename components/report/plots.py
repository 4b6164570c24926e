"""Plots of the on-call report, rendered with matplotlib (Agg) to PNG bytes; ``None`` when the step's
document holds nothing to plot."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

DIRECTIONS = ("t2i", "i2t")
DIRECTION_TITLES = {"t2i": "text -> image", "i2t": "image -> text"}
METRICS = ("R@1", "R@5", "R@10")
MODELS = ("old", "new")
PASS_COLOR, FAIL_COLOR, NEUTRAL = "#1a7f37", "#cf222e", "#57606a"
NOT_SERIES = {"step", "phase", "epoch", "samples_seen", "time", "wall_s"}


def _figure(width: float, height: float) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=(width, height), dpi=110)


def _png(plt: Any, fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def training_curves(metrics: Mapping[str, Any]) -> bytes | None:
    """Every numeric series of ``metrics["curve"]`` (loss, and any others) against ``step``."""
    curve = metrics.get("curve")
    if not isinstance(curve, Sequence) or not curve:
        return None
    points = [p for p in curve if isinstance(p, Mapping) and _finite(p.get("step"))]
    names = {k for p in points for k, v in p.items() if k not in NOT_SERIES and _finite(v)}
    series = sorted(names, key=lambda name: (name != "loss", name))  # loss first
    if not points or not series:
        return None
    shown = series[:6]
    columns = min(len(shown), 3)
    rows = math.ceil(len(shown) / columns)
    plt, fig = _figure(4.2 * columns, 3.0 * rows)
    for index, name in enumerate(shown, start=1):
        ax = fig.add_subplot(rows, columns, index)
        xy = [(p["step"], p[name]) for p in points if _finite(p.get(name))]
        ax.plot([x for x, _ in xy], [y for _, y in xy], color="#0969da", linewidth=1.4)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _png(plt, fig)


def compat_heatmap(report: Mapping[str, Any], metric: str = "R@1") -> bytes | None:
    """Query model x gallery model matrix of ``metric`` for both directions, annotated."""
    retrieval = report.get("retrieval")
    if not isinstance(retrieval, Mapping):
        return None
    import numpy as np

    grids = []
    for direction in DIRECTIONS:
        pairs = retrieval.get(direction) if isinstance(retrieval.get(direction), Mapping) else {}
        values = [
            [(pairs.get(f"{query}/{gallery}") or {}).get(metric) for gallery in MODELS] for query in MODELS
        ]
        grids.append(np.array([[v if _finite(v) else np.nan for v in row] for row in values], dtype=float))
    if np.isnan(grids).all():
        return None
    vmax = max(float(np.nanmax(grids)), 1.0)
    plt, fig = _figure(8.4, 3.8)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d0d7de")
    for index, (direction, grid) in enumerate(zip(DIRECTIONS, grids, strict=True), start=1):
        ax = fig.add_subplot(1, 2, index)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=vmax)
        for i in range(2):
            for j in range(2):
                text = "n/a" if math.isnan(grid[i, j]) else f"{grid[i, j]:.1f}"
                light = not math.isnan(grid[i, j]) and grid[i, j] < 0.6 * vmax
                color = "white" if light else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=13, color=color)
        ax.set_xticks([0, 1], [f"{m} gallery" for m in MODELS])
        ax.set_yticks([0, 1], [f"{m} query" for m in MODELS])
        ax.set_title(f"{DIRECTION_TITLES[direction]}  {metric} (%)")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return _png(plt, fig)


def ecc_margins(report: Mapping[str, Any], min_margin: float = 0.0) -> bytes | None:
    """new/old - old/old margins with their bootstrap intervals, per direction and metric."""
    margins = report.get("margins")
    if not isinstance(margins, Mapping):
        return None
    rows = []
    for direction in DIRECTIONS:
        per_metric = margins.get(direction)
        if not isinstance(per_metric, Mapping):
            continue
        ordered = [m for m in METRICS if m in per_metric] + sorted(m for m in per_metric if m not in METRICS)
        for metric in ordered:
            entry = per_metric[metric]
            if isinstance(entry, Mapping) and all(
                _finite(entry.get(k)) for k in ("margin", "ci_low", "ci_high")
            ):
                rows.append((f"{direction} {metric}", entry["margin"], entry["ci_low"], entry["ci_high"]))
    if not rows:
        return None
    plt, fig = _figure(7.0, 0.5 * len(rows) + 1.4)
    ax = fig.add_subplot(1, 1, 1)
    for y, (_label, margin, low, high) in enumerate(rows):
        color = PASS_COLOR if low > 0 and margin > min_margin else FAIL_COLOR
        error = [[max(margin - low, 0)], [max(high - margin, 0)]]
        ax.errorbar(margin, y, xerr=error, fmt="o", color=color, ecolor=color, capsize=4, markersize=6)
        label = f"{margin:+.2f} [{low:+.2f}, {high:+.2f}]"
        ax.annotate(label, (high, y), xytext=(6, -3), textcoords="offset points", fontsize=8, color=NEUTRAL)
    ax.axvline(0.0, color="black", linewidth=1)
    if min_margin:
        ax.axvline(min_margin, color=NEUTRAL, linestyle="--", linewidth=1, label=f"min margin {min_margin:g}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("new/old - old/old (percentage points)")
    span = [v for r in rows for v in r[1:]] + [0.0]
    pad = 0.35 * (max(span) - min(span) or 1.0)
    ax.set_xlim(min(span) - 0.1 * pad, max(span) + pad)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("ECC margins with bootstrap intervals (green: interval above zero)")
    return _png(plt, fig)


def backfill_curve(rollout: Mapping[str, Any]) -> bytes | None:
    """The probe's R@1 on the mixed gallery against the fraction backfilled, with its floor and its new/new
    (at 100 %); the evaluation set's figures come from other queries and are not drawn here."""
    curve = rollout.get("curve")
    if not isinstance(curve, Sequence) or not curve:
        return None
    points = sorted(
        (p for p in curve if isinstance(p, Mapping) and _finite(p.get("fraction"))),
        key=lambda p: p["fraction"],
    )
    plt, fig = _figure(8.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"t2i": "#0969da", "i2t": "#bf3989"}
    plotted = False
    floors = rollout.get("floors") if isinstance(rollout.get("floors"), Mapping) else {}
    baseline = rollout.get("baseline") if isinstance(rollout.get("baseline"), Mapping) else {}
    for direction in DIRECTIONS:
        key = f"{direction}_R@1"
        xy = [(100 * p["fraction"], p[key]) for p in points if _finite(p.get(key))]
        if not xy:
            continue
        plotted = True
        label = f"{direction} R@1, probe (mixed gallery)"
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", color=colors[direction], label=label)
        if direction != "t2i":
            continue  # the probe's floors and baseline are text-to-image figures
        floor = floors.get("R@1")
        if _finite(floor):
            own = _finite(baseline.get("R@1")) and float(baseline["R@1"]) >= float(floor)
            label = "probe floor (probe old/old)" if own else "probe floor (configured)"
            ax.axhline(floor, color="#cf222e", linestyle=":", linewidth=1.2, label=label)
        full = [y for x, y in xy if x >= 100.0]
        if full:
            style = {"color": colors[direction], "linestyle": "--", "linewidth": 1, "alpha": 0.7}
            ax.axhline(full[-1], label="probe new/new", **style)
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel("gallery backfilled (%)")
    ax.set_ylabel("R@1 (%)")
    ax.set_xlim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Backfill curve")
    return _png(plt, fig)
