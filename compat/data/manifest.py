"""The stream manifest (``stream.json``): its format, its reader, and appending a phase of shards to it.

A stream is a directory whose ``stream.json`` lists, phase by phase, the tar shards of each split
(``schemas/stream.schema.json``)::

    {"format": "compatflow-stream", "version": 1,
     "phases": [{"phase": 0, "domain": "drop-1", "train": [...], "eval": [...], "gallery": [...],
                 "counts": {"train": 812, "eval": 97, "gallery": 101}}, ...]}

Shard paths are relative to the stream directory (or absolute, for shards referenced in place).
The synthetic generator (:mod:`compat.data.synth`) adds ``seed``, ``image_size`` and ``generator``;
phases added with :func:`add_phase` carry ``source`` and ``added`` instead. Both are read by
:func:`load_manifest`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = "compatflow-stream"
VERSION = 1
MANIFEST = "stream.json"
LOCK = ".stream.lock"
SPLITS = ("train", "eval", "gallery")
# The least a phase needs to run: training pairs, two eval pairs (retrieval metrics), one gallery item.
MIN_COUNTS = {"train": 1, "eval": 2, "gallery": 1}


class StreamError(ValueError):
    """A stream directory or manifest is missing, malformed, or was generated with other settings."""


def manifest_path(directory: str | os.PathLike[str]) -> Path:
    """Where the manifest of the stream in ``directory`` lives."""
    return Path(directory) / MANIFEST


def load_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``directory/stream.json``; raise :class:`StreamError` naming the file and field."""
    path = manifest_path(directory)
    if not path.is_file():
        raise StreamError(
            f"{path} not found: add a phase with `compatflow stream add-phase {directory} --shards DIR` "
            f"or generate a synthetic stream with `compatflow data generate --out {directory}`"
        )
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StreamError(f"{path} is not valid JSON: {exc}") from exc
    check_manifest(doc, path)
    return doc


def check_manifest(doc: Any, path: str | os.PathLike[str]) -> None:
    """Raise :class:`StreamError` naming ``path`` and the field when ``doc`` is not a usable manifest."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StreamError(f"{path}: field 'format' must be {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise StreamError(
            f"{path}: field 'version' is {doc.get('version')!r}; this reader knows version {VERSION}"
        )
    for field_name in ("seed", "image_size"):  # synthetic streams only
        if field_name in doc and not _is_int(doc[field_name]):
            raise StreamError(f"{path}: field {field_name!r} must be an integer when given")
    if not isinstance(doc.get("phases"), list):
        raise StreamError(f"{path}: field 'phases' must be a list")
    for i, entry in enumerate(doc["phases"]):
        where = f"{path}: phases[{i}]"
        if not isinstance(entry, dict) or entry.get("phase") != i:
            raise StreamError(f"{where}.phase must be {i}")
        if not isinstance(entry.get("domain"), str) or not entry["domain"]:
            raise StreamError(f"{where}.domain must be a non-empty string")
        for split in SPLITS:
            shards = entry.get(split)
            if not isinstance(shards, list) or not all(isinstance(s, str) and s for s in shards):
                raise StreamError(f"{where}.{split} must be a list of shard paths")
        counts = entry.get("counts")
        if counts is not None and (
            not isinstance(counts, dict) or any(not _is_int(counts.get(s)) or counts[s] < 0 for s in SPLITS)
        ):
            raise StreamError(f"{where}.counts must give integer train/eval/gallery counts when given")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def phase_urls(
    directory: str | os.PathLike[str], phase: int, split: str, manifest: dict[str, Any] | None = None
) -> list[str]:
    """Absolute shard paths of ``split`` in ``phase`` of the stream in ``directory``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    manifest = manifest if manifest is not None else load_manifest(directory)
    phases = manifest["phases"]
    if not 0 <= phase < len(phases):
        raise StreamError(f"{manifest_path(directory)} has phases 0..{len(phases) - 1}; phase {phase} asked")
    return [str(Path(directory).resolve() / rel) for rel in phases[phase][split]]


def missing_shards(directory: str | os.PathLike[str], manifest: dict[str, Any]) -> list[str]:
    """Shard paths the manifest lists that are not files (as listed)."""
    root = Path(directory)
    return [
        rel for p in manifest["phases"] for split in SPLITS for rel in p[split] if not (root / rel).is_file()
    ]


def check_shards(urls: Sequence[str], split: str) -> dict[str, str]:
    """Read every shard of ``split`` to its end; return its sample keys (each with its shard). Raise
    :class:`StreamError` naming the shard when one is unreadable, truncated or empty, or repeats a key."""
    from compat.data.shards import ShardError, iter_raw_samples

    keys: dict[str, str] = {}
    for url in urls:
        try:
            mine = [sample.key for sample in iter_raw_samples(url)]
        except ShardError as exc:
            raise StreamError(f"{split} shard is unreadable: {exc}") from exc
        if not mine:
            raise StreamError(f"{split} shard {url} holds no samples; leave it out")
        for key in mine:
            if key in keys:
                raise StreamError(
                    f"sample key {key!r} appears twice in the {split} split ({keys[key]} and {url}): "
                    "a key names one sample of the stream; drop the repeat or give it a new key"
                )
            keys[key] = url
    return keys


def _check_new_keys(root: Path, manifest: dict[str, Any], keys: Mapping[str, str]) -> None:
    """Refuse keys of the new phase that an earlier phase (any split) or another split already holds:
    validation, evaluation and the gallery index read phases together and key their samples by it."""
    from compat.data.shards import ShardError, sample_keys

    for entry in manifest["phases"]:
        for split in SPLITS:
            for rel in entry[split]:
                path = root / rel
                try:
                    taken = sample_keys(str(path))
                except ShardError as exc:
                    raise StreamError(f"phase {entry['phase']} of {manifest_path(root)}: {exc}") from exc
                clash = next((k for k in keys if k in taken), None)
                if clash is not None:
                    raise StreamError(
                        f"sample key {clash!r} of {keys[clash]} is already in phase {entry['phase']} "
                        f"({path}): a key names one sample of the stream; add only samples it does not "
                        "hold yet (`compatflow data import` keys a sample by its content: the same image "
                        "imported again keeps its key)"
                    )


def add_phase(
    directory: str | os.PathLike[str],
    shards: Mapping[str, Sequence[str]],
    domain: str,
    *,
    description: str = "",
    source: str = "",
    in_place: bool = False,
) -> dict[str, Any]:
    """Append the next phase to the stream in ``directory`` (created with its manifest when missing).

    ``shards`` gives each split's local tar paths. Every shard is read to its end (counts computed, a
    truncated or unreadable shard refused) before anything is written, and a sample key that the stream
    already holds (or that two of the new shards share) is refused. The shards are hard-linked (or
    copied) to ``phase-PP/{split}/shard-NNNNN.tar`` in a temporary folder renamed into place, then the
    manifest is replaced atomically; ``in_place`` lists them where they are instead. Returns the entry.
    """
    if not isinstance(domain, str) or not domain.strip():
        raise StreamError("the phase's domain must be a non-empty name (--domain)")
    unknown = sorted(set(shards) - set(SPLITS))
    if unknown:
        raise StreamError(f"unknown split(s) {', '.join(unknown)}; splits are {', '.join(SPLITS)}")
    urls = {split: [str(Path(u).resolve()) for u in shards.get(split, ())] for split in SPLITS}
    for split in SPLITS:
        for url in urls[split]:
            if not Path(url).is_file():
                raise StreamError(f"{split} shard {url} is not a file")
        dupes = {u for u in urls[split] if urls[split].count(u) > 1}
        if dupes:
            raise StreamError(f"{split} lists {sorted(dupes)[0]} more than once")
    keys = {split: check_shards(urls[split], split) for split in SPLITS}
    counts = {split: len(keys[split]) for split in SPLITS}
    every: dict[str, str] = {}
    for split in SPLITS:
        for key, url in keys[split].items():
            if key in every:
                raise StreamError(
                    f"sample key {key!r} is in two splits of the new phase ({every[key]} and {url}): a "
                    "key names one sample of the stream"
                )
            every[key] = url
    for split, least in MIN_COUNTS.items():
        if counts[split] < least:
            raise StreamError(
                f"the {split} split holds {counts[split]} samples; a phase needs at least {least} "
                f"(give its shards with --{split}, or import with split fractions that leave it some)"
            )
    root = Path(directory)
    if manifest_path(root).is_file():
        load_manifest(root)  # a malformed manifest is refused before anything is written
    root.mkdir(parents=True, exist_ok=True)
    with _stream_lock(root):
        if manifest_path(root).is_file():
            _check_new_keys(root, load_manifest(root), every)
        entry = {
            "domain": domain.strip(),
            **({"description": description} if description else {}),
            "counts": counts,
            **({"source": source} if source else {}),
        }
        return _append_locked(root, urls, entry, in_place)


@contextlib.contextmanager
def _stream_lock(root: Path) -> Iterator[None]:
    """Hold ``root/.stream.lock`` (released by the OS when the holder dies); a second add waits for it."""
    import fcntl

    with open(root / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _append_locked(
    root: Path, urls: dict[str, list[str]], fields: dict[str, Any], in_place: bool
) -> dict[str, Any]:
    from compat.io import utc_now, write_json_atomic

    path = manifest_path(root)
    manifest = load_manifest(root) if path.is_file() else {"format": FORMAT, "version": VERSION, "phases": []}
    phase = len(manifest["phases"])
    name = f"phase-{phase:02d}"
    if in_place:
        listed = {split: [_relative_or_absolute(u, root) for u in urls[split]] for split in SPLITS}
    else:
        final = root / name
        if final.exists():  # a phase folder the manifest does not list: left by an add that was killed
            log.warning("removing %s: not listed in %s (an earlier add-phase was interrupted)", final, path)
            shutil.rmtree(final)
        staging = root / f".{name}.partial"
        if staging.exists():
            shutil.rmtree(staging)
        listed = {split: [] for split in SPLITS}
        for split in SPLITS:
            (staging / split).mkdir(parents=True)
            for n, url in enumerate(urls[split]):
                _link_or_copy(Path(url), staging / split / f"shard-{n:05d}.tar")
                listed[split].append(f"{name}/{split}/shard-{n:05d}.tar")
        os.replace(staging, final)
    entry = {"phase": phase, **fields, **listed, "added": utc_now()}
    entry = {
        k: entry[k]
        for k in ("phase", "domain", "description", *SPLITS, "counts", "source", "added")
        if k in entry
    }
    updated = {**manifest, "phases": [*manifest["phases"], entry]}
    check_manifest(updated, path)
    write_json_atomic(path, updated)
    return entry


def _relative_or_absolute(url: str, root: Path) -> str:
    try:
        return Path(url).relative_to(root.resolve()).as_posix()
    except ValueError:
        return url


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (shards are never rewritten in place), or copy it across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
