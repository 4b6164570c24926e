"""The serving contract of a compatible model (its space, the rule for old gallery vectors), the
encoder and batch protocols, and the error every method raises on bad input."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch


OLD_VECTOR_RULES = ("as_is", "forward_adapter", "zero_pad", "truncate")
COMPAT_FILE = "compat.json"  # the file naming a compatible model directory: method, contract, parts


class CompatError(ValueError):
    """A compatibility model directory, contract or method configuration is malformed."""


@dataclass(frozen=True)
class ServingContract:
    """How a compatible model is served against the gallery that is live.

    - ``space_id``: the space this model's queries and re-embedded gallery items are written into. A
      compatible release keeps the old space (``space_id == old_space_id``); otherwise the rollout must go
      blue-green (fill a new collection, then switch).
    - ``dim``: dimension of the query vectors and of gallery vectors this model writes.
    - ``old_vector_rule``: how an old gallery vector ``g`` (of ``old_dim``) is scored against a query ``q``:
      ``as_is`` cos(q, g) (same dimension); ``forward_adapter`` cos(q, F(g)) with the model's forward adapter;
      ``zero_pad`` cos(q, [g; 0]); ``truncate`` cos(q[:k], g[:k]) with ``k = min(dim, dim(g))`` (BT^2's rule).
      For one query ``zero_pad`` and ``truncate`` rank old items identically; their scores differ.
    - ``old_dims``: every earlier gallery dimension the queries read by the rule (BT^2 series), newest first.
    """

    method: str
    space_id: str
    dim: int
    old_vector_rule: str
    query_model_version: str
    old_space_id: str
    old_dim: int
    old_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.old_vector_rule not in OLD_VECTOR_RULES:
            raise CompatError(
                f"ServingContract.old_vector_rule is {self.old_vector_rule!r}; "
                f"expected one of {OLD_VECTOR_RULES}"
            )
        if self.dim < 1 or self.old_dim < 1:
            raise CompatError(f"ServingContract: dim ({self.dim}) and old_dim ({self.old_dim}) must be >= 1")
        if self.old_vector_rule == "as_is" and self.dim != self.old_dim:
            raise CompatError(
                f"ServingContract: rule 'as_is' needs dim == old_dim, got {self.dim} != "
                f"{self.old_dim}; use 'zero_pad' or 'truncate'"
            )
        if self.old_vector_rule == "zero_pad" and self.old_dim > self.dim:
            raise CompatError(
                f"ServingContract: rule 'zero_pad' needs old_dim <= dim, got {self.old_dim} > "
                f"{self.dim}; use 'truncate'"
            )
        object.__setattr__(self, "old_dims", tuple(int(d) for d in (self.old_dims or (self.old_dim,))))

    @property
    def keeps_space(self) -> bool:
        """True when queries read the live gallery (a compatible release); False means blue-green."""
        return self.space_id == self.old_space_id

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["old_dims"] = list(self.old_dims)
        doc["keeps_space"] = self.keeps_space
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "<contract>") -> ServingContract:
        if not isinstance(doc, Mapping):
            raise CompatError(f"{source}: the serving contract must be a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        if missing := [n for n in names if n not in doc and n != "old_dims"]:
            raise CompatError(f"{source}: serving contract misses field(s) {missing}")
        values = {n: doc[n] for n in names if n in doc}
        values["old_dims"] = tuple(values.get("old_dims") or ())
        try:
            return cls(**values)
        except (TypeError, CompatError) as exc:
            raise CompatError(f"{source}: {exc}") from exc


class Encoder(Protocol):
    """Anything that embeds images and texts into one space: a ``ClipBundle`` or a ``CompatModel``."""

    embed_dim: int

    def encode_images(self, images: Any, batch_size: int = ..., device: Any = ...) -> torch.Tensor: ...

    def encode_texts(self, texts: list[str], batch_size: int = ..., device: Any = ...) -> torch.Tensor: ...


class Batch(Protocol):
    """A training batch: ``images`` (preprocessed [B, 3, H, W] tensor or PIL list) and raw ``texts``."""

    images: Any
    texts: list[str]
