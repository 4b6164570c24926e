"""Data validation of a phase of webdataset shards (img2dataset layout: key.jpg / key.txt / key.json).

``validate_phase`` checks every sample (tar safety, image decoding and size, caption, metadata
schema, key uniqueness) with Python checks and Great Expectations suites, quarantines rejected
samples unchanged with their reasons, writes accepted samples to new shards, and blocks the
phase when too many samples are rejected, a shard is damaged, or a phase expectation fails.
``validate_splits`` does it for every split of a phase (train, eval, gallery), summed up in one document.
"""

from components.data.validation.checks import REASONS, Reason
from components.data.validation.phase import ShardSpecError, ValidationSummary, resolve_shards, validate_phase
from components.data.validation.policy import ValidationPolicy, load_validation_policy
from components.data.validation.shard_reader import ShardReader, split_member_name
from components.data.validation.splits import split_accepted_paths, validate_splits

__all__ = [
    "REASONS",
    "Reason",
    "ShardReader",
    "ShardSpecError",
    "ValidationPolicy",
    "ValidationSummary",
    "load_validation_policy",
    "resolve_shards",
    "split_accepted_paths",
    "split_member_name",
    "validate_phase",
    "validate_splits",
]
