"""Encoder factories of rollouts: ``f(config) -> RolloutEncoders``, named by ``--encoders module:function``;
:func:`model_encoders` wires real models (``config``: ``old_model``, ``new_model`` and free-form ``options``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from components.rollout.types import ItemRef, RolloutEncoders, RolloutError, VectorTransform
from components.state.workspace import resolved_path


class ShardImages:
    """Images of gallery items addressed as ``<shard url>#<key>`` (the ``source_uri`` of indexed rows; a
    relative shard path lies under ``root``, the workspace)."""

    def __init__(self, max_shards: int = 8, image_size: int | None = None, root: str | None = None) -> None:
        self.max_shards = max_shards
        self.image_size = image_size  # images decoded to this short side when larger (the model input)
        self.root = root
        self._cache: dict[str, dict[str, Any]] = {}

    def load(self, refs: Sequence[ItemRef]) -> list[Any]:
        from compat.data.images import ImageDecodeError, read_image_file
        from compat.data.loader import load_captioned_set

        out = []
        for ref in refs:
            url, sep, key = ref.source_uri.rpartition("#")
            if not sep:  # an item of its own image file (an adopted gallery: compatflow adopt)
                try:
                    out.append(read_image_file(ref.source_uri, self.image_size))
                except (OSError, ImageDecodeError) as exc:
                    raise RolloutError(
                        f"item {ref.item_id!r}: cannot read image {ref.source_uri!r}: {exc}"
                    ) from exc
                continue
            if not url:
                raise RolloutError(
                    f"item {ref.item_id!r}: source_uri {ref.source_uri!r} is neither '<shard url>#<key>' "
                    "nor an image file"
                )
            if url not in self._cache:
                if len(self._cache) >= self.max_shards:
                    self._cache.pop(next(iter(self._cache)))
                shard = resolved_path(self.root, url) if self.root else url
                loaded = load_captioned_set(shard, image_size=self.image_size)
                self._cache[url] = dict(zip(loaded.keys, loaded.images, strict=True))
            if key not in self._cache[url]:
                raise RolloutError(f"item {ref.item_id!r}: key {key!r} is not in shard {url}")
            out.append(self._cache[url][key])
        return out


def _old_vector_transform(model: Any) -> tuple[VectorTransform | None, str]:
    """The contract's rule for stored old vectors as a stage-0 transform (None: read as they are)."""
    contract = getattr(model, "contract", None)
    if contract is None:
        return None, ""
    rule = contract.old_vector_rule
    if rule == "forward_adapter":
        import torch

        def forward(v: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                mapped = model.forward_adapter(torch.from_numpy(np.asarray(v, dtype=np.float32)))
            return torch.nn.functional.normalize(mapped.float(), dim=-1).numpy()

        return forward, f"forward_adapter:{contract.query_model_version}"
    if rule in ("zero_pad", "truncate") and contract.dim != contract.old_dim:
        # Truncating the query to k dims and zero-padding the old vector rank old items identically.
        def pad(v: np.ndarray) -> np.ndarray:
            v = np.asarray(v, dtype=np.float32)
            return np.concatenate([v, np.zeros((len(v), contract.dim - v.shape[1]), np.float32)], axis=1)

        return pad, f"zero_pad:{contract.query_model_version}"
    return None, ""


def model_encoders(config: Mapping[str, Any]) -> RolloutEncoders:
    """Encoders of real models: ``old_model`` (the serving query model) and ``new_model`` (a compatible-model
    directory, whose serving contract sets the space and the old-vector rule, or a plain checkpoint);
    ``root``: the workspace, which relative source URIs lie under."""
    from compat.production import load_encoder

    for key in ("old_model", "new_model"):
        if not config.get(key):
            raise RolloutError(f"model_encoders needs {key!r} (a model or checkpoint directory)")
    from compat.compat_training import decode_size

    old, new = load_encoder(str(config["old_model"])), load_encoder(str(config["new_model"]))
    images = ShardImages(image_size=decode_size(new), root=config.get("root"))
    transform, tag = _old_vector_transform(new)
    contract = getattr(new, "contract", None)
    return RolloutEncoders(
        old_query=lambda texts: old.encode_texts(list(texts)).numpy(),
        new_query=lambda texts: new.encode_texts(list(texts)).numpy(),
        new_gallery=lambda refs: new.encode_images(images.load(refs)).numpy(),
        gallery_transform=transform,
        transform_tag=tag,
        space=contract.space_id if contract else None,
    )
