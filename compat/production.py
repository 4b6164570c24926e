"""The production model, whatever produced it: one loading contract for every use of "production".

A promoted model directory is either a plain checkpoint (``model.json`` + ``model.safetensors``: the first
model, trained by bootstrap) or a compatible model (``compat.json`` + parts, written by
:meth:`compat.methods.model.CompatModel.save` for bct, lambda_orth, bt2, xbt, xbt_base, taca or none).
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
After a completed rollout (staged, the method keeps the space):

- bootstrap: every item holds the first model's vector; the space is that checkpoint's version.
- bct, xbt, xbt_base, taca: every item holds the candidate's vector, written into the space the gallery was
  in (``space_id == old_space_id``: the first model's space, carried from release to release). The next
  upgrade is trained against this model's ``encoder``, so it reads these vectors.
- lambda_orth: stage 0 filled a copy of the collection with ``F(old)`` vectors, the backfill wrote
  ``B(new)`` vectors; every item then holds a candidate vector. Same rule for the next upgrade.
- bt2: every item holds the candidate's wider vector (old dim + extra). Its contract's ``old_dims`` lists
  every earlier dimension it reads by truncation, and the next BT^2 model inherits them
  (:func:`compat.methods.training.contract_lineage`): a gallery that still holds v1 vectors when v3 arrives
  (a partial backfill) stays readable.

After a blue-green rollout (none, or any method declaring a new space): a new collection holds every item
in the candidate's own space and the alias moved to it; the old collection stays for rollback. The next
upgrade must read the new space (its old model is this one).

After a halted rollout: the pipeline rolls it back whole (every stage's rows and the query model go back),
so the gallery holds production's vectors only and production is unchanged; the next upgrade is trained
against production, as if the refused candidate never existed. A rollout halted under ``compatflow
rollout run`` (the operator's tool) keeps its accepted stages: the gallery is mixed, production's vectors
and the candidate's in the one space (bt2: two dimensions), queried by the candidate, which reads both by
its contract; the next scheduled rollout rolls it back first (``components.steps.gallery``), since the new
candidate was trained against production, not against the halted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from compat.methods.contract import Encoder
    from compat.methods.model import CompatModel
    from compat.models import ClipBundle

BACKBONE_PART = "new"


class ProductionModelError(ValueError):
    """A directory that is neither a plain checkpoint nor a compatible model; the message names it."""


def model_kind(path: str | Path) -> str:
    """``"checkpoint"`` or ``"compat"`` for a model directory; raises :class:`ProductionModelError`."""
    from compat.methods.contract import COMPAT_FILE
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

    from compat.methods.contract import COMPAT_FILE
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
    from compat.methods.model import load_compat_model
    from compat.models import load_checkpoint

    root = model_root(path)
    return (
        load_compat_model(root, device=device)
        if model_kind(root) == "compat"
        else load_checkpoint(root, device=device)
    )


def space_id_of(path: str | Path, encoder: ClipBundle | CompatModel | None = None) -> str:
    """The space of the gallery vectors a model writes: a compatible model's own, else its version."""
    if encoder is not None:  # loaded, so torch is imported already; reading a directory needs no torch
        from compat.methods.model import CompatModel

        if isinstance(encoder, CompatModel):
            return encoder.contract.space_id
    if model_kind(path) == "compat":
        import json

        from compat.methods.contract import COMPAT_FILE

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
