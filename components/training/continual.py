"""The ``continual`` step: train the next model on the newest data phase, evaluate it on every domain so far.

Methods (one trainer, one schedule and data order):

- ``modx``: the student starts from the production model, the frozen production model is the teacher,
  loss = InfoNCE + alpha * Mod-X KL (``training.alpha``; the paper's is 20). The paper's continual method.
- ``finetune``: the same start, alpha = 0 (the paper's CLIP_ct, the lower baseline).
- ``joint``: trains on the train shards of phases 0..P together, from the given start model (pass CLIP_0,
  the phase-0 model, for the paper's joint-training upper bound), alpha = 0.
- ``foundation``: the foundation-swap upgrade: a new architecture (``config_name``, e.g. a wider vision
  tower with the pretrained MiniLM text tower) trained from its own initialisation on the train shards of
  phases 0..P, alpha = 0; production is only the model it is compared with (and later made compatible to).

Phase 0 without a production model trains CLIP_0. Under ``torchrun`` every rank trains (DDP); rank 0 alone
evaluates and writes ``model/``, ``metrics.json``, ``spatial_disorder.json`` and ``train/`` in ``out_dir``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.state.run_dir import METRICS_FILE
from components.state.run_dir import SPATIAL_DISORDER_FILE as SD_FILE

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from compat.data.loader import CaptionedSet
    from compat.models import ClipBundle

log = logging.getLogger(__name__)

METHODS = ("modx", "finetune", "joint", "foundation")
ALL_PHASES = ("joint", "foundation")  # methods that train on phases 0..P
MODEL_DIR = "model"
TRAIN_DIR = "train"
CURVE_KEYS = ("step", "loss", "contrastive", "kl", "logit_scale", "lr", "teacher_rows_kept")


class ContinualError(ValueError):
    """Bad arguments or inputs to the continual step; the message says what to change."""


@dataclass
class EvalSet:
    """One domain's evaluation set, read once and shared by every model evaluated on it."""

    phase: int
    domain: str
    data: CaptionedSet


@dataclass
class Embedded:
    images: torch.Tensor
    texts: torch.Tensor  # every caption, image by image
    captions_per_image: list[int]

    def first_captions(self) -> torch.Tensor:
        """One text per image (its first caption), for the paired Spatial Disorder diagnostics."""
        import torch

        starts = torch.tensor([0, *self.captions_per_image[:-1]]).cumsum(0)
        return self.texts[starts]


def embed_set(bundle: ClipBundle, data: CaptionedSet, device: str, batch_size: int = 256) -> Embedded:
    """L2-normalised embeddings of every image and every caption of ``data`` under ``bundle``."""
    counts = [len(c) for c in data.captions]
    flat = [c for caps in data.captions for c in caps]
    return Embedded(
        bundle.encode_images(data.images, batch_size=batch_size, device=device),
        bundle.encode_texts(flat, batch_size=batch_size, device=device),
        counts,
    )


def evaluate_domains(
    bundle: ClipBundle, sets: Sequence[EvalSet], device: str, batch_size: int = 256
) -> tuple[dict[str, dict[str, Any]], dict[str, Embedded]]:
    """Multi-caption R@1/5/10 in both directions on every set, keyed by domain name."""
    from compat.metrics import retrieval_metrics

    results, embedded = {}, {}
    for s in sets:
        emb = embed_set(bundle, s.data, device, batch_size)
        embedded[s.domain] = emb
        results[s.domain] = {
            "phase": s.phase,
            "n_images": len(s.data),
            "n_captions": int(emb.texts.shape[0]),
            **retrieval_metrics(emb.images, emb.texts, emb.captions_per_image),
        }
    return results, embedded


def _checked_phase(
    settings: TrainingSettings, stream: Path, phase: int, production: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stream's manifest and ``phase``'s entry in it; refuses an unknown method, a phase the stream lacks,
    and a later phase without the production model."""
    from compat.data.synth import load_manifest

    if settings.method not in METHODS:
        raise ContinualError(f"method must be one of {', '.join(METHODS)}, got {settings.method!r}")
    manifest = load_manifest(stream)
    phases = manifest["phases"]
    if not 0 <= phase < len(phases):
        raise ContinualError(
            f"{stream / 'stream.json'} has phases 0..{len(phases) - 1}; --phase {phase} asked"
        )
    if production is None and phase != 0:
        raise ContinualError(
            f"phase {phase} needs the production model (--production CKPT); only phase 0 "
            "trains CLIP_0 from scratch"
        )
    return manifest, phases[phase]


def _train_urls(
    stream: Path, manifest: dict[str, Any], phase: int, method: str, train_urls: Sequence[str] | None
) -> list[str]:
    from compat.data.loader import expand_urls
    from compat.data.synth import phase_urls

    newest = expand_urls(list(train_urls)) if train_urls else phase_urls(stream, phase, "train", manifest)
    earlier = _earlier_train_urls(stream, manifest, phase) if method in ALL_PHASES else []
    return [u for urls in earlier for u in urls] + newest


# The deployment's ``training`` section field -> TrainingSettings field: every section field is here or in
# NOT_CARRIED (a test holds it), so that a new training setting cannot be dropped on its way to the trainer.
SECTION_FIELDS: dict[str, str] = {"model_config_name": "config_name"} | {
    name: name
    for name in (
        "pretrained weights_dir resize_mode method alpha replay_buffer_size replay_rows steps "
        "checkpoint_every batch_size lr warmup_fraction device seed loader_workers"
    ).split()
}
# Section fields the step uses before it builds the settings, and what they become.
NOT_CARRIED: dict[str, str] = {
    "epochs": "the continual step turns it into `steps` (components.steps.training.training_budget)",
}


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """How one phase is trained: the deployment's ``training`` section (:meth:`from_section`, which owns the
    defaults) plus the trainer's own settings. ``selective_correction=False`` drops Mod-X's Eq 3 (a benchmark
    ablation). ``replay_buffer_size`` > 0: the last ``replay_rows`` rows of every batch come from a buffer of
    earlier phases' pairs -- the Mod-X paper's "Mod-X + buffer" (Table 2). ``pretrained`` and
    ``resize_mode`` apply to the bootstrap (CLIP_0) only."""

    # the deployment's training section (SECTION_FIELDS)
    config_name: str
    method: str
    alpha: float | None
    steps: int
    batch_size: int
    lr: float
    warmup_fraction: float
    checkpoint_every: int
    seed: int
    device: str
    replay_buffer_size: int
    replay_rows: int
    pretrained: str | None
    weights_dir: str | None  # where a pretrained tag is looked up first (``<dir>/<ARCH>/<TAG>/``)
    resize_mode: str | None
    loader_workers: int  # processes decoding (and transforming) training images; 0: this process
    # the trainer's own (no config key)
    accum_steps: int = 1
    weight_decay: float = 0.2
    precision: str = "auto"
    eval_batch_size: int = 256
    selective_correction: bool = True

    @classmethod
    def from_section(cls, training: Any, **fields: Any) -> TrainingSettings:
        """The settings the ``training`` section names (:data:`SECTION_FIELDS`), then ``fields`` (the
        trainer's own and any a caller overrides); the section's ``alpha`` is carried for ``modx`` only."""
        settings = {setting: getattr(training, key) for key, setting in SECTION_FIELDS.items()} | fields
        if settings["method"] != "modx" and "alpha" not in fields:
            settings["alpha"] = None
        return cls(**settings)


def run_continual(
    stream: str | Path,
    phase: int,
    out_dir: str | Path,
    settings: TrainingSettings,
    *,
    production: str | Path | None = None,
    train_urls: Sequence[str] | None = None,
    replay_urls: Sequence[Sequence[str]] | None = None,
    version: str | None = None,
    resume: bool = True,
    train_dir: str | Path | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Run the step and return the metrics document (also written to ``out_dir/metrics.json``).
    ``train_urls`` / ``replay_urls`` (one list per earlier phase) replace the manifest's shards;
    ``production`` is the teacher and the student's start; a run resumes from ``train_dir``."""
    from compat.io import write_json_atomic
    from compat.models import save_checkpoint
    from compat.production import load_production
    from compat.training import init_distributed, shutdown_distributed, train

    stream, out_dir = Path(stream), Path(out_dir)
    manifest, entry = _checked_phase(settings, stream, phase, production)
    method_used, alpha_used = _method_and_alpha(settings, bootstrap=production is None)
    run = {"phase": phase, "domain": entry["domain"], "method": method_used, "alpha": alpha_used}
    dist = init_distributed()
    dev = _device(settings.device, dist)
    parent = None if production is None else load_production(production, device=dev)
    student, teacher = _student_and_teacher(settings, parent, method_used, dev)
    _say_when_resized(manifest, student)
    urls = _train_urls(stream, manifest, phase, method_used, train_urls)
    replay = settings.replay_buffer_size > 0 and method_used in ("modx", "finetune")
    config = _train_config(settings, alpha_used)
    _log_plan(run, settings, len(urls), replay)
    t0 = time.perf_counter()
    workdir = Path(train_dir) if train_dir is not None else out_dir / TRAIN_DIR
    earlier = (replay_urls or _earlier_train_urls(stream, manifest, phase)) if replay else None
    source = _batch_source(settings, student, urls, earlier)
    result = train(
        student, source, config, workdir, teacher=teacher, dist=dist, resume=resume, on_step=on_step
    )
    train_wall = time.perf_counter() - t0
    if not dist.is_main:
        shutdown_distributed()
        return {}
    version = version or f"phase-{phase:02d}-{method_used}"
    replay_doc = (
        {"buffer_size": settings.replay_buffer_size, "rows": settings.replay_rows} if replay else None
    )
    extra = {
        **run,
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "replay": replay_doc,
        "seed": settings.seed,
        "stream_seed": manifest.get("seed"),  # synthetic streams only
        "parent": None if parent is None else {"version": parent.version, "sha256": parent.sha256},
    }
    # the candidate's sidecar records the run, the settings and the model it started from
    sidecar = save_checkpoint(student, out_dir / MODEL_DIR, version=version, extra=extra)
    sets = _eval_sets(stream, manifest, phase, student.image_size)
    candidate, start_metrics, sd_doc = _evaluate(student, parent, sets, dev, settings, run, version, out_dir)
    doc = {
        "step": "continual",
        **run,
        "model_config": student.config_name,
        "candidate": {"path": str(sidecar.parent), "version": version},
        "production": None if parent is None else parent.describe(),
        "training": {
            **config.to_dict(),
            "train_shards": len(urls),
            "replay": replay_doc,
            "world_size": dist.world_size,
            "device": dev,
            "wall_s": round(train_wall, 3),
            **_trained(result),
        },
        "domains": candidate,
        "start_domains": start_metrics,
        "forgetting_r1": None if start_metrics is None else _forgetting(candidate, start_metrics),
        "spatial_disorder": SD_FILE if sd_doc is not None else None,
        "curve": [{k: h[k] for k in CURVE_KEYS if k in h} for h in result.state.history],
    }
    write_json_atomic(out_dir / METRICS_FILE, doc)
    shutdown_distributed()
    return doc


def _evaluate(
    student: ClipBundle,
    parent: Any,
    sets: list[EvalSet],
    device: str,
    settings: TrainingSettings,
    run: dict[str, Any],
    version: str,
    out_dir: Path,
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """The candidate's metrics on every domain so far; with a production model, its metrics and the Spatial
    Disorder (RAM/SAM/ImAV, Mod-X Sec 3.2, App B.2) of the newest domain, production against the candidate
    (written to ``out_dir``; None without a production model or when the two embed in different dimensions:
    rotation angles need one)."""
    from compat.io import write_json_atomic
    from compat.metrics import spatial_disorder

    candidate, cand_emb = evaluate_domains(student, sets, device, settings.eval_batch_size)
    if parent is None:
        return candidate, None, None
    start_metrics, start_emb = evaluate_domains(parent.encoder, sets, device, settings.eval_batch_size)
    before, after = start_emb[run["domain"]], cand_emb[run["domain"]]
    if before.images.shape[1] != after.images.shape[1]:
        return candidate, start_metrics, None
    sd_doc = {
        "phase": run["phase"],
        "domain": run["domain"],
        "old_model": parent.version,
        "new_model": version,
        **spatial_disorder(before.images, before.first_captions(), after.images, after.first_captions()),
    }
    write_json_atomic(out_dir / SD_FILE, sd_doc)
    return candidate, start_metrics, sd_doc


def _log_plan(run: dict[str, Any], settings: TrainingSettings, shards: int, replay: bool) -> None:
    replayed = (
        f" ({settings.replay_rows} rows per batch replayed from {settings.replay_buffer_size} earlier pairs)"
    )
    steps = f"{settings.steps} steps x {settings.batch_size} pairs on {shards} shards"
    plan = f"{run['method']}, alpha {run['alpha']:g}, {steps}" + (replayed if replay else "")
    log.info("phase %d (%s): %s", run["phase"], run["domain"], plan)


def _method_and_alpha(settings: TrainingSettings, *, bootstrap: bool) -> tuple[str, float]:
    """The method a run trains with and its Mod-X weight: phase 0 trains CLIP_0 (``clip0``, alpha 0);
    ``modx`` takes its alpha (``training.alpha``), every other method trains with alpha 0."""
    if bootstrap:
        return "clip0", 0.0
    method, alpha = settings.method, settings.alpha
    if method != "modx":
        if alpha not in (None, 0, 0.0):
            raise ContinualError(f"--alpha {alpha} applies to modx only; {method} trains with alpha = 0")
        return method, 0.0
    if alpha is None:
        raise ContinualError("modx needs its Mod-X weight: set training.alpha (--alpha)")
    return method, float(alpha)


def _device(device: str, dist: Any) -> str:
    """The torch device this rank trains on (``cuda:<local rank>`` under DDP)."""
    from compat.device import resolve_device

    try:
        dev = str(resolve_device(device))
    except ValueError as exc:
        raise ContinualError(str(exc)) from exc
    return f"cuda:{dist.local_rank}" if dev == "cuda" and dist.distributed else dev


def _student_and_teacher(
    settings: TrainingSettings, parent: Any, method: str, device: str
) -> tuple[ClipBundle, ClipBundle | None]:
    """The model to train and Mod-X's frozen teacher (None for every other method): CLIP_0 from its config
    (and its pretrained start); a foundation swap from the new config; else production's backbone network,
    whatever method produced production (the serving encoder is the start model the step evaluates)."""
    from compat.models import build_model

    if parent is None:
        student = build_model(
            settings.config_name,
            device=device,
            seed=settings.seed,
            pretrained=settings.pretrained,
            resize_mode=settings.resize_mode,
            weights_dirs=[settings.weights_dir] if settings.weights_dir else (),
        )
    elif method == "foundation":
        student = build_model(settings.config_name, device=device, seed=settings.seed)
    else:
        student = parent.backbone(device=device)
        if student.config_name != settings.config_name:
            name, configured = student.config_name, settings.config_name
            log.info(f"production model is {name}; training that config (not {configured})")
    teacher = parent.backbone(device=device) if method == "modx" else None
    return student, teacher


def _say_when_resized(manifest: dict[str, Any], student: ClipBundle) -> None:
    stream_size = manifest.get("image_size")  # synthetic streams record the size they rendered
    if stream_size is not None and int(stream_size) != student.image_size:
        log.warning(
            f"the stream's images are {stream_size}px but {student.config_name} takes "
            f"{student.image_size}px: they are resized ({student.resize_mode}) to the model's size"
        )


def _earlier_train_urls(stream: Path, manifest: dict[str, Any], phase: int) -> list[list[str]]:
    from compat.data.synth import phase_urls

    return [phase_urls(stream, q, "train", manifest) for q in range(phase)]


def _batch_source(
    settings: TrainingSettings, student: ClipBundle, urls: list[str], earlier: Sequence[Sequence[str]] | None
) -> Any:
    """The training batches: the phase's shards, with the last ``replay_rows`` rows of each batch from a
    buffer of earlier phases' pairs when ``earlier`` is given (Mod-X + buffer, paper Table 2)."""
    from compat.training import ReplayBatchSource, ReplayBuffer, ShardBatchSource

    transforms = (student.preprocess_train, student.tokenizer)
    common = {"seed": settings.seed, "image_size": student.image_size, "workers": settings.loader_workers}
    if earlier is None:
        return ShardBatchSource(urls, settings.batch_size, *transforms, **common)
    buffer = ReplayBuffer.from_phases(
        earlier, settings.replay_buffer_size, seed=settings.seed, image_size=student.image_size
    )
    return ReplayBatchSource(urls, buffer, settings.batch_size, settings.replay_rows, *transforms, **common)


def _train_config(settings: TrainingSettings, alpha: float) -> Any:
    """The trainer's config: every setting it shares with ``settings`` (the rest keep the library's
    defaults), and the run's Mod-X weight."""
    from dataclasses import fields

    from compat.training import TrainConfig

    shared = {f.name for f in fields(TrainConfig)} & {f.name for f in fields(settings)}
    return TrainConfig(**{**{name: getattr(settings, name) for name in shared}, "alpha": alpha})


def _eval_sets(stream: Path, manifest: dict[str, Any], phase: int, image_size: int) -> list[EvalSet]:
    """Every domain's evaluation set so far (phases 0..``phase``), decoded at the model's input size."""
    from compat.data.loader import load_captioned_set
    from compat.data.synth import phase_urls

    sets = []
    for q in range(phase + 1):
        urls = phase_urls(stream, q, "eval", manifest)
        data = load_captioned_set(urls, image_size=image_size)
        if len(data) < 2:
            raise ContinualError(
                f"phase {q}'s eval split ({urls}) holds {len(data)} samples; retrieval "
                "metrics need at least 2 (generate the stream with eval samples)"
            )
        sets.append(EvalSet(q, manifest["phases"][q]["domain"], data))
    return sets


def _trained(result: Any) -> dict[str, Any]:
    """What training did: samples seen, the step it resumed from, the steady-state step time (the median,
    first step left out: it builds the caches) and how many teacher rows Mod-X kept on average."""
    times = result.step_times[1:] or result.step_times
    kept = [h["teacher_rows_kept"] for h in result.state.history if "teacher_rows_kept" in h]
    return {
        "samples_seen": result.state.samples_seen,
        "resumed_from_step": result.resumed_from,
        "median_step_s": round(sorted(times)[len(times) // 2], 5) if times else None,
        "teacher_rows_kept_mean": round(sum(kept) / len(kept), 4) if kept else None,
    }


def _forgetting(candidate: dict[str, Any], start: dict[str, Any]) -> dict[str, dict[str, float]]:
    """R@1 change per domain and direction from the start model to the candidate (negative: forgotten)."""
    return {
        d: {k: round(candidate[d][k]["R@1"] - start[d][k]["R@1"], 3) for k in ("t2i", "i2t")}
        for d in candidate
    }
