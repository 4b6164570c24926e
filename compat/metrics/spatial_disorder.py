"""Spatial Disorder diagnostics between two models on the same data (Mod-X paper, Sec 3.2 and App B.2).

All inputs are L2-normalised embeddings of the same N samples (row ``a`` of every matrix is sample ``a``),
one caption per image. Angles are in degrees. Histograms are percentages per bin, bins right-closed with the
first bin closed on both sides: ``[e0, e1], (e1, e2], ...`` as in the paper's tables.

- RAM, rotation angle matrix (Sec 3.2.2): ``theta_RAM(a) = angle(V_old^a, V_new^a)`` per sample, per modality.
- SAM, self-angle matrix (Sec 3.2.1): ``SAM^{(a,b)} = arccos(<V^a, V^b>)``; its change between the two models
  ``|SAM_old^{(a,b)} - SAM_new^{(a,b)}|`` over all unordered pairs ``a < b``, per modality.
- ImAV, inter-modal angle variation (App B.2): ``|angle(V_new^a, L_new^a) - angle(V_old^a, L_old^a)|``
  over the samples the old model retrieves correctly (default: image-to-text top-1 among the N paired texts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

RAM_BINS: tuple[float, ...] = (0.0, 15.0, 20.0, 25.0, 30.0, 180.0)
SAM_BINS: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 180.0)
IMAV_BINS: tuple[float, ...] = SAM_BINS


def bin_labels(edges: Sequence[float]) -> list[str]:
    """Paper-style labels: ``[0,15]``, ``(15,20]``, ..."""
    fmt = "{:g}".format
    return [f"[{fmt(edges[0])},{fmt(edges[1])}]"] + [
        f"({fmt(a)},{fmt(b)}]" for a, b in zip(edges[1:-1], edges[2:], strict=True)
    ]


def _bin_counts(angles: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    inner = torch.tensor(list(edges[1:-1]), dtype=angles.dtype, device=angles.device)
    idx = torch.bucketize(angles.reshape(-1), inner, right=False)  # edges[i-1] < x <= edges[i]
    return torch.bincount(idx, minlength=len(edges) - 1).cpu()


def angle_histogram(angles: torch.Tensor, edges: Sequence[float]) -> list[float]:
    """Percent of ``angles`` in each bin ``[e0,e1], (e1,e2], ...``."""
    angles = torch.as_tensor(angles, dtype=torch.float64)
    if angles.numel() == 0:
        return [0.0] * (len(edges) - 1)
    return (100.0 * _bin_counts(angles, edges).double() / angles.numel()).tolist()


def _unit64(x: torch.Tensor, name: str) -> torch.Tensor:
    x = torch.as_tensor(x).detach().to(torch.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
    norms = x.norm(dim=1)
    if not torch.isfinite(norms).all() or (norms - 1).abs().max() > 1e-2:
        raise ValueError(f"{name}: rows must be finite and L2-normalised")
    return x / norms[:, None]


def _angles(dots: torch.Tensor) -> torch.Tensor:
    return torch.rad2deg(torch.arccos(dots.clamp(-1.0, 1.0)))


def rotation_angles(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``theta_RAM``: the angle in degrees between each sample's old and new embedding ([N]).

    The two models must share the embedding space's dimension (same architecture across phases).
    """
    old, new = _unit64(old, "old embeddings"), _unit64(new, "new embeddings")
    if old.shape != new.shape:
        raise ValueError(
            f"old {tuple(old.shape)} and new {tuple(new.shape)} embeddings must have the same shape"
        )
    return _angles((old * new).sum(dim=1))


def sam_change_histogram(
    old: torch.Tensor, new: torch.Tensor, edges: Sequence[float] = SAM_BINS, chunk: int = 2048
) -> list[float]:
    """Histogram of ``|SAM_old^{(a,b)} - SAM_new^{(a,b)}|`` over all pairs ``a < b`` (one modality).

    Works row block by row block, so N = 5000 (12.5M pairs) never materialises more than ``chunk x N`` angles.
    The dimensions of the two models may differ: SAM compares angles within each space.
    """
    old, new = _unit64(old, "old embeddings"), _unit64(new, "new embeddings")
    if old.shape[0] != new.shape[0]:
        raise ValueError(f"old ({old.shape[0]}) and new ({new.shape[0]}) embeddings cover different samples")
    n = old.shape[0]
    if n < 2:
        raise ValueError("SAM needs at least 2 samples")
    counts = torch.zeros(len(edges) - 1, dtype=torch.long)
    for a0 in range(0, n, chunk):
        a1 = min(a0 + chunk, n)
        change = (_angles(old[a0:a1] @ old.T) - _angles(new[a0:a1] @ new.T)).abs()
        rows = torch.arange(a0, a1)[:, None]
        upper = torch.arange(n)[None, :] > rows  # pairs a < b only
        counts += _bin_counts(change[upper], edges)
    total = n * (n - 1) // 2
    return (100.0 * counts.double() / total).tolist()


def correctly_retrieved(image: torch.Tensor, text: torch.Tensor, direction: str = "i2t") -> torch.Tensor:
    """Bool [N]: sample ``a`` is retrieved correctly at top-1 among the N pairs (``i2t``/``t2i``/``both``).

    Ties count as failures (the same pessimistic rule as :func:`compat.metrics.recall_at_k`).
    """
    image, text = _unit64(image, "image embeddings"), _unit64(text, "text embeddings")
    sims = image @ text.T
    off = sims.clone().fill_diagonal_(-torch.inf)
    i2t, t2i = sims.diagonal() > off.max(dim=1).values, sims.diagonal() > off.max(dim=0).values
    if direction not in ("i2t", "t2i", "both"):
        raise ValueError(f"direction must be 'i2t', 't2i' or 'both', got {direction!r}")
    return {"i2t": i2t, "t2i": t2i, "both": i2t & t2i}[direction]


def imav_angles(
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``|angle(V_new^a, L_new^a) - angle(V_old^a, L_old^a)|`` for the samples in ``mask`` (default: all)."""
    old_inter = rotation_angles(old_image, old_text)
    new_inter = rotation_angles(new_image, new_text)
    if old_inter.shape != new_inter.shape:
        raise ValueError("old and new embeddings cover different samples")
    change = (new_inter - old_inter).abs()
    return change if mask is None else change[torch.as_tensor(mask, dtype=torch.bool)]


def spatial_disorder(
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    new_image: torch.Tensor,
    new_text: torch.Tensor,
    imav_direction: str = "i2t",
) -> dict:
    """RAM, SAM and ImAV histograms (percent) of the move from the old model to the new one, same data."""
    correct = correctly_retrieved(old_image, old_text, imav_direction)
    imav = imav_angles(old_image, old_text, new_image, new_text, correct)
    ram_img, ram_txt = rotation_angles(old_image, new_image), rotation_angles(old_text, new_text)
    return {
        "n_samples": int(ram_img.shape[0]),
        "bins": {"ram": bin_labels(RAM_BINS), "sam": bin_labels(SAM_BINS), "imav": bin_labels(IMAV_BINS)},
        "ram": {"image": angle_histogram(ram_img, RAM_BINS), "text": angle_histogram(ram_txt, RAM_BINS)},
        "ram_mean_deg": {"image": float(ram_img.mean()), "text": float(ram_txt.mean())},
        "sam": {
            "image": sam_change_histogram(old_image, new_image),
            "text": sam_change_histogram(old_text, new_text),
        },
        "imav": angle_histogram(imav, IMAV_BINS),
        "imav_samples": int(correct.sum()),
        "imav_direction": imav_direction,
    }
