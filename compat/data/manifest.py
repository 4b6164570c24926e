"""The stream manifest (``stream.json``, ``schemas/stream.schema.json``): its reader, and appending a phase.

A stream is a directory whose ``stream.json`` lists, phase by phase, the tar shards of each split, relative
to the directory (or absolute, for shards referenced in place).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from compat.data.shards import IMAGE_EXTS as IMAGE_MEMBERS
from compat.data.shards import ShardError, iter_raw_samples, sample_keys, write_shard
from compat.io import utc_now, write_json_atomic

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


def content_digest(members: Mapping[str, bytes]) -> str:
    """SHA-256 of a sample's picture members (of every member when it has none): what a key names.
    Captions and metadata are left out: a repeat of a picture under another file name is the same sample."""
    names = sorted(e for e in members if e in IMAGE_MEMBERS) or sorted(members)
    digest = hashlib.sha256()
    for ext in names:
        digest.update(f"{ext}:{len(members[ext])}:".encode())
        digest.update(members[ext])
    return digest.hexdigest()


def check_shards(urls: Sequence[str], split: str) -> dict[str, tuple[str, str]]:
    """Every sample key of ``split``'s shards (each read to its end), with its shard and
    :func:`content_digest`; :class:`StreamError` for an unreadable, truncated or empty shard or a repeat."""
    keys: dict[str, tuple[str, str]] = {}
    for url in urls:
        try:
            mine = [(sample.key, content_digest(sample.members)) for sample in iter_raw_samples(url)]
        except ShardError as exc:
            raise StreamError(f"{split} shard is unreadable: {exc}") from exc
        if not mine:
            raise StreamError(f"{split} shard {url} holds no samples; leave it out")
        for key, digest in mine:
            if key in keys:
                raise StreamError(
                    f"sample key {key!r} appears twice in the {split} split ({keys[key][0]} and {url}): "
                    "a key names one sample of the stream; drop the repeat or give it a new key"
                )
            keys[key] = (url, digest)
    return keys


def stream_keys(directory: str | os.PathLike[str], manifest: dict[str, Any] | None = None) -> dict[str, str]:
    """Every sample key of the stream in ``directory``, each with its shard (tar headers only); raise
    :class:`StreamError` naming the phase and shard when one cannot be read."""
    root = Path(directory)
    manifest = manifest if manifest is not None else load_manifest(root)
    held: dict[str, str] = {}
    for entry in manifest["phases"]:
        for split in SPLITS:
            for rel in entry[split]:
                path = root / rel
                try:
                    taken = sample_keys(str(path))
                except ShardError as exc:
                    raise StreamError(f"phase {entry['phase']} of {manifest_path(root)}: {exc}") from exc
                held.update(dict.fromkeys(taken - held.keys(), str(path)))
    return held


def _repeats(root: Path, manifest: dict[str, Any], new: Mapping[str, tuple[str, str]]) -> set[str]:
    """The keys of the new phase that the stream already holds with the same picture bytes (a key it holds
    for other bytes is refused: evaluation, validation and the gallery key samples by it)."""
    held = stream_keys(root, manifest)
    by_shard: dict[str, set[str]] = {}
    for key in new.keys() & held.keys():
        by_shard.setdefault(held[key], set()).add(key)
    for shard, keys in sorted(by_shard.items()):
        try:
            for sample in iter_raw_samples(shard):
                if sample.key not in keys:
                    continue
                url, digest = new[sample.key]
                if content_digest(sample.members) != digest:
                    raise StreamError(
                        f"sample key {sample.key!r} of {url} is already in the stream ({shard}) for other "
                        "picture bytes: a key names one sample of the stream; give the new sample another "
                        "key (`compatflow data import` keys a sample by its content, and the same settings "
                        "store the same picture as the same bytes: import with the stream's --max-side and "
                        "--resize-mode, or leave repeats out with --exclude-stream)"
                    )
        except ShardError as exc:
            raise StreamError(f"{manifest_path(root)}: {exc}") from exc
    return set().union(*by_shard.values()) if by_shard else set()


def add_phase(
    directory: str | os.PathLike[str],
    shards: Mapping[str, Sequence[str]],
    domain: str,
    *,
    description: str = "",
    source: str = "",
    in_place: bool = False,
) -> dict[str, Any]:
    """Append the next phase to the stream in ``directory`` (created when missing); returns its entry.

    Each split's shards are read to their end before anything is written. A sample the stream already holds
    (same key, same :func:`content_digest`) is left out and counted in ``repeats_skipped``; a key held for
    other bytes is refused. The shards are linked (or rewritten without repeats) into a folder renamed into
    place, then the manifest replaced atomically; ``in_place`` lists them where they are instead.
    """
    if not isinstance(domain, str) or not domain.strip():
        raise StreamError("the phase's domain must be a non-empty name (--domain)")
    urls, keys, every = _read_new_shards(shards)
    root = Path(directory)
    if manifest_path(root).is_file():
        load_manifest(root)  # a malformed manifest is refused before anything is written
    else:
        _check_counts({split: len(keys[split]) for split in SPLITS}, {})
    root.mkdir(parents=True, exist_ok=True)
    with _stream_lock(root):
        repeats = _repeats(root, load_manifest(root), every) if manifest_path(root).is_file() else set()
        skipped = {split: len(keys[split].keys() & repeats) for split in SPLITS}
        counts = {split: len(keys[split]) - skipped[split] for split in SPLITS}
        if repeats and not any(counts.values()):
            raise StreamError(
                f"nothing new: all {len(repeats)} samples of the new phase are already in the stream "
                f"{root} (same keys, same picture bytes); nothing was added"
            )
        _check_counts(counts, skipped)
        if repeats and in_place:
            raise StreamError(
                f"{len(repeats)} samples of the new phase are already in the stream: --in-place lists shards "
                "as they are and cannot leave them out; add the phase without --in-place (shards holding "
                "repeats are rewritten without them), or import with --exclude-stream"
            )
        entry = {
            "domain": domain.strip(),
            **({"description": description} if description else {}),
            "counts": counts,
            "repeats_skipped": skipped,
            **({"source": source} if source else {}),
        }
        return _append_locked(root, urls, entry, in_place, repeats)


def _read_new_shards(
    shards: Mapping[str, Sequence[str]],
) -> tuple[dict[str, list[str]], dict[str, dict[str, tuple[str, str]]], dict[str, tuple[str, str]]]:
    """A new phase's shard paths and keys per split (:func:`check_shards`), and all its keys; refuses an
    unknown split, a path that is no file or is listed twice, and a key in two splits."""
    if unknown := sorted(set(shards) - set(SPLITS)):
        raise StreamError(f"unknown split(s) {', '.join(unknown)}; splits are {', '.join(SPLITS)}")
    urls = {split: [str(Path(u).resolve()) for u in shards.get(split, ())] for split in SPLITS}
    for split in SPLITS:
        for url in urls[split]:
            if not Path(url).is_file():
                raise StreamError(f"{split} shard {url} is not a file")
        if dupes := {u for u in urls[split] if urls[split].count(u) > 1}:
            raise StreamError(f"{split} lists {sorted(dupes)[0]} more than once")
    keys = {split: check_shards(urls[split], split) for split in SPLITS}
    every: dict[str, tuple[str, str]] = {}
    for split in SPLITS:
        for key, seen in keys[split].items():
            if key in every:
                raise StreamError(
                    f"sample key {key!r} is in two splits of the new phase ({every[key][0]} and {seen[0]}): "
                    "a key names one sample of the stream"
                )
            every[key] = seen
    return urls, keys, every


def _check_counts(counts: Mapping[str, int], skipped: Mapping[str, int]) -> None:
    for split, least in MIN_COUNTS.items():
        if counts[split] < least:
            repeat = (
                f" once {skipped[split]} already in the stream are left out" if skipped.get(split) else ""
            )
            raise StreamError(
                f"the {split} split holds {counts[split]} samples{repeat}; a phase needs at least {least} "
                f"(give its shards with --{split}, or import with split fractions that leave it some)"
            )


@contextlib.contextmanager
def _stream_lock(root: Path) -> Iterator[None]:
    """Hold ``root/.stream.lock`` until closed (the OS closes it when the holder dies); a second add waits."""
    import fcntl

    with open(root / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _append_locked(
    root: Path, urls: dict[str, list[str]], fields: dict[str, Any], in_place: bool, skip: set[str]
) -> dict[str, Any]:
    path = manifest_path(root)
    manifest = load_manifest(root) if path.is_file() else {"format": FORMAT, "version": VERSION, "phases": []}
    phase = len(manifest["phases"])
    name = f"phase-{phase:02d}"
    if in_place:  # relative to the stream folder when they lie in it
        here = root.resolve()
        listed = {
            s: [Path(u).relative_to(here).as_posix() if Path(u).is_relative_to(here) else u for u in urls[s]]
            for s in SPLITS
        }
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
            for url in urls[split]:
                shard = f"{split}/shard-{len(listed[split]):05d}.tar"
                if _copy_without(Path(url), staging / shard, skip):
                    listed[split].append(f"{name}/{shard}")
        os.replace(staging, final)
    entry = {"phase": phase, **fields, **listed, "added": utc_now()}
    entry = {
        k: entry[k]
        for k in ("phase", "domain", "description", *SPLITS, "counts", "repeats_skipped", "source", "added")
        if k in entry
    }
    updated = {**manifest, "phases": [*manifest["phases"], entry]}
    check_manifest(updated, path)
    write_json_atomic(path, updated)
    return entry


def _copy_without(src: Path, dst: Path, skip: set[str]) -> bool:
    """Put shard ``src`` at ``dst``, linked, or rewritten without the keys of ``skip``; whether it was written
    (not when no sample is left)."""
    if not skip or not (sample_keys(str(src)) & skip):
        try:
            os.link(src, dst)  # shards are never rewritten in place
        except OSError:  # across filesystems
            shutil.copyfile(src, dst)
        return True
    kept = [(s.key, s.members) for s in iter_raw_samples(str(src)) if s.key not in skip]
    if not kept:
        return False
    write_shard(dst, kept)
    return True
