"""How a stream's vocabulary shifts from phase to phase: new words, and captions told in earlier words only.

A caption *uses only earlier words* when every word of it appears in some caption of an earlier phase's
train split: the share of such captions is what a model trained on the earlier phases can read whole.
The synthetic stream's ``realistic`` shift sets it with ``old_word_share`` (about 60 %); the
``disjoint`` shift leaves it near 0. Works on any stream (synthetic or imported): captions come from each
sample's ``.json`` (``captions``, else ``caption``) or its ``.txt``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from compat.data.manifest import load_manifest, phase_urls
from compat.data.shards import iter_raw_samples

WORD = re.compile(r"[a-z0-9]+(?:[-'][a-z0-9]+)*")


def caption_words(caption: str) -> set[str]:
    """The lower-case words of a caption (hyphenated words kept whole)."""
    return set(WORD.findall(caption.lower()))


def sample_captions(members: dict[str, bytes]) -> list[str]:
    """Every caption of one raw sample: the json's ``captions`` list, else its ``caption``, else the txt."""
    if "json" in members:
        try:
            meta = json.loads(members["json"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            meta = {}
        if isinstance(meta, dict):
            caps = meta.get("captions")
            if isinstance(caps, list) and caps and all(isinstance(c, str) for c in caps):
                return list(caps)
            if isinstance(meta.get("caption"), str) and meta["caption"]:
                return [meta["caption"]]
    return [members["txt"].decode("utf-8", errors="replace")] if "txt" in members else []


def iter_phase_captions(
    directory: str | os.PathLike[str], phase: int, split: str, manifest: dict[str, Any]
) -> Iterator[str]:
    """Every caption of ``split`` in ``phase`` of the stream in ``directory``, shard by shard."""
    for url in phase_urls(directory, phase, split, manifest):
        for sample in iter_raw_samples(url):
            yield from sample_captions(sample.members)


def earlier_word_shares(
    directory: str | os.PathLike[str], split: str = "train", manifest: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Per phase: captions, vocabulary size, words new to the stream, and the share of its captions that
    use only words of earlier phases' ``split`` captions (``None`` for phase 0). Raises
    :class:`~compat.data.manifest.StreamError` or :class:`~compat.data.shards.ShardError`."""
    manifest = manifest if manifest is not None else load_manifest(directory)
    seen: set[str] = set()
    rows = []
    for entry in manifest["phases"]:
        phase = entry["phase"]
        word_sets = [caption_words(c) for c in iter_phase_captions(directory, phase, split, manifest)]
        vocab = set().union(*word_sets) if word_sets else set()
        old = sum(1 for w in word_sets if w <= seen)
        rows.append(
            {
                "phase": phase,
                "domain": entry["domain"],
                "captions": len(word_sets),
                "words": len(vocab),
                "new_words": len(vocab - seen),
                "earlier_word_share": round(old / len(word_sets), 4) if phase > 0 and word_sets else None,
            }
        )
        seen |= vocab
    return rows
