"""``lambda_orth``: lambda-orthogonality regularisation for compatible representations (Ricci et al.).

Both backbones stay frozen; two small maps are trained on pre-extracted embeddings (cached once):

- backward adapter ``B`` (new -> old space), strict ``B_perp = exp(P)``, ``P`` skew-symmetric (Sec. 3.2), or
  relaxed ``B_lambda(x) = W x + b`` regularised by :func:`lambda_orth_penalty` (Eq. 6, weight 1, App. F);
- forward adapter ``F`` (affine, old -> the backward-aligned new space) for old gallery vectors (Sec. 3.4).

Losses: ``L_B = ||B(h_t) - h_k||^2`` (Eq. 2), ``L_F = ||F(h_k) - B(h_t)||^2`` (Eq. 7),
``L_C = L_contr(F(h_k), B(h_t)) + L_contr(F(h_k), h_k)`` (Eq. 9) and
``L = w1 L_F + w2 L_B + w3 L_C + L_lambda``
(Eq. 10). Serving: queries ``B(h_t)``; old gallery vectors read through ``F`` (the paper's gallery ``F(h_k)``)
or as they are (``B(h_t)/h_k``, the ECC entry of its tables); re-embedded items ``B(h_t)``. Backfill order:
distance of ``F(h_k)`` to its class / cluster mean, farthest first (Sec. 3.6) -- :func:`backfill_scores`.

Choices where the paper is silent or ambiguous (the digest lists them):

- Unlabelled image-text form of Eq. 8/9 (App. H: "reduces to an unsupervised contrastive loss, similar to
  CLIP"): the positives of an anchor are its own pair's item of the *other modality*, the candidates the
  batch's items of that modality; symmetrised as CLIP's loss, temperature ``temperature`` (unspecified; 0.07,
  CLIP's initial value): ``L_contr(F(h_k), X) = 1/2 [clip(F(v_k), X_text) + clip(F(w_k), X_image)]``.
- Dimension mismatch: the wider side is truncated to its first ``m = min(d, n)`` coordinates (Sec. 3.2;
  which coordinates is unspecified -- the prefix), then re-normalised: CLIP embeddings are compared by cosine.
  ``F`` reads the whole old vector (R^d -> R^m; only the square ``B`` needs truncation).
- No stop-gradient in ``L_F`` (Eq. 7 as written; ``F`` and ``B`` are "trained jointly").
- Initialisation (unspecified): ``B = I``, ``F`` = the prefix map (identity on the first ``m`` coordinates),
  biases zero. ``alpha`` (unspecified) defaults to 10; ``lambda`` to the paper's 12; ``w1 = w2 = w3 = 1``.
- ``variant="fct"`` is the paper's FCT baseline (Ramanujan et al. 2022): no ``B``, ``F`` trained with MSE to
  ``h_t``, queries are the raw new embeddings.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import nn

from compat.device import resolve_device
from compat.losses import clip_loss
from compat.methods import register_method
from compat.methods.base import CompatMethod
from compat.methods.config import MethodConfig
from compat.methods.contract import Batch, CompatError, Encoder, ServingContract
from compat.methods.layers import OrthogonalMatrix, truncate
from compat.methods.model import CompatModel, Parts, Tensors
from compat.methods.training import TrainingLog, freeze, frozen_features, minibatches
from compat.models import ClipBundle
from compat.progress import track

VARIANTS = ("strict", "relaxed", "fct")


def lambda_orth_penalty(W: torch.Tensor, lam: float, alpha: float) -> torch.Tensor:
    """lambda-orthogonality regulariser, Eq. 6: ``sigmoid(alpha (||W W^T - I||_F - lam)) * ||W W^T - I||_F``.

    The Frobenius norm itself (not squared). As ``alpha`` grows the sigmoid tends to the Heaviside step of
    Eq. 5 (no penalty below ``lam``); ``lam = 0`` approximates the soft-orthogonality loss of Eq. 3. The norm
    is computed with a floor of 1e-12 so that its gradient stays finite at an exactly orthogonal ``W``.
    """
    if W.ndim != 2:
        raise ValueError(f"lambda_orth_penalty: W must be a matrix, got shape {tuple(W.shape)}")
    gram = W @ W.T - torch.eye(W.shape[0], dtype=W.dtype, device=W.device)
    norm = gram.pow(2).sum().clamp_min(1e-24).sqrt()
    return torch.sigmoid(alpha * (norm - lam)) * norm


def prefix_linear(in_dim: int, out_dim: int) -> nn.Linear:
    """An affine map initialised to the prefix map: identity on the first ``min(in, out)`` coordinates."""
    layer = nn.Linear(in_dim, out_dim)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(out_dim, in_dim))
        layer.bias.zero_()
    return layer


class BackwardAdapter(nn.Module):
    """``B``: strict (``exp`` of a skew-symmetric matrix, no bias) or relaxed (affine ``W x + b``), on R^m."""

    def __init__(self, dim: int, strict: bool) -> None:
        super().__init__()
        self.dim, self.strict = int(dim), bool(strict)
        if strict:
            self.orth = OrthogonalMatrix(dim)
        else:
            self.linear = prefix_linear(dim, dim)

    def weight(self) -> torch.Tensor:
        return self.orth.matrix() if self.strict else self.linear.weight

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``B x`` per row; pass ``weight`` (from :meth:`weight`) to reuse one matrix exponential."""
        w = self.weight() if weight is None else weight
        return x @ w.T if self.strict else nn.functional.linear(x, w, self.linear.bias)

    def num_trainable(self) -> int:
        return self.orth.num_trainable() if self.strict else sum(p.numel() for p in self.linear.parameters())


class Adapters(nn.Module):
    """``B`` (absent for the FCT variant) and ``F``; ``dim`` is the serving dimension."""

    def __init__(self, variant: str, old_dim: int, new_dim: int) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise CompatError(f"lambda_orth: variant {variant!r} is not one of {VARIANTS}")
        self.variant, self.old_dim, self.new_dim = variant, int(old_dim), int(new_dim)
        self.dim = self.new_dim if variant == "fct" else min(self.old_dim, self.new_dim)
        self.backward = None if variant == "fct" else BackwardAdapter(self.dim, strict=variant == "strict")
        self.forward_map = prefix_linear(self.old_dim, self.dim)

    def queries(self, new: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``B(h_t)`` on the (truncated, re-normalised) new embedding; raw ``h_t`` for FCT."""
        return new if self.backward is None else self.backward(truncate(new, self.dim), weight)

    def forward(self, old: torch.Tensor) -> torch.Tensor:
        """``F(h_k)``."""
        return self.forward_map(old)

    def num_trainable(self) -> int:
        b = 0 if self.backward is None else self.backward.num_trainable()
        return b + sum(p.numel() for p in self.forward_map.parameters())


@dataclass
class PairedFeatures:
    """Frozen, L2-normalised embeddings of the same N image-text pairs by the old and the new model."""

    old_image: torch.Tensor
    old_text: torch.Tensor
    new_image: torch.Tensor
    new_text: torch.Tensor

    def __post_init__(self) -> None:
        n = self.old_image.shape[0]
        if n == 0 or any(t.shape[0] != n for t in (self.old_text, self.new_image, self.new_text)):
            raise CompatError(
                "PairedFeatures: the four feature matrices must be non-empty with one row per pair"
            )

    def __len__(self) -> int:
        return int(self.old_image.shape[0])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PairedFeatures:
        return PairedFeatures(fn(self.old_image), fn(self.old_text), fn(self.new_image), fn(self.new_text))


class LambdaOrthTerms(NamedTuple):
    total: torch.Tensor
    forward: torch.Tensor
    backward: torch.Tensor
    contrastive: torch.Tensor
    penalty: torch.Tensor


def _sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``||a - b||_2^2`` (Eq. 2 / Eq. 7 per sample, averaged over the batch)."""
    return (a - b).pow(2).sum(dim=-1).mean()


def paired_contrastive(
    anchor_image: torch.Tensor,
    anchor_text: torch.Tensor,
    cand_image: torch.Tensor,
    cand_text: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Unlabelled image-text ``L_contr(a, c)``: ``1/2 [clip(a_img, c_txt) + clip(c_img, a_txt)]``."""
    scale = 1.0 / temperature
    a_i, a_t = F.normalize(anchor_image, dim=-1), F.normalize(anchor_text, dim=-1)
    c_i, c_t = F.normalize(cand_image, dim=-1), F.normalize(cand_text, dim=-1)
    return (clip_loss(a_i, c_t, scale) + clip_loss(c_i, a_t, scale)) / 2


def lambda_orth_losses(
    adapters: Adapters, feats: PairedFeatures, config: LambdaOrthConfig | None = None, **settings: float
) -> LambdaOrthTerms:
    """Eq. 10 on a batch of cached features: ``w1 L_F + w2 L_B + w3 L_C + L_lambda`` (FCT: ``L_F`` to h_t).

    The weights, ``lam``, ``alpha`` and ``temperature`` are ``config``'s (default: ``settings`` over the
    defaults of :class:`LambdaOrthConfig`)."""
    c = config or LambdaOrthConfig(**settings)
    old_img, old_txt = feats.old_image, feats.old_text
    f_img, f_txt = adapters(old_img), adapters(old_txt)
    zero = f_img.new_zeros(())
    if adapters.backward is None:  # FCT: F(h_k) regressed on h_t
        forward = (_sq_dist(f_img, feats.new_image) + _sq_dist(f_txt, feats.new_text)) / 2
        return LambdaOrthTerms(forward, forward, zero, zero, zero)
    m = adapters.dim
    weight = adapters.backward.weight()
    b_img, b_txt = adapters.queries(feats.new_image, weight), adapters.queries(feats.new_text, weight)
    k_img, k_txt = truncate(old_img, m), truncate(old_txt, m)
    backward = (_sq_dist(b_img, k_img) + _sq_dist(b_txt, k_txt)) / 2
    forward = (_sq_dist(f_img, b_img) + _sq_dist(f_txt, b_txt)) / 2
    contrastive = paired_contrastive(f_img, f_txt, b_img, b_txt, c.temperature) + paired_contrastive(
        f_img, f_txt, k_img, k_txt, c.temperature
    )
    penalty = zero if adapters.backward.strict else lambda_orth_penalty(weight, c.lam, c.alpha)
    total = c.w_forward * forward + c.w_backward * backward + c.w_contrastive * contrastive + penalty
    return LambdaOrthTerms(total, forward, backward, contrastive, penalty)


@dataclass
class LambdaOrthConfig(MethodConfig):
    """lambda-orth settings: Adam, lr 1e-3 (Sec. 4.3), lambda = 12 (downstream setting), weight 1 on L_lambda.

    ``batch_size`` is the minibatch of cached feature pairs; ``max_items`` caps how many pairs are cached
    (None: one pass over the given batches). ``old_vector_rule``: ``forward_adapter`` (gallery ``F(h_k)``)
    or ``as_is`` (gallery ``h_k``; becomes ``truncate`` when the old embedding is wider than the serving one).
    """

    steps: int = 2000
    lr: float = 1e-3
    batch_size: int = 256
    variant: str = "strict"
    lam: float = 12.0
    alpha: float = 10.0
    w_forward: float = 1.0
    w_backward: float = 1.0
    w_contrastive: float = 1.0
    temperature: float = 0.07
    max_items: int | None = None
    old_vector_rule: str = "forward_adapter"

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.old_vector_rule not in ("forward_adapter", "as_is"):
            raise ValueError(
                f"old_vector_rule must be 'forward_adapter' or 'as_is', got {self.old_vector_rule!r}"
            )
        if self.variant == "fct" and self.old_vector_rule != "forward_adapter":
            raise ValueError(
                "the FCT variant reads old vectors only through F (old_vector_rule: forward_adapter)"
            )
        if self.steps < 1 or self.batch_size < 2 or self.lr <= 0 or self.temperature <= 0:
            raise ValueError("steps >= 1, batch_size >= 2, lr > 0 and temperature > 0 are required")


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run small-matrix work on one CPU thread: on a shared machine, threads only add contention there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@single_threaded()
def fit_adapters(
    feats: PairedFeatures, config: LambdaOrthConfig, old_dim: int, new_dim: int
) -> tuple[Adapters, dict[str, Any]]:
    """Train ``B`` and ``F`` on cached features with Adam (Sec. 4.3); return them and the training log."""
    device = resolve_device(config.device)
    adapters = Adapters(config.variant, old_dim, new_dim).to(device)
    feats = feats.map(lambda t: t.to(device).float())
    optimizer = torch.optim.Adam(adapters.parameters(), lr=config.lr)
    n = len(feats)
    batches = minibatches(n, min(config.batch_size, n), torch.Generator().manual_seed(config.seed))
    history = TrainingLog("lambda_orth adapters", config.log_every, f"lr ({config.lr})")
    for step, idx in history.track(itertools.islice(batches, config.steps), config.steps):
        terms = lambda_orth_losses(adapters, feats.map(itemgetter(idx.to(device))), config)
        history.step(optimizer, step, **terms._asdict())
    adapters.eval().cpu()
    info = history.finish(cached_pairs=n)
    if adapters.backward is not None:
        with torch.no_grad():
            w = adapters.backward.weight()
            info["final_orthogonality_gap"] = float(torch.linalg.matrix_norm(w @ w.T - torch.eye(w.shape[0])))
    return adapters, info


def cache_features(
    new: Encoder, old: Encoder, batches: Iterable[Batch], device: torch.device, max_items: int | None = None
) -> PairedFeatures:
    """One pass over ``batches``: the frozen old and new embeddings of every pair (up to ``max_items``)."""
    parts: list[list[torch.Tensor]] = []  # old image, old text, new image, new text of each batch
    count = 0
    for batch in track(batches, "lambda_orth: caching features"):
        parts.append(
            [t.cpu() for t in (*frozen_features(old, batch, device), *frozen_features(new, batch, device))]
        )
        count += parts[-1][0].shape[0]
        if max_items is not None and count >= max_items:
            break
    if not parts:
        raise CompatError("lambda_orth: the training data produced no batch; nothing to cache")
    return PairedFeatures(*(torch.cat(column)[:max_items] for column in zip(*parts, strict=True)))


def backfill_scores(
    forward_vectors: torch.Tensor,
    labels: torch.Tensor | None = None,
    n_clusters: int | None = None,
    seed: int = 0,
    metric: str = "l2",
) -> torch.Tensor:
    """Sec. 3.6 score of every gallery item: ``||F(h_k) - mu_c||_2``, ``mu_c`` the mean of its class.

    ``forward_vectors`` are the forward-adapted old gallery vectors ``F(h_k)``. Without class ``labels``
    (an unlabelled image-text gallery) the classes are k-means clusters of ``F(h_k)`` (``n_clusters``,
    default :func:`compat.backfill.default_n_clusters`); ``metric="cosine"`` is App. G's variant. Larger
    scores are backfilled first; the ordering policy itself belongs to :mod:`compat.backfill`.
    """
    from compat import backfill

    x = forward_vectors.detach().double().cpu().numpy()
    if labels is None:
        _, labels = backfill.kmeans(x, n_clusters or backfill.default_n_clusters(x.shape[0]), seed=seed)
    else:
        labels = torch.as_tensor(labels).cpu().numpy()
    return torch.from_numpy(backfill.class_mean_distances(x, labels, metric=metric)).float()


class LambdaOrthModel(CompatModel):
    """The frozen new model behind ``B`` (queries) with ``F`` for old gallery vectors."""

    def __init__(
        self, new: ClipBundle, adapters: Adapters, contract: ServingContract, config: LambdaOrthConfig
    ) -> None:
        super().__init__(contract, config)
        self.new, self.adapters = new, adapters.eval()

    @property
    def image_size(self) -> int:
        return self.new.image_size

    @property
    def logit_scale(self) -> float:
        return 1.0 / float(self.config.temperature)

    def _serve(self, raw: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(self.adapters.queries(raw.float()), dim=-1)

    def encode_images(self, images: Any, batch_size: int = 256, device: Any = None) -> torch.Tensor:
        return self._serve(self.new.encode_images(images, batch_size=batch_size, device=device))

    def encode_texts(self, texts: list[str], batch_size: int = 256, device: Any = None) -> torch.Tensor:
        return self._serve(self.new.encode_texts(texts, batch_size=batch_size, device=device))

    def forward_adapter(self, old_vectors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.adapters(old_vectors.float())

    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, dict | None]]:
        return {"new": (self.new, None)}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return dict(self.adapters.state_dict())

    @classmethod
    def restore(cls, parts: Parts, adapters: Tensors, config: Any, contract: ServingContract) -> Self:
        module = Adapters(config.variant, contract.old_dim, parts["new"].embed_dim)
        try:
            module.load_state_dict(adapters, strict=True)
        except RuntimeError as exc:
            raise CompatError(f"lambda_orth adapters do not fit the saved configuration: {exc}") from exc
        return cls(parts["new"], module, contract, config)


@register_method("lambda_orth")
class LambdaOrth(CompatMethod):
    """Backward (``B``) and forward (``F``) adapters on frozen, cached embeddings."""

    config_class = LambdaOrthConfig
    model_class = LambdaOrthModel

    def train(
        self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: LambdaOrthConfig
    ) -> LambdaOrthModel:
        device = resolve_device(config.device)
        freeze(new, device)
        freeze(old, device)
        feats = cache_features(new, old, batches, device, config.max_items)
        old_dim, new_dim = feats.old_image.shape[1], feats.new_image.shape[1]
        adapters, info = fit_adapters(feats, config, old_dim, new_dim)
        return self.assemble(new, adapters, config, info)

    def assemble(
        self, new: ClipBundle, adapters: Adapters, config: LambdaOrthConfig, info: dict[str, Any]
    ) -> LambdaOrthModel:
        """The serving model of trained adapters (its contract follows ``config.old_vector_rule``)."""
        rule = config.old_vector_rule
        if rule == "as_is" and adapters.old_dim != adapters.dim:
            rule = "truncate"
        contract = self.contract(config, adapters.dim, adapters.old_dim, rule)
        return LambdaOrthModel(new, adapters, contract, config).trained(adapters.num_trainable(), info)
