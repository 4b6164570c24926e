"""Training state and resumable checkpoints, written atomically, loaded without unpickling.

A checkpoint is a directory ``step-NNNNNNNN/``: the student's ``model.safetensors`` + ``model.json``, the
optimizer's tensors (``optimizer.safetensors``), torch generator states (``rng.safetensors``) and
``progress.json`` (step, samples seen, data position, history, config, schedule, param groups, GradScaler and
Python / NumPy RNG states). It is assembled in a hidden temporary directory renamed into place in one
``os.replace``, so a ``step-*`` directory is always complete; a killed write leaves a temporary directory,
removed at the next start.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from compat.models import ClipBundle

STATE_FORMAT = "compatflow-train-state"
STATE_VERSION = 1
PROGRESS_FILE = "progress.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-step-"


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed (damaged, or written by a run with other settings)."""


@dataclass
class TrainState:
    """What a run has done so far: optimizer steps, samples consumed, where the data stream stands."""

    step: int = 0
    samples_seen: int = 0
    position: dict[str, Any] | None = None
    history: list[dict[str, float]] = field(default_factory=list)

    def advance(self, samples: int, position: dict[str, Any]) -> None:
        """One more optimizer step, on ``samples`` more samples, the data stream now at ``position``."""
        self.step += 1
        self.samples_seen += samples
        self.position = position


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    found = [p for p in Path(root).glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def remove_stale_temporaries(root: Path) -> None:
    """Delete half-written checkpoint directories left by a killed run."""
    for p in Path(root).glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Torch generator states (tensors) and Python / NumPy states (JSON)."""
    import numpy as np
    import torch

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return tensors, {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore_rng(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in tensors))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import torch

    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict[str, Any]] = {}
    for pid, entries in sd["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{name}"] = value.detach().to("cpu").contiguous().clone()
            else:
                plain_state.setdefault(str(pid), {})[name] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "plain_state": plain_state}


def _optimizer_from_files(tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    for pid, entries in doc.get("plain_state", {}).items():
        state.setdefault(int(pid), {}).update(entries)
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in doc["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_training_checkpoint(
    root: Path,
    bundle: ClipBundle,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    *,
    config: dict[str, Any],
    schedule: dict[str, Any],
    scaler_state: dict[str, Any] | None,
    keep: int = 2,
) -> Path:
    """Write ``root/step-NNNNNNNN`` atomically and prune all but the newest ``keep`` checkpoints."""
    from safetensors.torch import save_file

    from compat.models.checkpoint import save_checkpoint

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(state.step)
    tmp = root / f"{_TMP_PREFIX}{state.step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = getattr(bundle.model, "module", bundle.model).state_dict()
    save_checkpoint(bundle, tmp, version=final.name, extra={"train_step": state.step}, state_dict=weights)
    opt_tensors, opt_doc = _optimizer_to_files(optimizer)
    save_file(opt_tensors, str(tmp / OPTIMIZER_FILE))
    rng_tensors, rng_doc = capture_rng()
    save_file(rng_tensors, str(tmp / RNG_FILE))
    doc = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "state": asdict(state),
        "config": config,
        "schedule": schedule,
        "optimizer": opt_doc,
        "scaler": scaler_state,
        "rng": rng_doc,
    }
    (tmp / PROGRESS_FILE).write_text(json.dumps(doc) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # a complete checkpoint of the same step from an earlier attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state_document(path: Path) -> dict[str, Any]:
    """``progress.json`` of a checkpoint, checked for format and version (nothing else is read)."""
    path = Path(path)
    try:
        doc = json.loads((path / PROGRESS_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResumeError(
            f"{path / PROGRESS_FILE}: unreadable training state ({exc}); delete {path} to "
            "resume from the previous checkpoint"
        ) from exc
    if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
        raise ResumeError(f"{path / PROGRESS_FILE}: not a {STATE_FORMAT} v{STATE_VERSION} file")
    return doc


def load_training_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[TrainState, dict[str, Any] | None]:
    """Load weights, optimizer and RNG states from ``path`` into the given objects; return the training
    state and the GradScaler's.

    Weights are checked against the sidecar's sha256; nothing is unpickled.
    """
    from safetensors.torch import load_file

    from compat.models.checkpoint import WEIGHTS_FILE, read_sidecar, sha256_file

    path = Path(path)
    doc = read_state_document(path)
    sidecar = read_sidecar(path)
    weights = path / WEIGHTS_FILE
    if sha256_file(weights) != sidecar["sha256"]:
        raise ResumeError(f"{weights}: sha256 differs from {path / 'model.json'}; the checkpoint is damaged")
    target = getattr(model, "module", model)
    target.load_state_dict(load_file(str(weights), device="cpu"), strict=True)
    device = next(target.parameters()).device
    opt_tensors = load_file(str(path / OPTIMIZER_FILE), device=str(device))
    optimizer.load_state_dict(_optimizer_from_files(opt_tensors, doc["optimizer"]))
    restore_rng(load_file(str(path / RNG_FILE)), doc["rng"])
    s = doc["state"]
    state = TrainState(int(s["step"]), int(s["samples_seen"]), s["position"], list(s["history"]))
    return state, doc["scaler"]
