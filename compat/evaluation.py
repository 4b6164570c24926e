"""The compatibility matrix, its bootstrap intervals and the empirical compatibility criterion (ECC).

Pairs are named "query model/gallery model". With the old (production) and new (candidate) encoders on the
same evaluation set, in both directions (``t2i``: every caption queries the images, one relevant image;
``i2t``: every image queries the captions, a hit when any of its captions is in the top K):

- ``old/old``  old queries, old gallery (what production serves today);
- ``new/old``  new queries against the old gallery, read through the serving contract
  (:meth:`compat.methods.model.CompatModel.read_old_gallery`: as is, forward adapter, zero-pad, truncation);
- ``new/new``  new queries, gallery re-embedded by the new model's serving encoders.

ECC (lambda-orth Eq. 11, XBT Eq. 2): ``M(new, old) > M(old, old)`` per direction and K. Each margin
``new/old - old/old`` gets a paired percentile-bootstrap interval: queries are resampled with replacement
and both pairs are scored on the same resample (the units are the queries -- captions for t2i, images for
i2t; the captions of one image are not resampled as a block). Recall values are percentages; ranking
ties count against the query, as in :mod:`compat.metrics.retrieval`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from compat.metrics.retrieval import DEFAULT_KS, retrieval_hits

if TYPE_CHECKING:  # pragma: no cover
    from compat.data.loader import CaptionedSet
    from compat.methods.contract import Encoder
    from compat.methods.model import CompatModel

DIRECTIONS = ("t2i", "i2t")
PAIRS = ("old/old", "new/old", "new/new")
REPORT_SCHEMA = "compat_report"
ReadOld = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def metric_name(k: int) -> str:
    return f"R@{k}"


def _as_is(queries: torch.Tensor, gallery: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.normalize(queries.float(), dim=-1), F.normalize(gallery.float(), dim=-1)


def compatibility_hits(
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    captions_per_image: Sequence[int],
    read_old: ReadOld | None = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, dict[str, torch.Tensor]]:
    """Hits of every pair: ``{pair: {direction: [Q, K]}}``. ``read_old(queries, old_vectors)`` applies the
    serving contract for ``new/old`` (default: both sides as they are)."""
    read_old = read_old or _as_is
    old_i, old_t = F.normalize(old_image.float(), dim=-1), F.normalize(old_text.float(), dim=-1)
    new_i, new_t = F.normalize(new_image.float(), dim=-1), F.normalize(new_text.float(), dim=-1)
    q_t, g_i = read_old(new_t, old_i)
    q_i, g_t = read_old(new_i, old_t)
    return {
        "old/old": retrieval_hits(old_i, old_t, old_i, old_t, captions_per_image, ks),
        "new/old": retrieval_hits(q_i, q_t, g_i, g_t, captions_per_image, ks),
        "new/new": retrieval_hits(new_i, new_t, new_i, new_t, captions_per_image, ks),
    }


def recalls(hits: torch.Tensor, ks: Sequence[int]) -> dict[str, float]:
    """``{"R@K": percent}`` from per-query hits [Q, K]."""
    means = hits.float().mean(dim=0) * 100
    return {metric_name(k): round(float(means[j]), 4) for j, k in enumerate(ks)}


def paired_bootstrap(
    hits_a: torch.Tensor,
    hits_b: torch.Tensor,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    max_block: int = 1 << 22,
) -> list[dict[str, Any]]:
    """Percentile-bootstrap intervals of ``mean(a) - mean(b)`` (in points) per column of paired hits [Q, K].

    Both pairs are evaluated on the same resample of the queries (a paired bootstrap); the same resamples
    serve every column. Returns one ``{"margin", "ci_low", "ci_high", "confidence", "n_bootstrap"}`` per K.
    """
    if hits_a.shape != hits_b.shape or hits_a.ndim != 2 or hits_a.shape[0] == 0:
        raise ValueError(
            f"paired_bootstrap: paired hits must be equal non-empty [Q, K] matrices, got "
            f"{tuple(hits_a.shape)} and {tuple(hits_b.shape)}"
        )
    if n_bootstrap < 1 or not 0 < confidence < 1:
        raise ValueError(
            f"paired_bootstrap: n_bootstrap >= 1 and 0 < confidence < 1 required, got {n_bootstrap}, "
            f"{confidence}"
        )
    diff = (hits_a.float() - hits_b.float()) * 100
    n_q = diff.shape[0]
    generator = torch.Generator().manual_seed(int(seed))
    per_block = max(1, max_block // n_q)
    means = []
    for start in range(0, n_bootstrap, per_block):
        count = min(per_block, n_bootstrap - start)
        idx = torch.randint(n_q, (count, n_q), generator=generator)
        means.append(diff[idx].mean(dim=1))
    dist = torch.cat(means).double()
    tail = (1 - confidence) / 2
    low = torch.quantile(dist, tail, dim=0)
    high = torch.quantile(dist, 1 - tail, dim=0)
    margin = diff.double().mean(dim=0)
    return [
        {
            "margin": round(float(margin[j]), 4),
            "ci_low": round(float(low[j]), 4),
            "ci_high": round(float(high[j]), 4),
            "confidence": confidence,
            "n_bootstrap": int(n_bootstrap),
        }
        for j in range(diff.shape[1])
    ]


def report_from_hits(
    hits: dict[str, dict[str, torch.Tensor]],
    ks: Sequence[int] = DEFAULT_KS,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """``retrieval``, ``margins``, ``ecc`` and ``ecc_passed`` of a compatibility report from pair hits."""
    retrieval = {d: {pair: recalls(hits[pair][d], ks) for pair in PAIRS} for d in DIRECTIONS}
    margins: dict[str, dict[str, Any]] = {}
    ecc: dict[str, dict[str, bool]] = {}
    for i, d in enumerate(DIRECTIONS):
        pair_hits = hits["new/old"][d], hits["old/old"][d]
        intervals = paired_bootstrap(*pair_hits, n_bootstrap, confidence, seed + i)
        margins[d] = {metric_name(k): iv for k, iv in zip(ks, intervals, strict=True)}
        new_old, old_old = retrieval[d]["new/old"], retrieval[d]["old/old"]
        ecc[d] = {name: bool(new_old[name] > old_old[name]) for name in map(metric_name, ks)}
    return {
        "retrieval": retrieval,
        "margins": margins,
        "ecc": ecc,
        "ecc_passed": all(v for per in ecc.values() for v in per.values()),
    }


def flatten_captions(data: CaptionedSet) -> tuple[list[str], list[int]]:
    """All captions image by image, and the number per image."""
    if len(data) == 0:
        raise ValueError("the evaluation set is empty")
    counts = [len(c) for c in data.captions]
    if missing := [data.keys[i] for i, c in enumerate(counts) if c == 0][:5]:
        raise ValueError(f"evaluation samples without captions: {missing}")
    return [c for caps in data.captions for c in caps], counts


def compat_report(
    old: Encoder,
    new: CompatModel,
    data: CaptionedSet,
    *,
    independent: Encoder | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    batch_size: int = 256,
    device: Any = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The compatibility report of ``new`` (its serving encoders and contract) against ``old`` on ``data``.

    ``independent`` is the independently trained new model (no compatibility training): its new/new is
    reported for the retention check. ``meta`` adds top-level fields (models, method, scenario, phase).
    The result follows ``schemas/compat_report.schema.json``.
    """
    ks = sorted({int(k) for k in ks})
    captions, counts = flatten_captions(data)

    def encode(model: Encoder) -> tuple[torch.Tensor, torch.Tensor]:
        images = model.encode_images(data.images, batch_size=batch_size, device=device)
        return images, model.encode_texts(captions, batch_size=batch_size, device=device)

    hits = compatibility_hits(*encode(old), *encode(new), counts, new.read_old_gallery, ks)
    independent_recalls = None
    if independent is not None:
        ind_i, ind_t = (F.normalize(x, dim=-1) for x in encode(independent))
        ind = retrieval_hits(ind_i, ind_t, ind_i, ind_t, counts, ks)
        independent_recalls = {d: recalls(ind[d], ks) for d in DIRECTIONS}
    domains = sorted({str(m["domain"]) for m in data.metas if isinstance(m, dict) and m.get("domain")})
    sizes = {"images": len(data), "captions": len(captions), **({"domains": domains} if domains else {})}
    return {
        "schema_version": 1,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **(meta or {}),
        "method": new.contract.method,
        "serving_contract": new.contract.to_dict(),
        **report_from_hits(hits, ks, n_bootstrap, confidence, seed),
        "independent_new_new": independent_recalls,
        "eval_sizes": sizes,
        "trainable_parameters": int(new.trainable_parameters),
    }
