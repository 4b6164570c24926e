"""The contract every compatibility method implements: ``get_method("bct").fit(new, old, batches, config)``.

``new`` is the candidate :class:`~compat.models.ClipBundle`; ``old`` the frozen production encoder (a bundle
or, after an earlier compatible release, a :class:`CompatModel`); ``batches`` a re-iterable of batches with
``images`` and raw ``texts``; ``config`` the method's :class:`MethodConfig` (``method.make_config(mapping)``).
The result is a :class:`CompatModel` (serving encoders, the old-gallery rule of its contract, persistence).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from compat.methods.config import MethodConfig, config_from_mapping
from compat.methods.contract import Batch, Encoder, ServingContract
from compat.methods.model import CompatModel
from compat.models import ClipBundle


class CompatMethod(ABC):
    """A compatibility-training method, listed by name in :data:`compat.methods.METHODS` and registered with
    :func:`compat.methods.register_method`; it implements :meth:`train`."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    model_class: ClassVar[type[CompatModel]]

    def make_config(self, values: Mapping[str, Any] | None = None, source: str = "config") -> MethodConfig:
        """This method's config from a mapping (unknown keys and bad types raise :class:`CompatError`)."""
        return config_from_mapping(self.config_class, values, f"{source} ({self.name})")

    def fit(
        self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: MethodConfig | None = None
    ) -> CompatModel:
        """Fit with ``old`` frozen; ``new`` is the candidate / independently trained new model. The wall time
        of the whole fit is ``training_info["seconds"]``."""
        started = time.monotonic()
        model = self.train(new, old, batches, config or self.make_config())
        model.training_info["seconds"] = round(time.monotonic() - started, 3)
        return model

    @abstractmethod
    def train(self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: Any) -> CompatModel:
        """The method's own fit, ``config`` being its :attr:`config_class`."""

    def contract(
        self, config: MethodConfig, dim: int, old_dim: int, rule: str = "as_is", old_dims: tuple = ()
    ) -> ServingContract:
        """The contract of a model that keeps the old space: ``dim``-d queries read ``old_dim`` vectors by
        ``rule``."""
        return ServingContract(
            method=self.name,
            space_id=config.old_space_id,
            dim=dim,
            old_vector_rule=rule,
            query_model_version=config.version,
            old_space_id=config.old_space_id,
            old_dim=old_dim,
            old_dims=old_dims,
        )
