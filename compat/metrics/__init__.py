"""Evaluation metrics: multi-caption retrieval recall and Spatial Disorder diagnostics."""

from compat.metrics.retrieval import (
    DEFAULT_KS,
    caption_owners,
    cross_model_retrieval,
    recall_at_k,
    retrieval_metrics,
)
from compat.metrics.spatial_disorder import (
    IMAV_BINS,
    RAM_BINS,
    SAM_BINS,
    angle_histogram,
    correctly_retrieved,
    imav_angles,
    rotation_angles,
    sam_change_histogram,
    spatial_disorder,
)

__all__ = [
    "DEFAULT_KS",
    "IMAV_BINS",
    "RAM_BINS",
    "SAM_BINS",
    "angle_histogram",
    "caption_owners",
    "correctly_retrieved",
    "cross_model_retrieval",
    "imav_angles",
    "recall_at_k",
    "retrieval_metrics",
    "rotation_angles",
    "sam_change_histogram",
    "spatial_disorder",
]
