"""CLIP InfoNCE and Mod-X KL (Eq 3-5 of the Mod-X paper) against explicit reference computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compat.losses import ModXLoss, _corrected_row_kl, clip_loss, modx_kl, teacher_rows_kept


def _unit(*angles_deg: float) -> torch.Tensor:
    """2-d unit vectors at the given angles (degrees)."""
    rad = [math.radians(a) for a in angles_deg]
    return torch.tensor([[math.cos(r), math.sin(r)] for r in rad], dtype=torch.float64)


def _rand(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)


def _reference_modx_kl(v, l_, vo, lo) -> float:
    """The paper's procedure written out with numpy loops: Eq 3 row replacement, then Eq 4 per direction."""
    v, l_, vo, lo = (np.asarray(x, dtype=np.float64) for x in (v, l_, vo, lo))

    def softmax(row):
        e = np.exp(row - row.max())
        return e / e.sum()

    total = 0.0
    for new, old in ((v @ l_.T, vo @ lo.T), (l_ @ v.T, lo @ vo.T)):
        old = old.copy()
        for i in range(old.shape[0]):
            if int(np.argmax(old[i])) != i:  # Eq 3: the teacher misunderstands sample i
                old[i] = new[i]
        kl = 0.0
        for i in range(old.shape[0]):
            p, q = softmax(old[i]), softmax(new[i])
            kl += float(np.sum(p * np.log(p / q)))  # Eq 4, summed over rows
        total += kl
    return total / 2


def test_identical_student_and_teacher_give_zero():
    v, t = _rand(8, 16, 0), _rand(8, 16, 1)
    assert modx_kl(v, t, v.clone(), t.clone()).item() == pytest.approx(0.0, abs=1e-12)


def test_hand_computed_2x2():
    # Student: V = L = identity directions -> M_t = [[1, 0], [0, 1]] in both directions.
    v = _unit(0, 90)
    t = _unit(0, 90)
    # Teacher: texts rotated by 30 degrees -> M_{t-1} = [[cos30, cos60], [cos120, cos30]] (i2t);
    # both i2t rows have their maximum on the diagonal, so nothing is replaced.
    vo = _unit(0, 90)
    to = _unit(30, 120)
    c30, c60, c120 = math.cos(math.radians(30)), math.cos(math.radians(60)), math.cos(math.radians(120))

    def kl2(p_logits, q_logits):
        p0 = math.exp(p_logits[0]) / (math.exp(p_logits[0]) + math.exp(p_logits[1]))
        q0 = math.exp(q_logits[0]) / (math.exp(q_logits[0]) + math.exp(q_logits[1]))
        p1, q1 = 1 - p0, 1 - q0
        return p0 * math.log(p0 / q0) + p1 * math.log(p1 / q1)

    i2t = kl2([c30, c60], [1, 0]) + kl2([c120, c30], [0, 1])
    # t2i = transpose: rows [c30, c120] and [c60, c30]; both diagonal maxima again.
    t2i = kl2([c30, c120], [1, 0]) + kl2([c60, c30], [0, 1])
    expected = (i2t + t2i) / 2
    assert modx_kl(v, t, vo, to).item() == pytest.approx(expected, rel=1e-10)


def test_hand_computed_3x3_with_a_wrong_teacher_row():
    v, t = _unit(0, 120, 240), _unit(10, 130, 250)
    # Teacher texts at 5, 20, 130 degrees: image 1 (120) is nearest text 2 -> i2t row 1 wrong; text 1 (20)
    # is nearest image 0 -> t2i row 1 wrong; rows 0 and 2 of i2t stay right.
    vo, to = _unit(0, 120, 240), _unit(5, 20, 130)
    mo = (vo @ to.T).numpy()
    assert np.argmax(mo[1]) != 1 and np.argmax(mo.T[1]) != 1
    assert modx_kl(v, t, vo, to).item() == pytest.approx(_reference_modx_kl(v, t, vo, to), rel=1e-10)


@pytest.mark.parametrize("seed", range(5))
def test_matches_reference_on_random_batches(seed):
    n, d = 12, 8
    v = _rand(n, d, seed)
    t = F.normalize(v + 0.5 * _rand(n, d, seed + 100), dim=-1)  # paired: text near its image
    # A teacher close to the student (most rows right) and one far from it (many rows wrong).
    for noise, right in ((0.2, lambda k: k >= n // 2), (3.0, lambda k: k < n)):
        g = torch.Generator().manual_seed(seed + 7)
        vo = F.normalize(v + noise * torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
        to = F.normalize(t + noise * torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
        assert right(int(((vo @ to.T).argmax(1) == torch.arange(n)).sum()))
        got = modx_kl(v, t, vo, to).item()
        assert got == pytest.approx(_reference_modx_kl(v, t, vo, to), rel=1e-9, abs=1e-12)
        assert got >= 0


def test_wrong_teacher_rows_contribute_nothing():
    g = torch.Generator().manual_seed(3)
    student = torch.randn(5, 5, generator=g, dtype=torch.float64)
    teacher = torch.eye(5, dtype=torch.float64) * 2 + 0.1 * torch.randn(
        5, 5, generator=g, dtype=torch.float64
    )
    teacher[2] = torch.tensor([0.9, 0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # argmax 0 != 2: wrong row
    base = _corrected_row_kl(student, teacher)
    changed = teacher.clone()
    changed[2] = torch.tensor([0.1, 5.0, -3.0, 0.0, 2.0], dtype=torch.float64)  # still wrong, other values
    assert _corrected_row_kl(student, changed).item() == pytest.approx(base.item(), rel=1e-12)
    # ... while changing a correct row does change it.
    changed_right = teacher.clone()
    changed_right[3, 0] += 0.5
    assert _corrected_row_kl(student, changed_right).item() != pytest.approx(base.item(), rel=1e-6)
    # All rows wrong -> exactly zero.
    assert _corrected_row_kl(student, teacher.roll(1, dims=1) * 0 + torch.eye(5).roll(1, dims=1)).item() == 0


def test_nonnegative_over_many_random_batches():
    for seed in range(30):
        v, t, vo, to = (_rand(6, 4, seed * 4 + k).float() for k in range(4))
        assert modx_kl(v, t, vo, to).item() >= -1e-6


def test_gradient_flows_only_to_student():
    base = _rand(6, 8, 0)  # paired data: image and text near the same point, so the teacher is mostly right
    v = F.normalize(base + 0.2 * _rand(6, 8, 5), dim=-1).requires_grad_(True)
    t = F.normalize(base + 0.2 * _rand(6, 8, 1), dim=-1).requires_grad_(True)
    vo = F.normalize(v.detach() + 0.2 * _rand(6, 8, 2), dim=-1).requires_grad_(True)
    to = F.normalize(t.detach() + 0.2 * _rand(6, 8, 3), dim=-1).requires_grad_(True)
    assert ((vo @ to.T).argmax(1) == torch.arange(6)).sum() >= 3
    modx_kl(v, t, vo, to).backward()
    assert vo.grad is None and to.grad is None
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert t.grad is not None and t.grad.abs().sum() > 0


def test_clip_loss_hand_value_and_open_clip_agreement():
    v, t = _unit(0, 90), _unit(0, 90)  # M = I
    s = 10.0
    # Each row: CE of logits [s, 0] against class 0 = log(1 + e^-s); both directions equal.
    assert clip_loss(v, t, s).item() == pytest.approx(math.log1p(math.exp(-s)), rel=1e-10)

    from open_clip.loss import ClipLoss

    a, b = _rand(10, 16, 4).float(), _rand(10, 16, 5).float()
    scale = torch.tensor(1 / 0.07)
    assert clip_loss(a, b, scale).item() == pytest.approx(ClipLoss()(a, b, scale).item(), rel=1e-6)


def test_modx_loss_combines_terms():
    v, t, vo, to = (_rand(8, 16, k).float() for k in range(4))
    scale = torch.tensor(14.0)
    out = ModXLoss(alpha=20.0)(v, t, scale, vo, to)
    assert out.contrastive.item() == pytest.approx(clip_loss(v, t, scale).item(), rel=1e-6)
    assert out.kl.item() == pytest.approx(modx_kl(v, t, vo, to).item(), rel=1e-6)
    assert out.total.item() == pytest.approx(out.contrastive.item() + 20 * out.kl.item(), rel=1e-6)
    finetune = ModXLoss(alpha=0.0)
    assert not finetune.needs_teacher
    assert finetune(v, t, scale).total.item() == pytest.approx(out.contrastive.item(), rel=1e-6)
    with pytest.raises(ValueError, match="teacher"):
        ModXLoss(alpha=20.0)(v, t, scale)
    with pytest.raises(ValueError, match="alpha"):
        ModXLoss(alpha=-1.0)


def test_bad_inputs_are_named():
    v, t = _rand(4, 8, 0), _rand(4, 8, 1)
    with pytest.raises(ValueError, match="L2-normalised"):
        modx_kl(v * 2, t, v, t)
    with pytest.raises(ValueError, match="same batch"):
        modx_kl(v, t, v[:3], t[:3])
    with pytest.raises(ValueError, match="same shape"):
        clip_loss(v, t[:3], 1.0)


def test_ablation_without_selective_correction_distills_every_row():
    v, t = _unit(0, 120, 240), _unit(10, 130, 250)
    vo, to = _unit(0, 120, 240), _unit(5, 20, 130)  # rows 1 of both directions are wrong (see above)

    def softmax(row):
        e = np.exp(row - row.max())
        return e / e.sum()

    expected = 0.0
    for new, old in ((v @ t.T, vo @ to.T), (t @ v.T, to @ vo.T)):
        new, old = new.numpy(), old.numpy()
        expected += sum(
            float(np.sum(softmax(old[i]) * np.log(softmax(old[i]) / softmax(new[i])))) for i in range(3)
        )
    got = modx_kl(v, t, vo, to, selective_correction=False).item()
    assert got == pytest.approx(expected / 2, rel=1e-10)
    assert got > modx_kl(v, t, vo, to).item()


def test_teacher_rows_kept_counts_eq3_survivors():
    vo, to = _unit(0, 120, 240), _unit(5, 20, 130)
    # i2t: images 0 and 2 right, image 1 wrong -> 2/3; t2i: text 0 right, texts 1 and 2 wrong -> 1/3.
    assert teacher_rows_kept(vo, to).item() == pytest.approx(0.5)
    v, t, *_ = (_rand(6, 4, k) for k in range(2))
    out = ModXLoss(20.0)(v, t, 10.0, v, t)
    assert out.kept.item() == pytest.approx(teacher_rows_kept(v, t).item())
    assert ModXLoss(0.0)(v, t, 10.0).kept is None
