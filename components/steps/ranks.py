"""A step on several processes of one node: torchrun starts this module once per rank.

:func:`launch` writes the step's arguments to a JSON file and runs ``torchrun --nproc-per-node N -m
components.steps.ranks STEP FILE`` (one node, rendezvous on 127.0.0.1, no restarts); every rank calls the
step's body (:data:`BODIES`) with the same arguments, and the body's own DDP code (:mod:`compat.training`)
splits the work: each rank trains on its share of the global batch, rank 0 writes. A rank that fails
fails the launch, which names the folder of every rank's log.

Only continual training runs this way; compatibility training has no DDP and runs on one GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from compat.io import free_loopback_port

# The rank bodies by step, as "module:function", imported on use in each rank.
BODIES = {"continual": "components.steps.training:train_candidate"}


class RankLaunchError(RuntimeError):
    """A step launched on several processes did not finish on every rank."""


def under_launcher() -> bool:
    """Whether this process is one rank of several (torchrun's ``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def launch_command(step: str, nproc: int, spec: Path, log_dir: Path, port: int) -> list[str]:
    """The torchrun command that runs ``step``'s body on ``nproc`` ranks of this node."""
    if step not in BODIES:
        raise ValueError(f"no rank body for step {step!r}; known: {sorted(BODIES)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"a launch needs at least 2 processes, got {nproc!r}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",  # this node only: the store listens on loopback
        "--max-restarts=0",  # a failed rank fails the step; the pipeline's retry and resume take over
        f"--log-dir={log_dir}",
        "--redirects=3",  # each rank's stdout and stderr into log_dir
        "-m",
        "components.steps.ranks",
        step,
        str(spec),
    ]


def launch(step: str, nproc: int, arguments: dict[str, Any], work_dir: Path) -> None:
    """Run ``step``'s body with ``arguments`` on ``nproc`` processes (torchrun, this node) and wait; the
    arguments file and every rank's log land under ``work_dir/ranks``. Raises :class:`RankLaunchError`
    naming that folder when any rank fails."""
    ranks_dir = Path(work_dir) / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    spec = ranks_dir / f"{step}.json"
    spec.write_text(json.dumps(arguments))
    log_dir = ranks_dir / "logs"
    command = launch_command(step, nproc, spec, log_dir, free_loopback_port())
    env = {"GLOO_SOCKET_IFNAME": "lo", **os.environ}  # CPU ranks (gloo) talk over loopback; NCCL unaffected
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (ranks_dir / "torchrun.log").write_text(done.stdout)
    if done.returncode != 0:
        raise RankLaunchError(
            f"step {step} failed on {nproc} processes (torchrun exit {done.returncode}): each rank's output "
            f"is under {log_dir}, torchrun's in {ranks_dir / 'torchrun.log'}; the last lines:\n"
            + done.stdout[-2000:]
        )


def main(argv: list[str]) -> None:
    """One rank: ``STEP ARGUMENTS_FILE`` -> the step's body with those arguments."""
    import importlib

    step, spec = argv
    module, _, function = BODIES[step].partition(":")
    body = getattr(importlib.import_module(module), function)
    body(**json.loads(Path(spec).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
