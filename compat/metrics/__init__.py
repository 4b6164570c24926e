"""Evaluation metrics: multi-caption retrieval recall and Spatial Disorder diagnostics."""

from compat.metrics.retrieval import caption_owners, cross_model_retrieval, recall_at_k, retrieval_metrics
from compat.metrics.spatial_disorder import (
    RAM_BINS,
    SAM_BINS,
    angle_histogram,
    correctly_retrieved,
    rotation_angles,
    sam_change_histogram,
    spatial_disorder,
)
