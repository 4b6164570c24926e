"""A synthetic, learnable captioned-image stream in img2dataset layout, one domain per phase.

A sample is a scene of one to three objects on a textured background in a rendering style, told by five
template captions (:mod:`compat.data.captions`); the ``disjoint`` and ``realistic`` shifts are those of
:mod:`compat.data.domains`. :func:`generate_stream` writes ``DIR/stream.json`` and
``DIR/phase-PP/{train,eval,gallery}/shard-NNNNN.tar``. Every sample is a pure function of (seed, phase,
split, index): rerunning gives byte-identical shards, so generation resumes shard by shard.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import math
import multiprocessing
import os
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat.data.captions import scene_captions
from compat.data.domains import (
    DEFAULT_OLD_WORD_SHARE,
    SHIFTS,
    SIZE_FRACTIONS,
    Domain,
    RealisticPhase,
    domain_for_phase,
    realistic_phase,
)
from compat.data.manifest import (  # noqa: F401 -- the manifest's owner; re-exported for callers of synth
    FORMAT,
    MANIFEST,
    SPLITS,
    VERSION,
    StreamError,
    load_manifest,
    phase_urls,
)
from compat.data.render import render_scene, shade
from compat.data.shards import write_shard
from compat.io import read_json, write_json_atomic
from compat.progress import track

log = logging.getLogger(__name__)

PENDING = ".generating.json"
JPEG_QUALITY = 90
GENERATOR_VERSION = 1
MIN_CONTRAST = 110.0
FORCED_SLOTS = ("kind", "colour", "tone")  # named by all five caption templates (texture and style are not)


def sample_key(phase: int, split: str, index: int) -> str:
    """The key of sample ``index`` of ``split`` in ``phase``: ``p{PP}-{split}-{index:06d}``."""
    return f"p{phase:02d}-{split}-{index:06d}"


def shard_path(phase: int, split: str, shard: int) -> str:
    """Relative path of a shard: ``phase-PP/{split}/shard-NNNNN.tar``."""
    return f"phase-{phase:02d}/{split}/shard-{shard:05d}.tar"


def _texture_params(texture: str, rng: random.Random) -> dict[str, Any]:
    r4 = lambda lo, hi: round(rng.uniform(lo, hi), 4)  # noqa: E731
    draws = {  # each texture's parameters, drawn only for the texture asked
        "stripes": lambda: {"angle": rng.choice([0, 45, 90, 135]), "period": r4(0.08, 0.16)},
        "checks": lambda: {"period": r4(0.08, 0.16)},
        "dots": lambda: {"period": r4(0.1, 0.18), "radius": r4(0.2, 0.3)},
        "weave": lambda: {"period": r4(0.06, 0.12)},
        "gradient": lambda: {"direction": rng.choice(["down", "up"])},
        "noise": lambda: {"seed": rng.getrandbits(32), "cells": rng.choice([4, 6, 8])},
        "waves": lambda: {"period": r4(0.1, 0.2), "amplitude": r4(0.5, 2.0)},
        "bubbles": lambda: {"seed": rng.getrandbits(32), "count": rng.randint(6, 14)},
    }
    return draws.get(texture, dict)()


def sample_scene(domain: Domain, rng: random.Random) -> dict[str, Any]:
    """Draw a structured scene from ``domain``: background, style and 1-3 objects in distinct grid cells."""
    background = rng.choice(domain.backgrounds)
    tone_name, tone_rgb = rng.choice(domain.tones)
    style = rng.choice(domain.styles)
    backdrop = shade(tone_rgb, 0.3) if style.effect == "neon" else tone_rgb
    colours = [c for c in domain.colours if math.dist(c[1], backdrop) >= MIN_CONTRAST] or list(domain.colours)
    count = rng.choices((1, 2, 3), weights=(0.4, 0.4, 0.2))[0]
    objects = []
    for cell in sorted(rng.sample(range(9), count)):
        row, col = divmod(cell, 3)
        kind = rng.choice(domain.kinds)
        size = rng.randrange(3)
        colour_name, rgb = rng.choice(colours)
        objects.append(_placed_object(domain, kind, size, colour_name, rgb, row, col, rng))
    return _scene(domain, style, background, tone_name, tone_rgb, objects, rng)


def sample_realistic_scene(plan: RealisticPhase, rng: random.Random, old_word_share: float) -> dict[str, Any]:
    """Draw a scene of the realistic stream at ``plan.phase``.

    From phase 1 on, a scene is *familiar* with probability ``old_word_share`` (every item from the core or
    an earlier phase). Otherwise it is *novel*: one slot every caption names (the first object's kind or
    colour, or the tone) takes an item the phase brings, the others are drawn from everything available.
    Items are weighted by :meth:`RealisticPhase.weight`, so the newest are common and older ones fade.
    """
    domain = plan.domain
    pools = domain.slot_items()
    new_slots = [s for s in FORCED_SLOTS if any(plan.is_new(s, n) for n, _ in pools[s])]
    novel = plan.phase > 0 and bool(new_slots) and rng.random() >= old_word_share
    forced = rng.choice(new_slots) if novel else None

    def pick(slot: str, items: list[tuple[str, Any]], first: bool = True) -> Any:
        if slot == forced and first:
            items = [(n, x) for n, x in items if plan.is_new(slot, n)] or [
                (n, x) for n, x in pools[slot] if plan.is_new(slot, n)
            ]
        elif not novel:
            items = [(n, x) for n, x in items if not plan.is_new(slot, n)] or [
                (n, x) for n, x in pools[slot] if not plan.is_new(slot, n)
            ]
        weights = [plan.weight(slot, n) for n, _ in items]
        return rng.choices([x for _, x in items], weights=weights)[0]

    background = pick("background", pools["background"])
    tone_name, tone_rgb = pick("tone", pools["tone"])
    style = pick("style", pools["style"])
    backdrop = shade(tone_rgb, 0.3) if style.effect == "neon" else tone_rgb
    colours = [(n, c) for n, c in pools["colour"] if math.dist(c[1], backdrop) >= MIN_CONTRAST]
    count = rng.choices((1, 2, 3), weights=(0.4, 0.4, 0.2))[0]
    objects = []
    for i, cell in enumerate(sorted(rng.sample(range(9), count))):
        row, col = divmod(cell, 3)
        kind = pick("kind", pools["kind"], first=i == 0)
        colour_name, rgb = pick("colour", colours or pools["colour"], first=i == 0)
        size = rng.randrange(3)
        objects.append(_placed_object(domain, kind, size, colour_name, rgb, row, col, rng))
    return {**_scene(domain, style, background, tone_name, tone_rgb, objects, rng), "novel": novel}


def _placed_object(
    domain: Any, kind: Any, size: int, colour_name: str, rgb: Any, row: int, col: int, rng: random.Random
) -> dict[str, Any]:
    """One object of a scene in grid cell (row, col), jittered by two draws of ``rng``."""
    cx = (col + 0.5) / 3 + rng.uniform(-0.04, 0.04)
    cy = (row + 0.5) / 3 + rng.uniform(-0.04, 0.04)
    half = SIZE_FRACTIONS[size] / 2
    return {
        "kind": kind.names[0],
        "colour": colour_name,
        "rgb": list(rgb),
        "size": domain.sizes[size],
        "position": domain.position_name(row, col),
        "cell": [row, col],
        "box": [round(cx - half, 4), round(cy - half, 4), round(cx + half, 4), round(cy + half, 4)],
    }


def _scene(
    domain: Any, style: Any, background: Any, tone_name: str, tone_rgb: Any, objects: list, rng: random.Random
) -> dict[str, Any]:
    """A scene description: its objects on a textured background (the texture drawn from ``rng``)."""
    return {
        "domain": domain.name,
        "style": style.name,
        "style_effect": style.effect,
        "effect_seed": rng.getrandbits(32),
        "background": {
            "name": background.name,
            "texture": background.texture,
            "tone": tone_name,
            "rgb": list(tone_rgb),
            "params": _texture_params(background.texture, rng),
        },
        "count": len(objects),
        "objects": objects,
    }


def scene_domain(phase: int, shift: str) -> Domain:
    """The domain a phase's scenes are drawn and rendered from under ``shift``."""
    if shift not in SHIFTS:
        raise ValueError(f"shift must be one of {', '.join(SHIFTS)}, got {shift!r}")
    return realistic_phase(phase).domain if shift == "realistic" else domain_for_phase(phase)


def make_sample(
    seed: int,
    phase: int,
    split: str,
    index: int,
    image_size: int,
    shift: str = "disjoint",
    old_word_share: float = DEFAULT_OLD_WORD_SHARE,
) -> tuple[str, dict[str, bytes]]:
    """Sample ``index`` of ``split`` in ``phase``: its key and members. Train samples shuffle their five
    captions (so the ``.txt`` one varies in phrasing); eval and gallery keep template order."""
    domain = scene_domain(phase, shift)
    if shift == "realistic":
        rng = random.Random(f"compatflow-synth-realistic/{seed}/{old_word_share!r}/{phase}/{split}/{index}")
        scene = sample_realistic_scene(realistic_phase(phase), rng, old_word_share)
    else:
        rng = random.Random(f"compatflow-synth/{seed}/{phase}/{split}/{index}")
        scene = sample_scene(domain, rng)
    buf = io.BytesIO()
    render_scene(scene, domain, image_size).save(buf, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
    jpg = buf.getvalue()
    captions = scene_captions(scene, domain)
    if split == "train":
        rng.shuffle(captions)
    return sample_members(
        sample_key(phase, split, index),
        jpg,
        captions,
        width=image_size,
        height=image_size,
        sha256=hashlib.sha256(jpg).hexdigest(),
        status="success",
        phase=phase,
        domain=domain.name,
        split=split,
        scene=scene,
    )


def sample_members(key: str, jpg: bytes, captions: list[str], **meta: Any) -> tuple[str, dict[str, bytes]]:
    """A sample as :func:`write_shard` takes it: the JPEG, the first caption as ``.txt``, and ``.json``
    holding the key, the captions and ``meta`` (in that order)."""
    doc = {"key": key, "caption": captions[0], "captions": captions, **meta}
    encoded = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return key, {"jpg": jpg, "txt": captions[0].encode("utf-8"), "json": encoded}


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: samples ``start .. start+count-1`` of ``split`` in ``phase``."""

    path: str
    phase: int
    split: str
    start: int
    count: int


def _write_job(
    out_dir: str, seed: int, image_size: int, shift: str, old_word_share: float, job: ShardJob
) -> int:
    samples = (
        make_sample(seed, job.phase, job.split, i, image_size, shift, old_word_share)
        for i in range(job.start, job.start + job.count)
    )
    return write_shard(Path(out_dir) / job.path, samples)


def plan_phase(phase: int, counts: dict[str, int], samples_per_shard: int) -> list[ShardJob]:
    """The shard jobs of one phase, split by split."""
    return [
        ShardJob(
            shard_path(phase, split, s), phase, split, start, min(samples_per_shard, counts[split] - start)
        )
        for split in SPLITS
        for s, start in enumerate(range(0, counts[split], samples_per_shard))
    ]


def _check_settings(found: dict[str, Any], wanted: dict[str, Any], source: Path) -> None:
    found = {"shift": "disjoint", **found}  # streams written before the realistic shift existed
    if diff := {k: (found.get(k), v) for k, v in wanted.items() if found.get(k) != v}:
        detail = ", ".join(f"{k}: {a!r} there, {b!r} asked" for k, (a, b) in diff.items())
        raise StreamError(
            f"{source} was generated with other settings ({detail}); "
            "use another output directory or delete this one"
        )


def _check_existing(out: Path, settings: dict[str, Any], phases: int) -> None:
    """Refuse a directory generated with other settings, holding more phases, or holding other files."""
    manifest_path, pending_path = out / MANIFEST, out / PENDING
    if manifest_path.exists():
        existing = load_manifest(out)
        _check_settings(existing.get("generator", {}), settings, manifest_path)
        if len(existing["phases"]) > phases:
            raise StreamError(
                f"{manifest_path} holds {len(existing['phases'])} phases, {phases} asked; "
                "a stream is only ever extended"
            )
    pending = read_json(pending_path, lambda why: StreamError(f"{why}; delete {out}, generate again"))
    if pending is not None:
        _check_settings(pending, settings, pending_path)
    elif not manifest_path.exists() and out.exists() and any(out.glob("phase-*")):
        raise StreamError(
            f"{out} holds phase directories but no {MANIFEST} or {PENDING}; use an empty output directory"
        )


def _run_jobs(write: Callable[[ShardJob], int], jobs: list[ShardJob], workers: int) -> None:
    """``write`` (picklable) each job, in ``workers`` processes when there are several."""
    desc = f"writing {len(jobs)} shards ({sum(j.count for j in jobs)} samples)"
    with contextlib.ExitStack() as stack:
        run = map
        if workers > 1 and len(jobs) > 1:  # spawned: the parent may hold torch threads
            ctx = multiprocessing.get_context("spawn")
            run = stack.enter_context(ProcessPoolExecutor(max_workers=workers, mp_context=ctx)).map
        for _ in track(run(write, jobs), desc, total=len(jobs)):
            pass


def _plan_stream(
    out: Path, settings: dict[str, Any], phases: int
) -> tuple[dict[str, Any], list[ShardJob], int]:
    """The manifest of the stream ``settings`` describes, the shard jobs still missing in ``out`` and the
    number of shards in all."""
    counts = {"train": settings["samples_per_phase"], "eval": settings["eval_per_domain"]}
    counts["gallery"] = settings["gallery_per_domain"]
    entries, todo, n_shards = [], [], 0
    for phase in range(phases):
        domain = scene_domain(phase, settings["shift"])
        jobs = plan_phase(phase, counts, settings["samples_per_shard"])
        n_shards += len(jobs)
        todo += [j for j in jobs if not (out / j.path).is_file()]
        paths = {split: [j.path for j in jobs if j.split == split] for split in SPLITS}
        entry = {"phase": phase, "domain": domain.name, "description": domain.description}
        entries.append({**entry, **paths, "counts": dict(counts)})
    header = {"format": FORMAT, "version": VERSION, "seed": settings["seed"]}
    manifest = {**header, "image_size": settings["image_size"], "generator": settings, "phases": entries}
    return manifest, todo, n_shards


def generate_stream(
    out_dir: str | os.PathLike[str],
    phases: int,
    samples_per_phase: int,
    seed: int,
    *,
    eval_per_domain: int = 200,
    gallery_per_domain: int = 500,
    image_size: int = 64,
    samples_per_shard: int = 1000,
    workers: int = 1,
    shift: str = "disjoint",
    old_word_share: float = DEFAULT_OLD_WORD_SHARE,
) -> dict[str, Any]:
    """Write (or complete, or extend with more ``phases``) the stream in ``out_dir``; return its manifest.
    ``shift``: see the module doc. Other settings than those a directory was generated with raise
    :class:`StreamError`."""
    for name, value, low in (
        ("phases", phases, 1),
        ("samples_per_phase", samples_per_phase, 1),
        ("eval_per_domain", eval_per_domain, 0),
        ("gallery_per_domain", gallery_per_domain, 0),
        ("image_size", image_size, 16),
        ("samples_per_shard", samples_per_shard, 1),
        ("workers", workers, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if shift not in SHIFTS:
        raise ValueError(f"shift must be one of {', '.join(SHIFTS)}, got {shift!r}")
    if not isinstance(old_word_share, (int, float)) or not 0.0 <= old_word_share <= 1.0:
        raise ValueError(f"old_word_share must be a number in [0, 1], got {old_word_share!r}")
    old_word_share = float(old_word_share)
    out = Path(out_dir)
    settings = {
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "samples_per_phase": samples_per_phase,
        "eval_per_domain": eval_per_domain,
        "gallery_per_domain": gallery_per_domain,
        "image_size": image_size,
        "samples_per_shard": samples_per_shard,
        "shift": shift,
        **({"old_word_share": old_word_share} if shift == "realistic" else {}),
    }
    _check_existing(out, settings, phases)
    manifest_path, pending_path = out / MANIFEST, out / PENDING
    manifest, todo, n_shards = _plan_stream(out, settings, phases)
    if not todo and manifest_path.exists() and load_manifest(out) == manifest:
        return manifest  # complete: nothing is written
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(pending_path, settings)
    for stale in out.glob("phase-*/*/.shard-*.tar.*.tmp"):  # compat.io.atomic_write's temporaries
        stale.unlink()
    if todo:
        log.info("writing %d of %d shards into %s", len(todo), n_shards, out)
        write = functools.partial(_write_job, str(out), seed, image_size, shift, old_word_share)
        _run_jobs(write, todo, workers)
    write_json_atomic(manifest_path, manifest)
    pending_path.unlink()
    return manifest
