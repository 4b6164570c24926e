"""DDP on 2 CPU processes (gloo, loopback): loss, gradients and trained weights equal one process on the
same global batch, for the CLIP loss and the Mod-X KL whose B x B matrices span both ranks; and the
continual step's own launch path (``resources.gpu.accelerator_count: 2``: torchrun, 2 ranks) training the
first model and an upgrade that ship.

Run as a script (``python tests/e2e/test_ddp.py OUT``) this file is the per-rank worker.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

GLOBAL_BATCH = 16
ACCUMS = (1, 2)


def _setup(distinfo=None):
    from compat.models import build_model

    student = build_model("cf-tiny", seed=0)
    teacher = build_model("cf-tiny", seed=1)
    g = torch.Generator().manual_seed(5)
    images = torch.randn(2 * GLOBAL_BATCH, 3, 64, 64, generator=g)
    words = ["red", "blue", "circle", "square", "left", "right", "tiny", "huge"]
    captions = [
        " ".join(words[int(i)] for i in torch.randint(0, 8, (3,), generator=g))
        for _ in range(2 * GLOBAL_BATCH)
    ]
    return student, teacher, images, student.tokenizer(captions)


def _step_outputs(dist) -> dict[str, torch.Tensor]:
    """Loss and gradients of one global batch, and weights after 2 Mod-X training steps."""
    from compat.losses import ModXLoss
    from compat.training import TensorBatchSource, TrainConfig, loss_and_backward, train

    student, teacher, images, texts = _setup()
    rows = dist.local_slice(GLOBAL_BATCH)
    out: dict[str, torch.Tensor] = {}
    for accum in ACCUMS:
        model = copy.deepcopy(student.model).train()
        if dist.distributed:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        terms = loss_and_backward(
            model,
            images[:GLOBAL_BATCH][rows],
            texts[:GLOBAL_BATCH][rows],
            ModXLoss(20.0),
            teacher=teacher.model.eval(),
            dist=dist,
            accum_steps=accum,
        )
        out[f"accum{accum}.loss"] = terms.total.reshape(1)
        out[f"accum{accum}.kl"] = terms.kl.reshape(1)
        inner = getattr(model, "module", model)
        for name, p in inner.named_parameters():
            out[f"accum{accum}.grad.{name}"] = p.grad.detach().clone()
    workdir = Path(os.environ["DDP_TEST_WORKDIR"]) / f"train-rank{dist.rank}"
    cfg = TrainConfig(steps=2, batch_size=GLOBAL_BATCH, alpha=20.0, lr=1e-3, warmup_fraction=0.5)
    train(student, TensorBatchSource(images, texts, GLOBAL_BATCH), cfg, workdir, teacher=teacher, dist=dist)
    for name, v in student.model.state_dict().items():
        out[f"trained.{name}"] = v.detach().clone()
    return out


def _worker(out_dir: str) -> None:
    from safetensors.torch import save_file

    from compat.training import init_distributed, shutdown_distributed

    dist = init_distributed(backend="gloo")
    try:
        save_file(_step_outputs(dist), os.path.join(out_dir, f"rank{dist.rank}.safetensors"))
    finally:
        shutdown_distributed()


def test_two_process_gloo_matches_single_process(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from compat.training import DistInfo

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "COMPATFLOW_DIST_INIT": f"file://{tmp_path / 'rendezvous'}",
        "GLOO_SOCKET_IFNAME": "lo",
        "DDP_TEST_WORKDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(repo),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path)],
            cwd=repo,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]

    monkeypatch.setenv("DDP_TEST_WORKDIR", str(tmp_path / "single"))
    single = _step_outputs(DistInfo())
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert single["accum1.kl"].item() > 0  # the teacher differs from the student: the KL term is live
    for r, got in enumerate(ranks):
        assert got.keys() == single.keys()
        for key, want in single.items():
            if key.startswith("trained.") and key.endswith("attn.in_proj_bias"):
                # The key bias [width:2*width] has an exactly-zero true gradient (softmax ignores a constant
                # per query), so its gradient is rounding noise that Adam scales up to lr-sized steps; the
                # query and value biases must still match.
                width = want.shape[0] // 3
                got_key = torch.cat([got[key][:width], got[key][2 * width :]])
                want_key = torch.cat([want[:width], want[2 * width :]])
                torch.testing.assert_close(got_key, want_key, rtol=1e-4, atol=1e-5, msg=f"rank {r}: {key}")
                continue
            tol = (
                {"rtol": 1e-4, "atol": 1e-6}
                if ".grad." in key or key.endswith(("loss", "kl"))
                else {"rtol": 1e-4, "atol": 1e-5}
            )
            torch.testing.assert_close(got[key], want, **tol, msg=f"rank {r}: {key}")


def test_the_continual_step_launches_its_ranks_and_the_upgrade_ships(tmp_path, stream_dir):
    """With 2 accelerators the continual step runs its body on 2 torchrun ranks (CPU here: gloo): rank 0
    writes the candidate and its metrics, which register, serve and upgrade like a one-process model."""
    import json

    from _pipelines import Cycle, assert_serves, chain_config

    config = chain_config(tmp_path, stream_dir, "bct")
    config["resources"]["gpu"].update(accelerator="nvidia.com/gpu", accelerator_count=2)
    config["training"]["device"] = "cpu"  # two CPU ranks stand in for the node's two GPUs
    cycle = Cycle(config)
    cycle.bootstrap()
    assert cycle.ship(1)["promoted"]
    assert_serves(config, "2", 32)
    for run in cycle.runs():
        metrics = json.loads((run / "continual" / "metrics.json").read_text())
        assert metrics["training"]["world_size"] == 2, metrics["training"]
        logs = sorted((run / "continual" / "ranks" / "logs").rglob("stdout.log"))
        assert len(logs) == 2  # one per rank


if __name__ == "__main__":
    _worker(sys.argv[1])
