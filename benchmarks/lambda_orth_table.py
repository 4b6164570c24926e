"""lambda-orth against FCT in the paper's own columns (Ricci et al., Tab. 1-4), on image-text retrieval.

The paper does not compare the two on the serving pair alone: its tables read

    F(old)/old | F(old)/F(old) | new-side/F(old) | B(new)/old | B(new)/B(new)   and the backfill metric M~

(query model / gallery model; "new-side" is ``B(h_t)`` for lambda-orth and the raw ``h_t`` for FCT; FCT has
no ``B``, so its B(new)/old and B(new)/B(new) are "-" as in the paper). M~ = E_{beta~U[0,1]} R@1 of the
partly backfilled gallery (Sec. 3.6, from FastFill): it starts as ``F(h_k)`` for every item and items
are replaced by ``B(h_t)`` (FCT: ``h_t``) in the method's order: lambda-orth's farthest from the cluster mean
first (Sec. 3.6; k-means clusters stand in for the classes of an unlabelled gallery), FCT's random (the
paper's FCT baseline). lambda-orth in random order is reported too: the order's share of the gain.

Everything is computed from frozen embeddings: ``old_*`` / ``new_*`` are the raw old and new models'
vectors of the same evaluation images and captions, ``adapters`` the trained maps. Recall in %, R@1 (the
multi-caption protocol of :mod:`compat.evaluation`: t2i over the images, i2t over the captions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import backfill_curves as curves
from compat.evaluation import DIRECTIONS, recalls, retrieval_hits
from compat.methods.layers import truncate
from compat.metrics.retrieval import caption_owners

COLUMNS = ("F(old)/old", "F(old)/F(old)", "new-side/F(old)", "B(new)/old", "B(new)/B(new)")


def _r1(query: tuple[torch.Tensor, torch.Tensor], gallery: tuple[torch.Tensor, torch.Tensor], counts) -> dict:
    """R@1 both ways of (query images, query texts) against (gallery images, gallery texts)."""
    q_img, q_txt = (F.normalize(x.float(), dim=-1) for x in query)
    g_img, g_txt = (F.normalize(x.float(), dim=-1) for x in gallery)
    hits = retrieval_hits(q_img, q_txt, g_img, g_txt, counts, ks=(1,))
    return {d: recalls(hits[d], (1,))["R@1"] for d in DIRECTIONS}


def backfill_area(
    queries: torch.Tensor,
    start: torch.Tensor,
    target: torch.Tensor,
    order: np.ndarray,
    owners: Sequence[int],
    fractions: Sequence[float] = curves.DEFAULT_CURVE_FRACTIONS,
) -> float:
    """M~: the trapezoid area of t2i R@1 over ``fractions`` as items move from ``start`` to ``target``."""
    metric = curves.t2i_recall_metric(queries.double().numpy(), [[i] for i in owners], ks=(1,))
    curve = curves.backfill_curve(metric, start.double().numpy(), target.double().numpy(), order, fractions)
    return curves.curve_area([p["fraction"] for p in curve], [p["R@1"] for p in curve])


def paper_columns(
    adapters: Any,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    captions_per_image: Sequence[int],
    seed: int = 0,
) -> dict[str, Any]:
    """The paper's columns (R@1 both ways, ``None`` where the method has no such pair) and M~ (t2i).

    ``adapters`` is a trained :class:`compat.methods.lambda_orth.Adapters` (``variant`` strict, relaxed or
    fct); its ``queries`` is ``B`` (identity for FCT) and its ``forward`` is ``F``.
    """
    with torch.no_grad():
        fct = adapters.variant == "fct"
        q_img, q_txt = (adapters.queries(F.normalize(x.float(), dim=-1)) for x in (new_image, new_text))
        f_img, f_txt = (adapters(F.normalize(x.float(), dim=-1)) for x in (old_image, old_text))
    counts = list(captions_per_image)
    old = (old_image, old_text)
    same_dim = f_img.shape[1] == old_image.shape[1]
    columns: dict[str, Any] = {
        "F(old)/old": _r1((f_img, f_txt), old, counts) if same_dim else None,
        "F(old)/F(old)": _r1((f_img, f_txt), (f_img, f_txt), counts),
        "new-side/F(old)": _r1((q_img, q_txt), (f_img, f_txt), counts),
        "B(new)/old": None
        if fct
        else _r1((q_img, q_txt), tuple(truncate(x.float(), adapters.dim) for x in old), counts),
        "B(new)/B(new)": None if fct else _r1((q_img, q_txt), (q_img, q_txt), counts),
    }
    owners = caption_owners(counts, old_image.shape[0])
    start, target = F.normalize(f_img, dim=-1), F.normalize(q_img, dim=-1)
    n = start.shape[0]
    random_order = curves.compute_order("random", n, seed=seed)
    areas = {"random": backfill_area(q_txt, start, target, random_order, owners)}
    if not fct:
        own = curves.compute_order("lambda_orth", n, vectors=start.double().numpy(), seed=seed)
        areas["lambda_orth"] = backfill_area(q_txt, start, target, own, owners)
    columns["M~ t2i"] = areas
    return columns


def _cell(value: dict[str, float] | None) -> str:
    return "-" if value is None else f"{value['t2i']:.1f} / {value['i2t']:.1f}"


def render(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown table of every result carrying ``paper_columns`` (one row per method)."""
    rows = [r for r in results if r.get("paper_columns")]
    if not rows:
        return []
    lines = [
        'lambda-orth and FCT in the paper\'s columns (R@1 t2i / i2t; "-": the method has no such pair, as '
        "in the paper). M~ = area under the t2i backfill curve from F(old) to the new side (21 fractions); "
        "FCT backfills in random order, lambda-orth farthest-from-its-cluster-mean first (Sec. 3.6), and in "
        "random order for comparison.",
        "",
        "| method | " + " | ".join(COLUMNS) + " | M~ t2i: own order | M~ t2i: random order |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in rows:
        cols = res["paper_columns"]
        areas = cols["M~ t2i"]
        own = areas.get("lambda_orth", areas["random"])
        lines.append(
            f"| {res['label']} | "
            + " | ".join(_cell(cols[c]) for c in COLUMNS)
            + f" | {own:.2f} | {areas['random']:.2f} |"
        )
    return lines + [""]
