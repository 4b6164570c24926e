"""Distributed data parallel helpers (torchrun): process-group set-up and feature gathering with gradients.

Every rank computes the loss on the *global* batch: features are all-gathered with
``torch.distributed.nn.all_gather``, whose backward sums the gradients of all ranks into each rank's slice
(open_clip's ``gather_features(gather_with_grad=True)``, ``local_loss=False``). Each rank then holds
``world_size x`` its share of the global gradient, and DDP's gradient averaging turns that into exactly the
single-process gradient of the global-batch loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size`` (``local_rank`` on its node)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def local_slice(self, n: int) -> slice:
        """This rank's rows of a global batch of ``n`` (equal shares; ``n`` must divide evenly)."""
        if n % self.world_size:
            raise ValueError(f"global batch {n} does not split evenly over {self.world_size} ranks")
        share = n // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)


SINGLE = DistInfo()


def env_dist_info() -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK (a single process when they are absent)."""
    try:
        return DistInfo(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    except ValueError as exc:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {exc}") from exc


def init_distributed(backend: str | None = None, init_method: str | None = None) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA); a no-op for one process.

    ``init_method`` defaults to ``$COMPATFLOW_DIST_INIT`` or ``env://`` (torchrun's MASTER_ADDR/MASTER_PORT;
    MASTER_ADDR defaults to 127.0.0.1). A ``file://`` method rendezvouses through a shared file and opens no
    listening store socket; set GLOO_SOCKET_IFNAME=lo to keep gloo's own sockets on loopback.
    """
    import torch
    import torch.distributed as dist

    info = env_dist_info()
    if not info.distributed or dist.is_initialized():
        return info
    init_method = init_method or os.environ.get("COMPATFLOW_DIST_INIT") or "env://"
    if init_method == "env://":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                "MASTER_PORT is unset: launch with torchrun, set MASTER_ADDR/MASTER_PORT, "
                "or set COMPATFLOW_DIST_INIT=file:///shared/path"
            )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=info.rank, world_size=info.world_size
    )
    return info


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        import torch.distributed as dist

        dist.barrier()


def gather_with_grad(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """All ranks' rows of ``x`` concatenated in rank order; gradients flow back to every rank's slice."""
    if not info.distributed:
        return x
    import torch
    import torch.distributed.nn

    return torch.cat(torch.distributed.nn.all_gather(x.contiguous()), dim=0)


def gather_no_grad(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """All ranks' rows of ``x`` concatenated in rank order, without gradients (teacher features)."""
    if not info.distributed:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)
