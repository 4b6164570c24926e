"""The contract every compatibility method implements.

A :class:`CompatMethod` fits a compatible model with the production ("old") model frozen::

    model = get_method("bct").fit(new, old, batches, config)

- ``new`` is a :class:`~compat.models.ClipBundle` (the candidate, or the independently trained new model);
- ``old`` is the frozen production encoder: a ``ClipBundle`` or, after an earlier compatible release, a
  :class:`CompatModel` (anything with ``encode_images`` / ``encode_texts`` / ``embed_dim``);
- ``batches`` is a re-iterable of batches with ``images`` (preprocessed tensor or PIL list) and ``texts``;
- ``config`` is the method's :class:`MethodConfig` dataclass (``method.make_config(mapping)`` builds it).

The resulting :class:`CompatModel` encodes queries (and re-embedded gallery items) into the serving space,
reads old gallery vectors by the rule of its :class:`ServingContract`, counts its trainable parameters and
saves itself as ``compat.json`` + backbone checkpoint(s) (``compat.models.checkpoint``) +
``adapters.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from compat.methods.layers import truncate, zero_pad
from compat.models import ClipBundle, load_checkpoint, read_sidecar, save_checkpoint
from compat.models.checkpoint import sha256_file

OLD_VECTOR_RULES = ("as_is", "forward_adapter", "zero_pad", "truncate")
COMPAT_FORMAT = "compatflow-compat-model"
COMPAT_FILE = "compat.json"
ADAPTERS_FILE = "adapters.safetensors"
log = logging.getLogger("compat.methods")


class CompatError(ValueError):
    """A compatibility model directory, contract or method configuration is malformed."""


# --------------------------------------------------------------------------------------------- contract
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
        missing = [n for n in names if n not in doc and n != "old_dims"]
        if missing:
            raise CompatError(f"{source}: serving contract misses field(s) {missing}")
        values = {n: doc[n] for n in names if n in doc}
        values["old_dims"] = tuple(values.get("old_dims") or ())
        try:
            return cls(**values)
        except (TypeError, CompatError) as exc:
            raise CompatError(f"{source}: {exc}") from exc


# ------------------------------------------------------------------------------------------ protocols
@runtime_checkable
class Encoder(Protocol):
    """Anything that embeds images and texts into one space: a ``ClipBundle`` or a ``CompatModel``."""

    embed_dim: int

    def encode_images(self, images: Any, batch_size: int = ..., device: Any = ...) -> torch.Tensor: ...

    def encode_texts(self, texts: list[str], batch_size: int = ..., device: Any = ...) -> torch.Tensor: ...


class Batch(Protocol):
    """A training batch: ``images`` (preprocessed [B, 3, H, W] tensor or PIL list) and raw ``texts``."""

    images: Any
    texts: list[str]


# ----------------------------------------------------------------------------------------------- config
@dataclass
class MethodConfig:
    """Settings shared by every method; each method subclasses it with its own (documented) defaults."""

    steps: int = 300
    lr: float = 1e-4
    seed: int = 0
    device: str = "cpu"
    version: str = "candidate"
    old_space_id: str = "production"
    log_every: int = 50

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise CompatError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise CompatError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CompatError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise CompatError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def config_from_mapping(
    config_class: type[MethodConfig], values: Mapping[str, Any] | None, source: str = "config"
) -> MethodConfig:
    """Build ``config_class`` from ``values``; unknown keys and wrong types raise :class:`CompatError`."""
    values = dict(values or {})
    hints = typing.get_type_hints(config_class)
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CompatError(
            f"{source}: unknown setting(s) {unknown} for {config_class.__name__}; known: {sorted(known)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{source}: {k}") for k, v in values.items()}
    config = config_class(**kwargs)
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as exc:
            raise CompatError(f"{source}: {exc}") from exc
    return config


# ------------------------------------------------------------------------------------------------ model
class CompatModel(ABC):
    """A fitted compatible model: serving-space encoders, the old-gallery read rule, persistence.

    Subclasses implement :meth:`encode_images`, :meth:`encode_texts`, :meth:`checkpoint_parts`,
    :meth:`restore` and, when they store adapters, :meth:`adapter_state`; a model whose rule is
    ``forward_adapter`` implements :meth:`forward_adapter`. Encoders return L2-normalised float32 CPU
    tensors [N, contract.dim] without gradients; the same encoders write re-embedded gallery items.
    """

    method: ClassVar[str] = ""

    def __init__(self, contract: ServingContract, config: MethodConfig) -> None:
        self.contract = contract
        self.config = config
        self.trainable_parameters: int = 0
        self.training_info: dict[str, Any] = {}

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

    @abstractmethod
    def encode_images(self, images: Any, batch_size: int = 256, device: Any = None) -> torch.Tensor:
        """Image queries (or gallery items) [N, dim] in the serving space."""

    @abstractmethod
    def encode_texts(self, texts: list[str], batch_size: int = 256, device: Any = None) -> torch.Tensor:
        """Text queries (or gallery items) [N, dim] in the serving space."""

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

    # ---- persistence
    @abstractmethod
    def checkpoint_parts(self) -> dict[str, tuple[ClipBundle, dict[str, torch.Tensor] | None]]:
        """Backbones to save with ``save_checkpoint``: name -> (bundle, state dict or None for its own)."""

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Small tensors (adapters, heads) saved in ``adapters.safetensors``."""
        return {}

    @classmethod
    @abstractmethod
    def restore(
        cls,
        parts: dict[str, ClipBundle],
        adapters: dict[str, torch.Tensor],
        config: MethodConfig,
        contract: ServingContract,
    ) -> CompatModel:
        """Rebuild a saved model from its loaded backbones and adapter tensors."""

    def save(self, out_dir: Path | str) -> Path:
        """Write the model to ``out_dir`` (backbones, adapters, ``compat.json`` last); return its path."""
        from safetensors.torch import save_file

        from compat.io import write_json_atomic

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
        adapters_sha = None
        if adapters:
            tmp = out_dir / f".{ADAPTERS_FILE}.tmp"
            save_file(adapters, str(tmp), metadata={"format": COMPAT_FORMAT, "method": self.method})
            tmp.replace(out_dir / ADAPTERS_FILE)
            adapters_sha = sha256_file(out_dir / ADAPTERS_FILE)
        doc = {
            "format": COMPAT_FORMAT,
            "method": self.method,
            "contract": self.contract.to_dict(),
            "config": self.config.to_dict(),
            "parts": sorted(parts),
            "parts_sha256": part_sha,
            "adapters": {"file": ADAPTERS_FILE, "sha256": adapters_sha} if adapters else None,
            "trainable_parameters": int(self.trainable_parameters),
            "training": self.training_info,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        return write_json_atomic(out_dir / COMPAT_FILE, doc)


def is_compat_dir(path: Path | str) -> bool:
    """True when ``path`` is a directory written by :meth:`CompatModel.save` (or its ``compat.json``)."""
    path = Path(path)
    return (path / COMPAT_FILE).is_file() or (path.name == COMPAT_FILE and path.is_file())


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
    try:
        doc = json.loads(doc_path.read_text())
    except json.JSONDecodeError as exc:
        raise CompatError(f"{doc_path}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != COMPAT_FORMAT:
        raise CompatError(f"{doc_path}: field 'format' must be {COMPAT_FORMAT!r}")
    for key in ("method", "contract", "config", "parts"):
        if key not in doc:
            raise CompatError(f"{doc_path}: missing field {key!r}")
    method = get_method(doc["method"])
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
    adapters: dict[str, torch.Tensor] = {}
    if doc.get("adapters"):
        file = root / doc["adapters"]["file"]
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing ({doc_path} refers to it)")
        actual = sha256_file(file)
        if actual != doc["adapters"]["sha256"]:
            raise CompatError(
                f"{file}: sha256 mismatch: expected {doc['adapters']['sha256']} (from {doc_path}), "
                f"actual {actual}; the file was modified or truncated"
            )
        adapters = load_file(str(file), device="cpu")
    model = method.model_class.restore(parts, adapters, config, contract)
    model.trainable_parameters = int(doc.get("trainable_parameters", 0))
    model.training_info = dict(doc.get("training") or {})
    return model


# ---------------------------------------------------------------------------------------------- methods
class CompatMethod(ABC):
    """A compatibility-training method, registered by name with :func:`compat.methods.register_method`."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    model_class: ClassVar[type[CompatModel]]

    def make_config(self, values: Mapping[str, Any] | None = None, source: str = "config") -> MethodConfig:
        """This method's config from a mapping (unknown keys and bad types raise :class:`CompatError`)."""
        return config_from_mapping(self.config_class, values, f"{source} ({self.name})")

    @abstractmethod
    def fit(
        self, new: ClipBundle, old: Encoder, batches: Iterable[Batch], config: MethodConfig | None = None
    ) -> CompatModel:
        """Fit with ``old`` frozen; ``new`` is the candidate / independently trained new model."""


# ------------------------------------------------------------------------------------------- utilities
def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as given."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def logit_scale_of(encoder: Encoder) -> float:
    """The contrastive temperature multiplier ``s`` of a frozen encoder (a bundle's ``logit_scale.exp()``)."""
    if isinstance(encoder, ClipBundle):
        return float(encoder.model.logit_scale.detach().exp().clamp(max=100.0).item())
    return float(getattr(encoder, "logit_scale", 1 / 0.07))


def contract_lineage(old: Encoder) -> tuple[str | None, tuple[int, ...]]:
    """Space id and gallery dimensions readable by prefix through ``old`` when it is a compatible model.

    A plain bundle gives ``(None, ())``. For a compatible model: its own dimension, plus the dimensions it
    reads by a prefix rule (``as_is`` / ``zero_pad`` / ``truncate``) when it kept the old space.
    """
    if not isinstance(old, CompatModel):
        return None, ()
    dims: tuple[int, ...] = (old.contract.dim,)
    if old.contract.keeps_space and old.contract.old_vector_rule in ("as_is", "zero_pad", "truncate"):
        dims += tuple(d for d in old.contract.old_dims if d not in dims)
    return old.contract.space_id, dims


def cycle_batches(batches: Iterable[Batch], steps: int) -> Iterator[Batch]:
    """Yield ``steps`` batches, starting ``batches`` over when it runs out (it must be re-iterable)."""
    produced = 0
    while produced < steps:
        empty = True
        for batch in batches:
            empty = False
            yield batch
            produced += 1
            if produced >= steps:
                return
        if empty:
            raise CompatError(
                f"the training data produced no batch (after {produced} of {steps} steps); "
                "pass a non-empty, re-iterable batch source"
            )


def prepare_images(images: Any, bundle: ClipBundle, train: bool = True) -> torch.Tensor:
    """A [B, 3, S, S] tensor for ``bundle``: PIL lists go through its preprocessing; tensors are checked."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[-1] != bundle.image_size or images.shape[-2] != bundle.image_size:
            raise CompatError(
                f"image batch of shape {tuple(images.shape)} does not fit model {bundle.config_name!r} "
                f"(expects [B, 3, {bundle.image_size}, {bundle.image_size}]); preprocess with the "
                "model's own transform or pass PIL images"
            )
        return images
    transform = bundle.preprocess_train if train else bundle.preprocess_eval
    return torch.stack([transform(im) for im in images])


def texts_of(batch: Batch) -> list[str]:
    """The raw captions of a batch (token ids are refused: each model tokenises with its own tokenizer)."""
    texts = batch.texts
    if isinstance(texts, torch.Tensor) or not all(isinstance(t, str) for t in texts):
        raise CompatError(
            "compatibility training needs raw caption strings in batch.texts (the old and new models "
            "may use different tokenizers); use compat.methods.run.ShardBatches"
        )
    return list(texts)


def image_size_of(encoder: Encoder) -> int | None:
    """Input resolution of an encoder (None when unknown)."""
    return encoder.image_size if isinstance(encoder, ClipBundle) else getattr(encoder, "image_size", None)


def frozen_features(
    encoder: Encoder, batch: Batch, device: torch.device, prepared: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised image and text features of a frozen encoder on ``batch``, on ``device``, without gradients.

    ``prepared`` (the trained model's input tensor) is reused when the encoder takes the same resolution, so
    both models see the same view; otherwise the encoder preprocesses the batch's images itself. All cf-*
    configs share open_clip's default normalisation.
    """
    images = batch.images
    if prepared is not None and image_size_of(encoder) == prepared.shape[-1]:
        images = prepared
    elif isinstance(encoder, ClipBundle):
        images = prepare_images(images, encoder, train=False)
    with torch.no_grad():
        img = encoder.encode_images(images, device=device)
        txt = encoder.encode_texts(texts_of(batch), device=device)
    return img.to(device), txt.to(device)


def freeze(encoder: Encoder, device: torch.device | None = None) -> Encoder:
    """Gradients off, eval mode, moved to ``device`` (a bundle); compatible models stay as they are."""
    if isinstance(encoder, ClipBundle):
        for p in encoder.model.parameters():
            p.requires_grad_(False)
        encoder.model.eval()
        if device is not None:
            encoder.model.to(device)
    return encoder


def adamw_cosine(
    params: Iterable[torch.nn.Parameter] | list[dict],
    lr: float,
    weight_decay: float,
    steps: int,
    warmup_fraction: float,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up over ``warmup_fraction`` of ``steps`` then cosine decay to zero."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(int(round(warmup_fraction * steps)), 0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(steps - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class TrainingLog:
    """Loss history and wall time of a fit, stored in ``compat.json`` under ``training``."""

    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def record(self, step: int, every: int, **terms: torch.Tensor | float) -> None:
        self.steps = step + 1
        self._last = {
            "step": step,
            **{
                k: round(float(v.detach() if isinstance(v, torch.Tensor) else v), 6) for k, v in terms.items()
            },
        }
        if step == 0 or (every > 0 and step % every == 0):
            self.history.append(self._last)
            log.info(
                "step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in self._last.items() if k != "step")
            )

    def finish(self, **extra: Any) -> dict[str, Any]:
        last = getattr(self, "_last", None)
        if last is not None and (not self.history or self.history[-1]["step"] != last["step"]):
            self.history.append(last)
        return {
            "steps": self.steps,
            "seconds": round(time.monotonic() - self.started, 3),
            "history": self.history,
            **extra,
        }
