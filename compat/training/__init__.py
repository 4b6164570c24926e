"""Continual CLIP training: trainer (Mod-X, fine-tuning, joint), schedule, DDP helpers, resumable state."""

from compat.training.data import ReplayBatchSource, ReplayBuffer, ShardBatchSource, TensorBatchSource
from compat.training.ddp import DistInfo, env_dist_info, init_distributed, shutdown_distributed
from compat.training.schedule import CosineWarmup
from compat.training.state import ResumeError, list_checkpoints
from compat.training.trainer import (
    LEDGER_FILE,
    LOGIT_SCALE_MAX,
    TrainConfig,
    build_optimizer,
    clamp_logit_scale,
    loss_and_backward,
    train,
)
