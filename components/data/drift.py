"""Drift step: the new data phase against a reference phase, with Evidently (0.7 API).

Signals, per column: caption statistics and the share of words the reference never uses, image statistics
and, with a production model, both towers' embeddings (Evidently's domain classifier, ROC AUC). Two samples
of one distribution never score 0, so each signal is calibrated on the reference itself: the largest score
between ``NOISE_SPLITS`` random halves of it is its noise floor, and only the excess is banded by
:data:`SEVERITY_BANDS`. Writes ``drift.json`` (``schemas/drift_summary.schema.json``) and an HTML report.
"""

from __future__ import annotations

import bisect
import colorsys
import logging
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import schemas
from compat.io import write_json_atomic
from components.state.run_dir import DRIFT_FILE, DRIFT_REPORT_FILE

logger = logging.getLogger(__name__)

SEVERITIES = ("none", "low", "medium", "high")
# Upper bounds (exclusive) of none / low / medium per score kind; at or above the last: high.
SEVERITY_BANDS: dict[str, tuple[float, float, float]] = {
    "wasserstein": (0.1, 0.2, 0.4),
    "jensenshannon": (0.1, 0.2, 0.4),
    "model": (0.55, 0.7, 0.85),
    "oov_rate": (0.01, 0.05, 0.15),
}
NUMERIC_COLUMNS = {  # numeric column -> its signal family
    **dict.fromkeys(("caption_chars", "caption_words"), "caption"),
    **dict.fromkeys(("image_width", "image_height", "image_brightness", "image_contrast"), "image"),
    **dict.fromkeys(("image_saturation", "image_edge_density"), "image"),
}
CATEGORICAL_COLUMNS = {"image_dominant_hue": "image"}
HUE_NAMES = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "magenta", "grey")
NO_DRIFT_SCORE = {"wasserstein": 0.0, "jensenshannon": 0.0, "model": 0.5, "oov_rate": 0.0}
NOISE_SPLITS = 10  # random halves of the reference scored against each other, per signal
STATISTICS_IMAGE_SIZE = 128  # short side the image statistics are computed at (larger pictures scaled down)
EVIDENTLY_SERIES = "0.7"  # the release series written for: before 1.0 a minor release may break the API


def evidently_version_problem(installed: str) -> str | None:
    """Why this adapter cannot run on Evidently ``installed`` (another release series), or None."""
    series = ".".join(installed.split(".")[:2])
    if series == EVIDENTLY_SERIES:
        return None
    return (
        f"components/data/drift.py is written for Evidently {EVIDENTLY_SERIES}.x (its Report, Dataset, "
        f"DataDefinition, ValueDrift, EmbeddingsDrift and ModelDriftMethod, and the scores they return), but "
        f"Evidently {installed} is installed: install the version pinned in requirements/base.txt, or port "
        f"the adapter to {series} and set EVIDENTLY_SERIES"
    )


def check_evidently_version() -> None:
    """Raise ``RuntimeError`` naming both versions when the installed Evidently is another release series."""
    from importlib.metadata import version

    problem = evidently_version_problem(version("evidently"))
    if problem:
        raise RuntimeError(problem)


def embedding_drift_method() -> Any:
    """Evidently's domain-classifier embedding drift, one configuration for the report and the noise floors
    (bootstrap only moves Evidently's own drift flag, which this step does not read)."""
    from evidently.metrics.embeddings import ModelDriftMethod

    return ModelDriftMethod(threshold=SEVERITY_BANDS["model"][0], bootstrap=False)


def evidently_scores(
    reference_df: Any,
    current_df: Any,
    numeric: Sequence[str],
    embeddings: dict[str, list[str]],
    html_path: Path | None = None,
) -> dict[str, float]:
    """One Evidently report of ``current_df`` against ``reference_df``: ``{column or embedding name: score}``
    (Wasserstein for numbers, Jensen-Shannon for categories, ROC AUC per ``embeddings`` group), its HTML
    saved at ``html_path`` when given."""
    from evidently import DataDefinition, Dataset, Report
    from evidently.metrics import EmbeddingsDrift, ValueDrift

    check_evidently_version()
    definition = DataDefinition(
        id_column="key",
        numerical_columns=list(numeric),
        categorical_columns=list(CATEGORICAL_COLUMNS),
        embeddings=embeddings or None,
    )
    metrics: list[Any] = [ValueDrift(column=c, method="wasserstein") for c in numeric]
    metrics += [ValueDrift(column=c, method="jensenshannon") for c in CATEGORICAL_COLUMNS]
    metrics += [EmbeddingsDrift(embeddings_name=n, drift_method=embedding_drift_method()) for n in embeddings]
    snapshot = Report(metrics).run(
        Dataset.from_pandas(current_df, data_definition=definition),
        Dataset.from_pandas(reference_df, data_definition=definition),
    )
    if html_path is not None:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        snapshot.save_html(str(html_path))
    scores: dict[str, float] = {}
    for result in snapshot.dict()["metrics"]:
        config = result["config"]
        scores[config.get("embeddings_name") or config["column"]] = float(result["value"])
    expected = [*numeric, *CATEGORICAL_COLUMNS, *embeddings]
    if sorted(scores) != sorted(expected):
        raise RuntimeError(
            f"the Evidently report returned scores for {sorted(scores)}, expected {sorted(expected)}: the "
            f"installed Evidently does not behave like {EVIDENTLY_SERIES}.x; see check_evidently_version"
        )
    return scores


def column_scores(reference_df: Any, current_df: Any, numeric: Sequence[str]) -> dict[str, float]:
    """The score :func:`evidently_scores` reads for each column, without a report: ``ValueDrift``'s own call
    of ``get_one_column_drift``, minus its widget that costs ten times the score (a test holds both equal)."""
    from evidently.legacy.calculations.data_drift import get_one_column_drift
    from evidently.legacy.core import ColumnType
    from evidently.legacy.metric_results import DatasetColumns, DatasetUtilityColumns
    from evidently.legacy.options.data_drift import DataDriftOptions

    scores: dict[str, float] = {}
    typed = [(c, ColumnType.Numerical, "wasserstein") for c in numeric]
    typed += [(c, ColumnType.Categorical, "jensenshannon") for c in CATEGORICAL_COLUMNS]
    for column, column_type, method in typed:
        numerical = column_type == ColumnType.Numerical
        drift = get_one_column_drift(
            current_data=current_df,
            reference_data=reference_df,
            column_name=column,
            options=DataDriftOptions(all_features_stattest=method, all_features_threshold=None, nbinsx=None),
            dataset_columns=DatasetColumns(
                utility_columns=DatasetUtilityColumns(),
                num_feature_names=[column] if numerical else [],
                cat_feature_names=[] if numerical else [column],
                text_feature_names=[],
                datetime_feature_names=[],
            ),
            column_type=column_type,
            agg_data=True,
        )
        scores[column] = float(drift.drift_score)
    return scores


def severity_for(score: float, method: str) -> str:
    """Map a drift score to a severity band of :data:`SEVERITY_BANDS` (each band's upper bound exclusive)."""
    return SEVERITIES[bisect.bisect_right(SEVERITY_BANDS[method], score)]


def image_statistics(image: Any, original_size: tuple[int, int] | None = None) -> dict[str, Any]:
    """Size (as stored), brightness, contrast, saturation, edge density and dominant hue of an image."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    grey = rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    maxc, minc = rgb.max(axis=2), rgb.min(axis=2)
    saturation = np.where(maxc > 0, (maxc - minc) / np.maximum(maxc, 1e-6), 0.0)
    gy, gx = np.abs(np.diff(grey, axis=0)), np.abs(np.diff(grey, axis=1))
    mean_rgb = rgb.reshape(-1, 3).mean(axis=0)
    hue, sat, _ = colorsys.rgb_to_hsv(*mean_rgb.tolist())
    hue_name = "grey" if sat < 0.15 else HUE_NAMES[int(((hue * 360 + 22.5) % 360) // 45)]
    width, height = original_size or (rgb.shape[1], rgb.shape[0])
    return {
        "image_width": int(width),
        "image_height": int(height),
        "image_brightness": float(grey.mean()),
        "image_contrast": float(grey.std()),
        "image_saturation": float(saturation.mean()),
        "image_edge_density": float((gx > 0.1).mean() + (gy > 0.1).mean()) / 2.0,
        "image_dominant_hue": hue_name,
    }


def _words(caption: str) -> list[str]:
    return [w.strip(".,;:!?\"'()").lower() for w in caption.split() if w.strip(".,;:!?\"'()")]


def _captions(sample: Any) -> list[str]:
    """Every caption of a sample (a picture may carry several), its first one when it lists none."""
    return list(getattr(sample, "captions", None) or [sample.caption])


def _unseen_words(reference: Sequence[Any], current: Sequence[Any]) -> tuple[float, list[str]]:
    """The share of the current captions' words that no reference caption uses, and those words."""
    vocabulary = {w for s in reference for c in _captions(s) for w in _words(c)}
    words = [w for s in current for c in _captions(s) for w in _words(c)]
    unseen = [w for w in words if w not in vocabulary]
    return (len(unseen) / len(words) if words else 0.0), unseen


def sample_phase(
    shard_spec: str | Sequence[str], size: int, seed: int, image_size: int | None = STATISTICS_IMAGE_SIZE
) -> list[Any]:
    """A uniform reservoir sample of ``size`` samples from the shards (deterministic for a seed), images
    decoded to ``image_size`` on the short side when larger (the reservoir holds no full-size picture)."""
    from compat.data.loader import ShardStream

    rng = random.Random(seed)
    reservoir: list[Any] = []
    stream = ShardStream(shard_spec, shuffle_shards=False, seed=seed, epochs=1, image_size=image_size)
    for seen, sample in enumerate(stream):
        if seen < size:
            reservoir.append(sample)
        else:
            slot = rng.randint(0, seen)
            if slot < size:
                reservoir[slot] = sample
    if not reservoir:
        raise ValueError(f"no samples in {shard_spec!r}: the drift step needs at least one sample per side")
    return reservoir


def _frame(samples: Iterable[Any]) -> Any:
    import pandas as pd

    return pd.DataFrame(
        {"key": s.key, "caption_chars": len(s.caption), "caption_words": len(_words(s.caption))}
        | image_statistics(s.image, getattr(s, "original_size", None))
        for s in samples
    )


def _with_embeddings(frame: Any, samples: Sequence[Any], bundle: Any) -> Any:
    """``frame`` with both towers' embeddings of ``samples`` as columns ``emb_<tower>_<i>``."""
    import pandas as pd

    images = bundle.encode_images([s.image for s in samples]).cpu().numpy()
    texts = bundle.encode_texts([s.caption for s in samples]).cpu().numpy()
    towers = [pd.DataFrame(m).add_prefix(f"emb_{t}_") for t, m in (("image", images), ("text", texts))]
    return pd.concat([frame, *towers], axis=1)


def calibrated_verdict(method: str, score: float, noise_floor: float | None) -> dict[str, Any]:
    """Threshold, drift flag and severity of ``score`` once its noise floor is taken off (see the module doc);
    without a floor (a reference too small to split) the raw score is banded."""
    null = NO_DRIFT_SCORE[method]
    calibrated = score if noise_floor is None else null + max(0.0, score - max(noise_floor, null))
    threshold = SEVERITY_BANDS[method][0]
    return {
        "noise_floor": noise_floor,
        "calibrated_score": calibrated,
        "threshold": threshold,
        "drift": calibrated > threshold if method == "model" else calibrated >= threshold,
        "severity": severity_for(calibrated, method),
    }


def noise_floors(
    reference: Sequence[Any],
    ref_df: Any,
    numeric: Sequence[str],
    embeddings: dict[str, list[str]],
) -> dict[str, float]:
    """The largest score of each signal between :data:`NOISE_SPLITS` random halves of the reference: what
    sampling gives."""
    n = len(reference)
    if n < 4:
        return {}
    method = embedding_drift_method() if embeddings else None
    rng = np.random.default_rng(0)
    scores: dict[str, list[float]] = {}
    for _ in range(NOISE_SPLITS):
        order = rng.permutation(n)
        a, b = order[: n // 2], order[n // 2 :]
        half_a, half_b = ref_df.iloc[a].reset_index(drop=True), ref_df.iloc[b].reset_index(drop=True)
        found = {"caption_vocabulary": _unseen_words([reference[i] for i in a], [reference[i] for i in b])[0]}
        found.update(column_scores(half_a, half_b, numeric))
        for name, columns in embeddings.items():
            found[name] = method(half_b[columns].copy(), half_a[columns].copy())[0]
        for name, score in found.items():
            scores.setdefault(name, []).append(float(score))
    return {name: max(values) for name, values in scores.items()}


def compute_drift(
    reference: Sequence[Any],
    current: Sequence[Any],
    production_model: Any | None = None,
    html_path: Path | None = None,
) -> dict[str, Any]:
    """Per-column verdicts and an overall severity of ``current`` against ``reference``; with a
    ``production_model`` (a :class:`compat.models.ClipBundle`) both towers' embeddings too. BLAS/OpenMP run
    one thread (as benchmarks/results/drift.md measures on a shared CPU)."""
    ref_df, cur_df = _frame(reference), _frame(current)
    sides = (("reference", reference), ("current", current))
    embeddings: dict[str, list[str]] = {}
    if production_model is not None:
        ref_df = _with_embeddings(ref_df, reference, production_model)
        cur_df = _with_embeddings(cur_df, current, production_model)
        for tower in ("image", "text"):
            embeddings[f"{tower}_embedding"] = [c for c in ref_df.columns if c.startswith(f"emb_{tower}_")]

    numeric = [c for c in NUMERIC_COLUMNS if ref_df[c].nunique() > 1 or cur_df[c].nunique() > 1]
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        scores = evidently_scores(ref_df, cur_df, numeric, embeddings, html_path)
        floors = noise_floors(reference, ref_df, numeric, embeddings)
    rate, unseen = _unseen_words(reference, current)  # a rate, not a distribution test; banded like the rest
    examples = sorted(set(unseen))[:20]
    vocabulary = {"kind": "caption", "method": "oov_rate", "score": rate, "examples": examples}
    verdicts: dict[str, Any] = {"caption_vocabulary": vocabulary}
    for name, score in scores.items():
        if name in embeddings:
            verdicts[name] = {"kind": "embedding", "method": "model", "score": score}
        elif name in CATEGORICAL_COLUMNS:
            verdicts[name] = {"kind": CATEGORICAL_COLUMNS[name], "method": "jensenshannon", "score": score}
        else:
            verdicts[name] = {"kind": NUMERIC_COLUMNS[name], "method": "wasserstein", "score": score}
    for name, verdict in verdicts.items():
        verdict.update(calibrated_verdict(verdict["method"], verdict["score"], floors.get(name)))
    worst = max((v["severity"] for v in verdicts.values()), key=SEVERITIES.index, default="none")
    return {
        "severity": worst,
        "drifted": sorted(name for name, v in verdicts.items() if v["drift"]),
        "verdicts": verdicts,
        "embeddings_measured": bool(embeddings),
        "sizes": {"reference": len(reference), "current": len(current)},
        "captions": {side: sum(len(_captions(s)) for s in samples) for side, samples in sides},
    }


def run_drift(
    reference: str | Sequence[str],
    current: str | Sequence[str],
    out_dir: Path,
    *,
    production_checkpoint: Path | None = None,
    sample_size: int = 500,
    seed: int = 0,
) -> dict[str, Any]:
    """The drift step: sample both phases, compare, write ``drift.json`` and ``drift_report.html``."""
    out_dir = Path(out_dir)
    logger.info("sampling up to %d reference and current samples", sample_size)
    bundle, image_size = None, STATISTICS_IMAGE_SIZE
    if production_checkpoint is not None:
        from compat.compat_training import decode_size
        from compat.production import load_encoder

        logger.info("embedding both sides with the production model %s", production_checkpoint)
        bundle = load_encoder(production_checkpoint)  # its serving encoder, whatever method produced it
        model_size = decode_size(bundle)
        image_size = None if model_size is None else max(model_size, image_size)
    reference_samples = sample_phase(reference, sample_size, seed, image_size=image_size)
    current_samples = sample_phase(current, sample_size, seed + 1, image_size=image_size)
    summary = compute_drift(reference_samples, current_samples, bundle, out_dir / DRIFT_REPORT_FILE)
    summary.update(
        schema_version=1,
        reference={"shards": _describe(reference), "samples": len(reference_samples)},
        current={"shards": _describe(current), "samples": len(current_samples)},
        production_model=str(production_checkpoint) if production_checkpoint else None,
        html_report=DRIFT_REPORT_FILE,
        severity_bands={k: list(v) for k, v in SEVERITY_BANDS.items()},
        noise_splits=NOISE_SPLITS,
    )
    schemas.validate(summary, "drift_summary", source=str(out_dir / DRIFT_FILE))
    write_json_atomic(out_dir / DRIFT_FILE, summary)
    logger.info(
        "drift severity %s; drifted: %s", summary["severity"], ", ".join(summary["drifted"]) or "none"
    )
    return summary


def _describe(spec: str | Sequence[str]) -> list[str]:
    return [spec] if isinstance(spec, str) else [str(s) for s in spec]
