"""CLIP models: the config-driven factory and safetensors checkpoints."""

from compat.models.checkpoint import (
    CheckpointError,
    ChecksumError,
    load_checkpoint,
    read_sidecar,
    save_checkpoint,
)
from compat.models.factory import ClipBundle, build_model, config_path, list_configs, read_config
