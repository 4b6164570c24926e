"""``none``: no compatibility training -- the independently trained new model served as it is.

This is the baseline of every compatibility paper ("Independent" / "Ind. Train."): its queries live in
their own space (``space_id`` = the new version), so the serving contract does not keep the old space and a
release of it must go blue-green. Evaluation still scores its raw vectors against the old gallery
(``as_is``, or the prefix rule when the dimensions differ), which is where the ECC is expected to fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Self

from compat.methods import register_method
from compat.methods.base import CompatMethod
from compat.methods.config import MethodConfig
from compat.methods.contract import Batch, Encoder, ServingContract
from compat.methods.model import CompatModel, Parts, Tensors
from compat.methods.training import logit_scale_of
from compat.models import ClipBundle


class PlainModel(CompatModel):
    """A CLIP bundle behind the compatibility-model interface (no adapters, nothing trained)."""

    def __init__(self, new: ClipBundle, contract: ServingContract, config: MethodConfig) -> None:
        super().__init__(contract, config)
        self.new = new

    @property
    def image_size(self) -> int:
        return self.new.image_size

    @property
    def logit_scale(self) -> float:
        return logit_scale_of(self.new)

    def serving(self) -> ClipBundle:
        return self.new

    def text_bundle(self) -> ClipBundle:
        return self.new

    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, dict | None]]:
        return {"new": (self.new, None)}

    @classmethod
    def restore(cls, parts: Parts, adapters: Tensors, config: Any, contract: ServingContract) -> Self:
        return cls(parts["new"], contract, config)


def independent_model(new: ClipBundle, old_dim: int, config: MethodConfig | None = None) -> PlainModel:
    """Wrap ``new`` as the ``none`` method would: own space, raw vectors against the old gallery."""
    config = config or MethodConfig()
    rule = "as_is" if new.embed_dim == old_dim else "truncate"
    kept = NoCompatibility().contract(config, new.embed_dim, old_dim, rule)
    return PlainModel(new, dataclasses.replace(kept, space_id=config.version), config)


@register_method("none")
class NoCompatibility(CompatMethod):
    """The new model as it is; ``fit`` trains nothing and reads no batch."""

    model_class = PlainModel

    def train(self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: Any) -> PlainModel:
        return independent_model(new, int(old.embed_dim), config).trained(0, {"steps": 0, "history": []})
