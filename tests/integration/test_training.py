"""Trainer: schedule, optimizer, logit-scale clamp, exact gradient accumulation, checkpoints and resume."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from compat.losses import ModXLoss
from compat.models import build_model
from compat.training import (
    LEDGER_FILE,
    LOGIT_SCALE_MAX,
    CosineWarmup,
    ResumeError,
    TensorBatchSource,
    TrainConfig,
    build_optimizer,
    clamp_logit_scale,
    list_checkpoints,
    loss_and_backward,
    train,
)

WORDS = ["red", "blue", "green", "circle", "square", "star", "small", "large", "left", "right", "top", "dot"]


@pytest.fixture(scope="module")
def base():
    return build_model("cf-tiny", seed=0)


def _fresh(base):
    b = copy.copy(base)
    b.model = copy.deepcopy(base.model)
    return b


def _data(base, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, base.image_size, base.image_size, generator=g)
    captions = [
        " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (4,), generator=g)) for _ in range(n)
    ]
    return images, base.tokenizer(captions), [f"k{i:03d}" for i in range(n)]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_schedule_warmup_then_cosine():
    s = CosineWarmup.from_fraction(1.0, total_steps=10, warmup_fraction=0.2)
    assert s.warmup_steps == 2
    assert [s.lr_at(0), s.lr_at(1), s.lr_at(2)] == pytest.approx([0.5, 1.0, 1.0])
    assert s.lr_at(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert s.lr_at(9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(s.lr_at(i) >= s.lr_at(i + 1) for i in range(2, 9))
    with pytest.raises(ValueError):
        CosineWarmup.from_fraction(1.0, 10, 1.5)


def test_optimizer_follows_table_4(base):
    cfg = TrainConfig(steps=1)
    opt = build_optimizer(base.model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    by_id = {id(p): g for g in opt.param_groups for p in g["params"]}
    named = dict(base.model.named_parameters())
    assert by_id[id(named["logit_scale"])]["weight_decay"] == 0.0
    assert by_id[id(named["visual.conv1.weight"])]["weight_decay"] == 0.2
    assert all(by_id[id(p)]["weight_decay"] == 0.0 for n, p in named.items() if n.endswith(".bias"))
    assert opt.defaults["betas"] == (0.9, 0.99) and opt.defaults["eps"] == 1e-8
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)


def test_logit_scale_clamped_after_each_step(base, tmp_path):
    student = _fresh(base)
    clamp_logit_scale(student.model)
    with torch.no_grad():
        student.model.logit_scale.fill_(6.0)  # e^6 ~ 403 > 100
    clamp_logit_scale(student.model)
    assert student.model.logit_scale.item() == pytest.approx(LOGIT_SCALE_MAX)
    with torch.no_grad():
        student.model.logit_scale.fill_(-1.0)
    clamp_logit_scale(student.model)
    assert student.model.logit_scale.item() == 0.0
    # Inside training, a large learning rate pushes the scale up; it never passes 100.
    with torch.no_grad():
        student.model.logit_scale.fill_(LOGIT_SCALE_MAX - 1e-3)
    images, texts, keys = _data(base)
    result = train(
        student,
        TensorBatchSource(images, texts, 16, keys),
        TrainConfig(steps=3, batch_size=16, alpha=0, lr=0.5, warmup_fraction=0),
        tmp_path,
    )
    assert all(h["logit_scale"] <= 100.0 + 1e-4 for h in result.state.history)
    assert student.model.logit_scale.item() <= LOGIT_SCALE_MAX + 1e-6


@pytest.mark.parametrize("alpha", [0.0, 20.0])
def test_gradient_accumulation_equals_full_batch(base, alpha):
    images, texts, _ = _data(base, n=16, seed=1)
    teacher = build_model("cf-tiny", seed=1).model.eval().requires_grad_(False)
    loss_fn = ModXLoss(alpha)
    results = {}
    for accum in (1, 4):
        model = copy.deepcopy(base.model).train()
        terms = loss_and_backward(model, images, texts, loss_fn, teacher=teacher, accum_steps=accum)
        results[accum] = (terms, _grads(model))
    (t1, g1), (t4, g4) = results[1], results[4]
    assert t4.total.item() == pytest.approx(t1.total.item(), rel=1e-5)
    assert g1.keys() == g4.keys() and "logit_scale" in g1
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_modx_training_moves_student_only(base, tmp_path):
    student, teacher = _fresh(base), _fresh(base)
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    images, texts, keys = _data(base)
    result = train(
        student,
        TensorBatchSource(images, texts, 16, keys),
        TrainConfig(steps=4, batch_size=16, alpha=20.0, lr=1e-3),
        tmp_path,
        teacher=teacher,
    )
    assert all(torch.equal(v, teacher.model.state_dict()[k]) for k, v in before.items())
    assert not any(p.requires_grad for p in teacher.model.parameters()) and not teacher.model.training
    assert any(not torch.equal(v, student.model.state_dict()[k]) for k, v in before.items())
    first = result.state.history[0]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: student == teacher
    assert result.state.history[-1]["kl"] > 0
    assert result.state.samples_seen == 64
    with pytest.raises(ValueError, match="teacher"):
        train(
            _fresh(base),
            TensorBatchSource(images, texts, 16),
            TrainConfig(steps=1, batch_size=16, alpha=20),
            tmp_path / "x",
        )


def test_resume_from_checkpoint_matches_uninterrupted(base, tmp_path):
    images, texts, keys = _data(base, n=40)
    cfg = TrainConfig(steps=6, batch_size=8, alpha=20.0, lr=1e-3, checkpoint_every=2, keep_checkpoints=5)
    teacher = _fresh(base)

    full = _fresh(base)
    train(full, TensorBatchSource(images, texts, 8, keys), cfg, tmp_path / "full", teacher=teacher)
    ledger_full = (tmp_path / "full" / LEDGER_FILE).read_text()

    cut = _fresh(base)
    train(cut, TensorBatchSource(images, texts, 8, keys), cfg, tmp_path / "cut", teacher=teacher)
    ckpts = list_checkpoints(tmp_path / "cut" / "checkpoints")
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000004", "step-00000006"]
    import shutil

    for c in ckpts[1:]:  # as if killed between step 2's checkpoint and step 4's
        shutil.rmtree(c)
    (tmp_path / "cut" / "checkpoints" / ".tmp-step-00000004-999").mkdir()  # a half-written one
    resumed = _fresh(base)
    result = train(resumed, TensorBatchSource(images, texts, 8, keys), cfg, tmp_path / "cut", teacher=teacher)
    assert result.resumed_from == 2 and result.state.step == 6 and len(result.state.history) == 6
    assert not (tmp_path / "cut" / "checkpoints" / ".tmp-step-00000004-999").exists()
    assert (tmp_path / "cut" / LEDGER_FILE).read_text() == ledger_full
    for k, v in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
    files = {p.name for p in result.checkpoint.iterdir()}
    assert files == {
        "model.safetensors",
        "model.json",
        "optimizer.safetensors",
        "rng.safetensors",
        "progress.json",
    }
    state = json.loads((result.checkpoint / "progress.json").read_text())
    assert state["state"]["position"] == {"next": 48} and state["schedule"]["warmup_steps"] == 1


def test_resume_refuses_other_settings(base, tmp_path):
    images, texts, keys = _data(base, n=16)
    cfg = TrainConfig(steps=2, batch_size=8, alpha=0.0, checkpoint_every=1)
    train(_fresh(base), TensorBatchSource(images, texts, 8, keys), cfg, tmp_path)
    other = TrainConfig(steps=2, batch_size=8, alpha=0.0, lr=1e-3, checkpoint_every=1)
    refused = _fresh(base)
    before = {k: v.clone() for k, v in refused.model.state_dict().items()}
    with pytest.raises(ResumeError, match="lr"):
        train(refused, TensorBatchSource(images, texts, 8, keys), other, tmp_path)
    assert all(torch.equal(v, refused.model.state_dict()[k]) for k, v in before.items())  # left untouched
    # A fresh start (resume=False) discards the old checkpoints instead.
    result = train(_fresh(base), TensorBatchSource(images, texts, 8, keys), other, tmp_path, resume=False)
    assert result.resumed_from is None and result.state.step == 2


def test_config_validation():
    with pytest.raises(ValueError, match="accum_steps"):
        TrainConfig(steps=1, batch_size=10, accum_steps=3)
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(steps=1, precision="fp8")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_bf16_autocast_on_cpu_trains(base, tmp_path):
    student, teacher = _fresh(base), _fresh(base)
    images, texts, keys = _data(base, n=16)
    cfg = TrainConfig(steps=2, batch_size=8, alpha=20.0, precision="bf16")
    result = train(student, TensorBatchSource(images, texts, 8, keys), cfg, tmp_path, teacher=teacher)
    assert all(math.isfinite(h["loss"]) for h in result.state.history)
    with pytest.raises(ValueError, match="CUDA"):
        train(
            _fresh(base),
            TensorBatchSource(images, texts, 8, keys),
            TrainConfig(steps=1, batch_size=8, alpha=0.0, precision="fp16"),
            tmp_path / "fp16",
        )


def test_replay_source_mixes_buffer_rows_and_resumes_exactly(base, tmp_path):
    """Mod-X + buffer (paper Table 2): the last ``replay`` rows of every batch are earlier-phase pairs."""
    from compat.data.synth import generate_stream, phase_urls
    from compat.training import ReplayBatchSource, ReplayBuffer

    stream = tmp_path / "stream"
    generate_stream(
        stream,
        phases=2,
        samples_per_phase=40,
        seed=5,
        eval_per_domain=4,
        gallery_per_domain=0,
        samples_per_shard=20,
    )
    buffer = ReplayBuffer.from_phases([phase_urls(stream, 0, "train")], size=12, seed=0)
    assert len(buffer) == 12 and all(k.startswith("p00-") for k in buffer.keys)
    assert max(buffer.keys) > "p00-train-000011"  # a uniform sample of the phase, not its first rows
    assert ReplayBuffer.from_phases([phase_urls(stream, 0, "train")], size=12, seed=0).keys == buffer.keys

    def source():
        return ReplayBatchSource(
            phase_urls(stream, 1, "train"), buffer, 8, 3, base.preprocess_train, base.tokenizer, seed=1
        )

    it = source().batches(None)
    batches = [next(it) for _ in range(7)]  # past one epoch of the current phase (40 / 5 = 8 batches)
    for b in batches:
        assert b.images.shape[0] == b.texts.shape[0] == len(b.keys) == 8
        assert all(k.startswith("p01-") for k in b.keys[:5])
        assert all(k.startswith("p00-") for k in b.keys[5:]) and len(set(b.keys[5:])) == 3
    resumed = source().batches(batches[3].position)
    for b in batches[4:]:
        r = next(resumed)
        assert r.keys == b.keys
        assert torch.equal(r.texts, b.texts)
    with pytest.raises(ValueError, match="replay"):
        ReplayBatchSource(phase_urls(stream, 1, "train"), buffer, 8, 7, base.preprocess_train, base.tokenizer)
