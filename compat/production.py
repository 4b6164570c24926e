"""The production model, whatever produced it: one loading contract for every use of "production".

A promoted model directory is either a plain checkpoint (``model.json`` + ``model.safetensors``: the first
model, trained by bootstrap) or a compatible model (``compat.json`` + parts, written by
:meth:`compat.methods.base.CompatModel.save` for bct, lambda_orth, bt2, xbt, xbt_base, taca or none).
:func:`load_production` reads either into a :class:`ProductionModel`, which every stage uses the same way:

============================  ==============================================================================
use                           what it takes
============================  ==============================================================================
serving query encoder,        ``encoder``: texts and images into the serving space (a compatible model's
gallery encoder               encoders, or the plain bundle)
old side of compat training   ``encoder`` (a compat method reads a ``CompatModel`` as its frozen old model;
and of the evaluation         its contract carries the gallery dimensions it reads, BT^2's series)
drift embeddings              ``encoder`` (what production would write into the gallery)
init and teacher of the next  ``backbone()``: a fresh trainable copy of the network underneath the encoder
continual (Mod-X) phase       (the plain checkpoint, or the compatible model's ``new`` part: the candidate
                              network before any adapter), loaded twice: student and frozen teacher
============================  ==============================================================================

Mod-X distils the previous model's own similarity structure into a student that starts from it (the
student's first step has zero KL), so the init and the teacher are the same network, the backbone. The
adapters or heads a compat method put on top (lambda_orth's ``B``, BT^2's head and extra dimensions, XBT's
LoRA, prompts and projection, TaCA's adapters) are not trained further; the next compat stage trains the
next candidate against the full serving ``encoder``, so compatibility is always with what is served.

Which space the gallery lives in, per method, and what the next upgrade must read
---------------------------------------------------------------------------------
- bootstrap: the gallery holds the first model's vectors; its space is that checkpoint's version.
- bct, lambda_orth, xbt, xbt_base, taca (compatible; ``contract.keeps_space``): the candidate writes into the
  space the gallery is in (``space_id == old_space_id``, the first model's space). After a completed
  rollout every item holds a candidate vector; after a halted one the failing backfill stage is restored
  and production is unchanged, so the gallery holds the vectors of production and of the refused candidate
  (both in the same space, the candidate's ones readable by production because the gate proved
  new-gallery/old-query compatibility is not needed: the rollout restores what it wrote, see
  :mod:`components.rollout`). The next upgrade is trained against production's ``encoder``.
- bt2 (compatible by truncation): the candidate writes wider vectors (``dim`` = old dim + extra); its queries
  read every earlier dimension in ``contract.old_dims`` by truncation. A gallery that still holds v1
  vectors when v3 arrives (a partial backfill) is read because v3's contract inherits v2's ``old_dims``
  (:func:`compat.methods.base.contract_lineage`).
- none (blue-green): the candidate declares its own space (its version); the rollout fills a new
  collection completely and moves the alias, so the gallery is entirely in the new space and the next
  upgrade is compatible with that space.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from compat.methods.base import CompatModel, Encoder
    from compat.models import ClipBundle

BACKBONE_PART = "new"


class ProductionModelError(ValueError):
    """A directory that is neither a plain checkpoint nor a compatible model; the message names it."""


def model_kind(path: str | Path) -> str:
    """``"checkpoint"`` or ``"compat"`` for a model directory; raises :class:`ProductionModelError`."""
    from compat.methods.base import COMPAT_FILE
    from compat.models.checkpoint import SIDECAR_FILE

    path = Path(path)
    root = path.parent if path.name in (COMPAT_FILE, SIDECAR_FILE) else path
    if (root / COMPAT_FILE).is_file():
        return "compat"
    if (root / SIDECAR_FILE).is_file():
        return "checkpoint"
    raise ProductionModelError(
        f"{root} holds neither {SIDECAR_FILE} (a checkpoint) nor {COMPAT_FILE} (a compatible model): "
        "it is not a model directory written by compatflow (was it copied only in part?)"
    )


def model_root(path: str | Path) -> Path:
    """The model directory of ``path`` (a directory, its ``model.json`` or its ``compat.json``)."""
    path = Path(path)
    return path.parent if path.is_file() else path


def backbone_path(path: str | Path) -> Path:
    """The plain checkpoint underneath a model directory: itself, or a compatible model's ``new`` part."""
    root = model_root(path)
    return root if model_kind(root) == "checkpoint" else root / BACKBONE_PART


def identity(path: str | Path) -> dict[str, str]:
    """``{version, sha256, method}`` of a model directory: the query model version it serves, the sha256
    of the file that pins every byte of it (sidecar weights hash, or ``compat.json``), its method."""
    import json

    from compat.methods.base import COMPAT_FILE
    from compat.models import read_sidecar
    from compat.models.checkpoint import sha256_file

    root = model_root(path)
    if model_kind(root) == "checkpoint":
        sidecar = read_sidecar(root)
        return {"version": str(sidecar["version"]), "sha256": sidecar["sha256"], "method": "checkpoint"}
    doc = json.loads((root / COMPAT_FILE).read_text())
    return {
        "version": str(doc["contract"]["query_model_version"]),
        "sha256": sha256_file(root / COMPAT_FILE),
        "method": str(doc["method"]),
    }


def load_encoder(path: str | Path, device: Any = "cpu") -> ClipBundle | CompatModel:
    """The serving encoder of a model directory (a compatible model, or the plain checkpoint's bundle)."""
    from compat.methods.base import load_compat_model
    from compat.models import load_checkpoint

    root = model_root(path)
    return (
        load_compat_model(root, device=device)
        if model_kind(root) == "compat"
        else load_checkpoint(root, device=device)
    )


def space_id_of(path: str | Path, encoder: ClipBundle | CompatModel | None = None) -> str:
    """The space of the gallery vectors a model writes: a compatible model's own, else its version."""
    from compat.methods.base import CompatModel

    if isinstance(encoder, CompatModel):
        return encoder.contract.space_id
    if model_kind(path) == "compat":
        import json

        from compat.methods.base import COMPAT_FILE

        return str(json.loads((model_root(path) / COMPAT_FILE).read_text())["contract"]["space_id"])
    return identity(path)["version"]


@dataclass
class ProductionModel:
    """A promoted model loaded for every use (see the module docstring for which attribute serves which)."""

    path: Path
    version: str
    method: str
    sha256: str
    space_id: str
    encoder: Encoder

    def backbone(self, device: Any = "cpu") -> ClipBundle:
        """A fresh, trainable copy of the network under the encoder (continual init or teacher)."""
        from compat.models import load_checkpoint

        return load_checkpoint(backbone_path(self.path), device=device)

    @property
    def backbone_config(self) -> str:
        """The open_clip config name of :meth:`backbone` (read from its sidecar)."""
        from compat.models import read_sidecar

        return str(read_sidecar(backbone_path(self.path))["config_name"])

    def describe(self) -> dict[str, str]:
        return {
            "path": str(self.path),
            "version": self.version,
            "method": self.method,
            "sha256": self.sha256,
            "space_id": self.space_id,
        }


def load_production(path: str | Path, device: Any = "cpu") -> ProductionModel:
    """Load the model at ``path`` (whatever method produced it) for every use of "production"."""
    root = model_root(path)
    encoder = load_encoder(root, device=device)
    ident = identity(root)
    return ProductionModel(
        path=root,
        version=ident["version"],
        method=ident["method"],
        sha256=ident["sha256"],
        space_id=space_id_of(root, encoder),
        encoder=encoder,
    )
