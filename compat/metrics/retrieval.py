"""Cross-modal retrieval recall, with the multi-caption protocol (VSE++ / Mod-X App B: 5 captions per image).

Similarity is the dot product of L2-normalised embeddings. Recall is computed in query chunks against gallery
chunks, merging a running top-K of non-relevant scores, so a 100k x 100k evaluation never holds more than one
``query_chunk x gallery_chunk`` score block.

Tie rule (pessimistic, independent of gallery order): a non-relevant gallery item scoring exactly as high as
the best relevant item counts as ranked above it. A query is a hit at K when fewer than K non-relevant items
score at least as high as its best relevant item.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_KS: tuple[int, ...] = (1, 5, 10)


def _as_matrix(x: torch.Tensor, name: str) -> torch.Tensor:
    x = torch.as_tensor(x)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name}: contains NaN or infinite values")
    return x


def _positive_pairs(
    positives: Sequence[Sequence[int]], n_queries: int, n_gallery: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if len(positives) != n_queries:
        raise ValueError(
            f"positives: {len(positives)} lists for {n_queries} queries; give one list per query"
        )
    q_idx, g_idx = [], []
    for i, pos in enumerate(positives):
        pos = [int(p) for p in pos]
        if not pos:
            raise ValueError(f"positives[{i}] is empty: every query needs at least one relevant gallery item")
        if bad := [p for p in pos if not 0 <= p < n_gallery]:
            raise ValueError(f"positives[{i}] holds gallery indices {bad[:5]} outside [0, {n_gallery})")
        q_idx.extend([i] * len(pos))
        g_idx.extend(pos)
    return torch.tensor(q_idx, dtype=torch.long), torch.tensor(g_idx, dtype=torch.long)


def query_hits(
    queries: torch.Tensor,
    gallery: torch.Tensor,
    positives: Sequence[Sequence[int]],
    ks: Sequence[int] = DEFAULT_KS,
    *,
    query_chunk: int = 1024,
    gallery_chunk: int = 16384,
) -> torch.Tensor:
    """Per-query hits [Q, len(ks)] (bool, ``ks`` sorted): a relevant gallery item among the top K.

    ``queries`` [Q, D] and ``gallery`` [G, D] are L2-normalised (scores are dot products); ``positives[i]``
    lists the gallery indices relevant to query ``i``. Ties count against the query (see the module doc).
    """
    queries = _as_matrix(queries, "queries")
    gallery = _as_matrix(gallery, "gallery")
    if queries.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"queries have dimension {queries.shape[1]} but the gallery has {gallery.shape[1]}; "
            "both must live in the same embedding space"
        )
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    n_q, n_g = queries.shape[0], gallery.shape[0]
    pair_q, pair_g = _positive_pairs(positives, n_q, n_g)
    k_max = max(ks)
    dtype = torch.promote_types(queries.dtype, torch.float32)
    device = queries.device
    gallery = gallery.to(device=device, dtype=dtype)
    pair_q, pair_g = pair_q.to(device), pair_g.to(device)
    hits = torch.zeros(n_q, len(ks), dtype=torch.bool)
    for q0 in range(0, n_q, query_chunk):
        q1 = min(q0 + query_chunk, n_q)
        q = queries[q0:q1].to(dtype)
        in_chunk = (pair_q >= q0) & (pair_q < q1)
        cq, cg = pair_q[in_chunk] - q0, pair_g[in_chunk]
        best_pos = torch.full((q1 - q0,), -torch.inf, dtype=dtype, device=device)
        top_neg = torch.full((q1 - q0, k_max), -torch.inf, dtype=dtype, device=device)
        for g0 in range(0, n_g, gallery_chunk):
            g1 = min(g0 + gallery_chunk, n_g)
            scores = q @ gallery[g0:g1].T
            sel = (cg >= g0) & (cg < g1)
            rq, rg = cq[sel], cg[sel] - g0
            if rq.numel():
                pos_scores = scores[rq, rg]
                best_pos = best_pos.scatter_reduce(0, rq, pos_scores, reduce="amax")
                scores[rq, rg] = -torch.inf  # relevant items never count as competitors
            k = min(k_max, g1 - g0)
            merged = torch.cat([top_neg, scores.topk(k, dim=1).values], dim=1)
            top_neg = merged.topk(k_max, dim=1).values
        hits[q0:q1] = (best_pos[:, None] > top_neg[:, [k - 1 for k in ks]]).cpu()
    return hits


def _percent(hits: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    return {
        k: 100.0 * int(hits[:, j].sum()) / hits.shape[0] for j, k in enumerate(sorted({int(k) for k in ks}))
    }


def recall_at_k(
    queries: torch.Tensor,
    gallery: torch.Tensor,
    positives: Sequence[Sequence[int]],
    ks: Sequence[int] = DEFAULT_KS,
    **chunks: int,
) -> dict[int, float]:
    """Recall@K in percent: the share of queries with a relevant gallery item among the top K
    (:func:`query_hits`, which ``chunks`` sizes: ``query_chunk``, ``gallery_chunk``)."""
    return _percent(query_hits(queries, gallery, positives, ks, **chunks), ks)


def caption_owners(captions_per_image: int | Sequence[int], n_images: int) -> list[int]:
    """Image index of every caption, listed image by image (``captions_per_image``: fixed or per image)."""
    if isinstance(captions_per_image, int):
        captions_per_image = [captions_per_image] * n_images
    counts = [int(c) for c in captions_per_image]
    if len(counts) != n_images:
        raise ValueError(f"captions_per_image lists {len(counts)} counts for {n_images} images")
    if any(c < 1 for c in counts):
        raise ValueError("captions_per_image: every image needs at least one caption")
    return [i for i, c in enumerate(counts) for _ in range(c)]


def retrieval_hits(
    query_image: torch.Tensor,
    query_text: torch.Tensor,
    gallery_image: torch.Tensor,
    gallery_text: torch.Tensor,
    captions_per_image: int | Sequence[int],
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, torch.Tensor]:
    """Per-query hits both ways (:func:`query_hits`), queries from one model and the gallery from another.

    Text-to-image: every caption embedded by the query model is a query over the gallery model's images;
    its one relevant image is the one it describes. Image-to-text: every image embedded by the query model is
    a query over the gallery model's captions; a hit when any of its captions is in the top K. Captions are
    listed image by image (the rows of ``*_text``), ``captions_per_image`` per image.
    """
    n_images = int(torch.as_tensor(query_image).shape[0])
    if int(torch.as_tensor(gallery_image).shape[0]) != n_images:
        raise ValueError("query and gallery image embeddings must cover the same images")
    owners = caption_owners(captions_per_image, n_images)
    for name, t in (("query_text", query_text), ("gallery_text", gallery_text)):
        if int(torch.as_tensor(t).shape[0]) != len(owners):
            raise ValueError(
                f"{name}: {int(torch.as_tensor(t).shape[0])} caption embeddings, expected "
                f"{len(owners)} from captions_per_image"
            )
    captions_of: list[list[int]] = [[] for _ in range(n_images)]
    for c, i in enumerate(owners):
        captions_of[i].append(c)
    return {
        "t2i": query_hits(query_text, gallery_image, [[i] for i in owners], ks),
        "i2t": query_hits(query_image, gallery_text, captions_of, ks),
    }


def cross_model_retrieval(
    query_image: torch.Tensor,
    query_text: torch.Tensor,
    gallery_image: torch.Tensor,
    gallery_text: torch.Tensor,
    captions_per_image: int | Sequence[int],
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, dict[str, float]]:
    """R@K both ways of :func:`retrieval_hits` (pair "query/gallery"): ``{"t2i": {"R@1": ...}, ...}``."""
    hits = retrieval_hits(query_image, query_text, gallery_image, gallery_text, captions_per_image, ks)
    return {d: {f"R@{k}": v for k, v in _percent(h, ks).items()} for d, h in hits.items()}


def retrieval_metrics(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    captions_per_image: int | Sequence[int],
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, dict[str, float]]:
    """Multi-caption R@K of one model in both directions: ``{"t2i": {"R@1": ...}, "i2t": {...}}``."""
    return cross_model_retrieval(image_emb, text_emb, image_emb, text_emb, captions_per_image, ks)
