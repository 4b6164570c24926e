"""A compatible model: the base class of every method's result, saved as ``compat.json`` + backbone
checkpoint(s) + ``adapters.safetensors``, and loaded back whatever method made it."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F

from compat.io import read_json, utc_now
from compat.methods.config import MethodConfig, config_from_mapping
from compat.methods.contract import COMPAT_FILE, CompatError, ServingContract
from compat.methods.layers import truncate, zero_pad
from compat.models import ClipBundle, load_checkpoint, read_sidecar, save_checkpoint
from compat.models.checkpoint import sha256_file
from compat.modules.serving import original_model

COMPAT_FORMAT = "compatflow-compat-model"
ADAPTERS_FILE = "adapters.safetensors"
Parts = dict[str, ClipBundle]  # saved backbones by part name
Tensors = dict[str, torch.Tensor]


class CompatModel(ABC):
    """A fitted compatible model: serving-space encoders, the old-gallery read rule, persistence.

    Subclasses implement :meth:`serving` (or :meth:`encode_images` and :meth:`encode_texts`),
    :meth:`checkpoint_parts`, :meth:`restore` and, when they store adapters, :meth:`adapter_state`; a model
    whose rule is ``forward_adapter`` implements :meth:`forward_adapter`. Encoders return L2-normalised
    float32 CPU tensors [N, contract.dim] without gradients; they also write re-embedded gallery items.
    """

    method: ClassVar[str] = ""
    part_names: ClassVar[tuple[str, ...]] = ("new",)  # the backbones it saves (checkpoint_parts)

    def __init__(self, contract: ServingContract, config: MethodConfig) -> None:
        self.contract = contract
        self.config = config
        self.trainable_parameters: int = 0
        self.training_info: dict[str, Any] = {}

    def trained(self, parameters: int, info: dict[str, Any]) -> Self:
        """Set the count of trained parameters and the training record (saved in ``compat.json``)."""
        self.trainable_parameters, self.training_info = int(parameters), dict(info)
        return self

    @property
    def embed_dim(self) -> int:
        return self.contract.dim

    @property
    def logit_scale(self) -> float:
        """Temperature multiplier of this model's own contrastive space (used when it is the old model)."""
        return 1 / 0.07

    @property
    def image_size(self) -> int | None:
        """Input resolution of the image encoder (None when unknown)."""
        return None

    def serving(self) -> ClipBundle:
        """The bundle whose encoders are this model's (a model that post-processes overrides ``encode_*``)."""
        raise NotImplementedError(f"{type(self).__name__} defines encode_images and encode_texts itself")

    def encode_images(self, images: Any, batch_size: int = 256, device: Any = None) -> torch.Tensor:
        """Image queries (or gallery items) [N, dim] in the serving space."""
        return self.serving().encode_images(images, batch_size=batch_size, device=device)

    def encode_texts(self, texts: list[str], batch_size: int = 256, device: Any = None) -> torch.Tensor:
        """Text queries (or gallery items) [N, dim] in the serving space."""
        return self.serving().encode_texts(texts, batch_size=batch_size, device=device)

    def text_bundle(self) -> ClipBundle | None:
        """A plain network whose text encoder is exactly this model's serving text encoder, or None when
        the served texts pass through adapters or heads (a method that keeps production's text encoder,
        TaCA, needs one)."""
        return None

    def forward_adapter(self, old_vectors: torch.Tensor) -> torch.Tensor:
        """``F(g)``: an old gallery vector expressed in the serving space (rule ``forward_adapter`` only)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no forward adapter (its rule is {self.contract.old_vector_rule!r})"
        )

    def read_old_gallery(
        self, queries: torch.Tensor, old_vectors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and old gallery vectors made comparable: their dot products are the serving scores.

        Implements the contract's ``old_vector_rule`` (see :class:`ServingContract`); both outputs are
        L2-normalised. ``old_vectors`` must have ``old_dim`` or one of ``old_dims`` columns.
        """
        rule, dim = self.contract.old_vector_rule, int(old_vectors.shape[-1])
        if dim not in self.contract.old_dims:
            raise CompatError(
                f"old gallery vectors have dimension {dim}, but model "
                f"{self.contract.query_model_version!r} ({self.method}) reads {self.contract.old_dims}"
            )
        queries = F.normalize(queries.float(), dim=-1)
        old_vectors = old_vectors.float()
        if rule == "as_is":
            return queries, F.normalize(old_vectors, dim=-1)
        if rule == "forward_adapter":
            with torch.no_grad():
                mapped = self.forward_adapter(old_vectors)
            return queries, F.normalize(mapped.float(), dim=-1)
        if rule == "zero_pad":
            return queries, F.normalize(zero_pad(old_vectors, queries.shape[-1]), dim=-1)
        k = min(queries.shape[-1], dim)
        return truncate(queries, k), truncate(old_vectors, k)

    @abstractmethod
    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, Tensors | None]]:
        """Backbones to save with ``save_checkpoint``: name -> (bundle, state dict or None for its own)."""

    def adapter_state(self) -> Tensors:
        """Small tensors (adapters, heads) saved in ``adapters.safetensors``."""
        return {}

    @classmethod
    @abstractmethod
    def restore(cls, parts: Parts, adapters: Tensors, config: Any, contract: ServingContract) -> Self:
        """Rebuild a saved model from its loaded backbones (:attr:`part_names`), adapter tensors, config."""

    def save(self, out_dir: Path | str) -> Path:
        """Write the model to ``out_dir`` (backbones, adapters, ``compat.json`` last); return its path."""
        from safetensors.torch import save_file

        from compat.io import atomic_write, write_json_atomic

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / COMPAT_FILE).unlink(missing_ok=True)  # incomplete until compat.json is back
        parts = self.checkpoint_parts()
        part_sha: dict[str, str] = {}
        for name, (bundle, state) in parts.items():
            sidecar = save_checkpoint(
                bundle,
                out_dir / name,
                version=f"{self.contract.query_model_version}/{name}",
                state_dict=state,
                extra={"compat_method": self.method, "part": name},
            )
            part_sha[name] = json.loads(Path(sidecar).read_text())["sha256"]
        adapters = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.adapter_state().items()}
        adapters_doc = None
        if adapters:
            meta = {"format": COMPAT_FORMAT, "method": self.method}
            atomic_write(out_dir / ADAPTERS_FILE, lambda tmp: save_file(adapters, str(tmp), metadata=meta))
            adapters_doc = {"file": ADAPTERS_FILE, "sha256": sha256_file(out_dir / ADAPTERS_FILE)}
        doc = {
            "format": COMPAT_FORMAT,
            "method": self.method,
            "contract": self.contract.to_dict(),
            "config": self.config.to_dict(),
            "parts": sorted(parts),
            "parts_sha256": part_sha,
            "adapters": adapters_doc,
            "trainable_parameters": int(self.trainable_parameters),
            "training": self.training_info,
            "created_at": utc_now(),
        }
        return write_json_atomic(out_dir / COMPAT_FILE, doc)


class AdaptedModel(CompatModel):
    """A model served through removable adapters on a copy of the new model (XBT, TaCA): ``adapted`` has
    the adapted ``bundle``, its ``serving`` bundle, ``attached``, ``remove()`` and ``adapter_state()``."""

    adapted: Any

    def serving(self) -> ClipBundle:
        if not self.adapted.attached:
            raise CompatError(f"the adapters of this {self.method} model were removed (remove_adapters())")
        return self.adapted.serving

    def original_new_model(self) -> ClipBundle:
        """A fresh copy of the new model as it was before the adapters (this model is unchanged)."""
        return original_model(self.adapted.bundle)

    def remove_adapters(self) -> ClipBundle:
        """The paper's "off" switch: drop the adapters in place and return the original new model."""
        return self.adapted.remove()

    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, Tensors | None]]:
        return {"new": (self.original_new_model(), None)}

    def adapter_state(self) -> Tensors:
        return self.adapted.adapter_state()


def load_compat_model(path: Path | str, device: str | torch.device = "cpu") -> CompatModel:
    """Load a model saved by :meth:`CompatModel.save`; every file is checked and named in errors."""
    from safetensors.torch import load_file

    from compat.methods import get_method

    path = Path(path)
    doc_path = path if path.name == COMPAT_FILE else path / COMPAT_FILE
    if not doc_path.is_file():
        raise FileNotFoundError(
            f"{doc_path} is missing: a compatible-model directory holds {COMPAT_FILE}, "
            "written by `compatflow compat train`"
        )
    root = doc_path.parent
    doc = read_json(doc_path, CompatError)
    if not isinstance(doc, dict) or doc.get("format") != COMPAT_FORMAT:
        raise CompatError(f"{doc_path}: field 'format' must be {COMPAT_FORMAT!r}")
    for key in ("method", "contract", "config", "parts"):
        if key not in doc:
            raise CompatError(f"{doc_path}: missing field {key!r}")
    method = get_method(doc["method"])
    if sorted(doc["parts"]) != sorted(method.model_class.part_names):
        raise CompatError(
            f"{doc_path}: a {method.name} model saves parts {sorted(method.model_class.part_names)}, "
            f"this one lists {sorted(doc['parts'])}"
        )
    config = config_from_mapping(method.config_class, doc["config"], f"{doc_path}: config")
    contract = ServingContract.from_dict(doc["contract"], f"{doc_path}: contract")
    recorded = doc.get("parts_sha256") or {}
    for name in doc["parts"]:
        if name in recorded and read_sidecar(root / name)["sha256"] != recorded[name]:
            raise CompatError(
                f"{root / name}: its weights are not the ones {doc_path} was saved with (sha256 differs); "
                "the directory mixes two saves"
            )
    parts = {name: load_checkpoint(root / name, device=device) for name in doc["parts"]}
    adapters: Tensors = {}
    if doc.get("adapters"):
        file = root / doc["adapters"]["file"]
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing ({doc_path} refers to it)")
        if (actual := sha256_file(file)) != doc["adapters"]["sha256"]:
            raise CompatError(
                f"{file}: sha256 mismatch: expected {doc['adapters']['sha256']} (from {doc_path}), "
                f"actual {actual}; the file was modified or truncated"
            )
        adapters = load_file(str(file), device="cpu")
    model = method.model_class.restore(parts, adapters, config, contract)
    return model.trained(doc.get("trainable_parameters", 0), doc.get("training") or {})
