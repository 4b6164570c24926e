"""Integrity of a model directory: a sha256 manifest of every file, its digest, and the check of a copy.

A registered model version carries ``MANIFEST.sha256.json`` beside its files and the digest of that manifest
in its tags; a workspace copy is trusted only when every file matches the manifest and the manifest matches
the registered digest. Pickle-format files are never part of a model (nothing here unpickles anything).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from compat.models.checkpoint import sha256_file

MANIFEST = "MANIFEST.sha256.json"
PICKLE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"})


class CheckpointIntegrityError(ValueError):
    """A model directory differs from the manifest it was registered with, or has none."""


def file_manifest(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` (the manifest itself excluded)."""
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file() and p != Path(directory) / MANIFEST)
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in files}


def manifest_digest(manifest: Mapping[str, str]) -> str:
    """The sha256 of a manifest (sorted JSON): what a model version records to pin its manifest."""
    return hashlib.sha256(json.dumps(dict(manifest), sort_keys=True).encode()).hexdigest()


def pickled_files(manifest: Mapping[str, str]) -> list[str]:
    """The files of a manifest in a pickle format (refused: weights must be safetensors)."""
    return [p for p in manifest if Path(p).suffix.lower() in PICKLE_SUFFIXES]


def verify_checkpoint(directory: str | Path, expected_digest: str | None = None) -> dict[str, str]:
    """Check every file of a model directory against its manifest (and the manifest against
    ``expected_digest`` when given); returns the manifest, or raises :class:`CheckpointIntegrityError`."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointIntegrityError(f"{directory} has no {MANIFEST}: cannot verify the checkpoint")
    manifest = json.loads(manifest_path.read_text())
    if expected_digest is not None and (found := manifest_digest(manifest)) != expected_digest:
        raise CheckpointIntegrityError(
            f"{manifest_path} does not match the digest registered with the model version: expected sha256 "
            f"{expected_digest}, found sha256 {found}"
        )
    if (actual := file_manifest(directory)) != manifest:
        bad = sorted(k for k in set(actual) | set(manifest) if actual.get(k) != manifest.get(k))
        raise CheckpointIntegrityError(
            f"checkpoint {directory} differs from its manifest in: {', '.join(bad)}"
        )
    return manifest
