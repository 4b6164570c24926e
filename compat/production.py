"""The production model, whatever produced it: one loading contract for every use of "production".

A promoted model directory is a plain checkpoint (``model.json`` + ``model.safetensors``: the first model,
trained by bootstrap) or a compatible model (``compat.json`` + parts, :meth:`CompatModel.save`).
:func:`load_production` reads either into a :class:`ProductionModel`:

- ``encoder`` embeds queries and gallery items in the serving space; it is the frozen old model of compat
  training and evaluation (its contract carries the gallery dimensions it reads, BT^2's series) and what
  drift embeds;
- ``backbone()`` is a fresh trainable copy of the network underneath (the checkpoint, or a compatible
  model's ``new`` part before any adapter), loaded twice by the next continual (Mod-X) phase: student and
  frozen teacher. Mod-X distils the previous model's own similarity structure into a student that starts
  from it, so init and teacher are the same network; adapters and heads are not trained further, and the
  next compat step trains against the full serving ``encoder``, so compatibility is always with what is
  served.

The gallery after a rollout: staged (the method keeps the space), every item holds the candidate's vector in
the space the gallery was in (lambda_orth: ``F(old)`` vectors first, then ``B(new)``; bt2: the wider vector,
its contract's ``old_dims`` listing every earlier dimension it reads by truncation,
:func:`compat.methods.training.contract_lineage`); blue-green (none, or a new space), a new collection in
the candidate's space behind the moved alias. Either way the next upgrade reads this model's space. A halted
rollout is rolled back whole by the pipeline (the next upgrade trains against production); one halted under
``compatflow rollout run`` keeps its accepted stages (a mixed gallery the candidate reads by its contract)
until the next scheduled rollout rolls it back (``components.steps.gallery``).
"""

from __future__ import annotations

import json
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
    if model_kind(root) == "compat":
        return load_compat_model(root, device=device)
    return load_checkpoint(root, device=device)


def space_id_of(path: str | Path, encoder: ClipBundle | CompatModel | None = None) -> str:
    """The space of the gallery vectors a model writes: a compatible model's own, else its version."""
    if encoder is not None:  # loaded, so torch is imported already; reading a directory needs no torch
        from compat.methods.model import CompatModel

        if isinstance(encoder, CompatModel):
            return encoder.contract.space_id
    if model_kind(path) == "compat":
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
        return {name: str(value) for name, value in vars(self).items() if name != "encoder"}


def load_production(path: str | Path, device: Any = "cpu") -> ProductionModel:
    """Load the model at ``path`` (whatever method produced it) for every use of "production"."""
    root = model_root(path)
    encoder = load_encoder(root, device=device)
    return ProductionModel(root, **identity(root), space_id=space_id_of(root, encoder), encoder=encoder)
