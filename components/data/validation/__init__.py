"""Data validation of a phase of webdataset shards (img2dataset layout: key.jpg / key.txt / key.json):
rejected samples quarantined unchanged with their reasons, accepted ones written to new shards, the phase
blocked when too many are rejected, a shard is damaged or a phase expectation fails."""

from components.data.validation.checks import REASONS
from components.data.validation.phase import ShardSpecError, validate_phase
from components.data.validation.policy import ValidationPolicy, load_validation_policy
from components.data.validation.shard_reader import ShardReader, split_member_name
from components.data.validation.splits import split_accepted_paths, validate_splits
