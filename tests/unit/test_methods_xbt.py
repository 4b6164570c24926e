"""XBT and its "Base" baseline: phi, visual prompts, exact LoRA, the paper's losses on hand-checkable cases,
the stage-2 trainable set, no old-model call in stage 2, exact removal, save/load, and a known-answer toy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _toy_models import batches, captions, rotated_copy
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from compat.losses import clip_loss
from compat.methods import available_methods, get_method
from compat.methods import xbt as xbt_module
from compat.methods.contract import CompatError
from compat.methods.model import load_compat_model
from compat.methods.xbt import XBTModel, direct_loss, stage1_loss, xbt_loss
from compat.models import build_model
from compat.modules.lora import attach_lora, lora_targets
from compat.modules.projection import XBTProjection
from compat.modules.serving import base_state_dict
from compat.modules.visual_prompts import insert_visual_prompts

SMALL = {"lora_rank": 4, "lora_alpha": 4, "num_prompts": 3, "stage1_batch_size": 32, "log_every": 1}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These tiny models are dominated by per-op overhead; one intra-op thread is faster on a shared CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def old():
    return build_model("cf-tiny", seed=1)


@pytest.fixture(scope="module")
def new():
    return build_model("cf-small", seed=2)


@pytest.fixture(scope="module")
def data():
    return batches(32, 8)


@pytest.fixture(scope="module")
def fitted(new, old, data):
    method = get_method("xbt")
    return method.fit(new, old, data, method.make_config({**SMALL, "steps": 3, "stage1_steps": 5}))


def one_hot(n: int, dim: int) -> torch.Tensor:
    return torch.eye(dim)[:n]


# ------------------------------------------------------------------------------------------- phi
def test_phi_is_linear_ln_gelu_x2_linear_with_hidden_4x_old_dim():
    phi = XBTProjection(128, 64)
    assert [type(m) for m in phi.net] == [
        nn.Linear,
        nn.LayerNorm,
        nn.GELU,
        nn.Linear,
        nn.LayerNorm,
        nn.GELU,
        nn.Linear,
    ]
    linears = [m for m in phi.net if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(128, 256), (256, 256), (256, 64)]
    assert phi(torch.randn(5, 128)).shape == (5, 64)
    assert [n for n, _ in phi.layernorm_parameters()] == [
        "net.1.weight",
        "net.1.bias",
        "net.4.weight",
        "net.4.bias",
    ]
    with pytest.raises(ValueError, match="dimension 128"):
        phi(torch.randn(2, 64))


# ------------------------------------------------------------------------------------- prompts
def test_visual_prompts_enter_after_cls_get_gradients_and_remove_exactly(old):
    visual = old.model.visual
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        before = visual(images)
    seen = []
    spy = visual.transformer.resblocks[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    handle = insert_visual_prompts(visual, 3)
    try:
        assert handle.prompts.tokens.shape == (3, 64)
        out = visual(images)
        assert seen[-1] == 1 + 3 + 16  # class token + prompts + 4x4 patches
        assert out.shape == before.shape and not torch.allclose(out, before)
        out.pow(2).sum().backward()
        assert handle.prompts.tokens.grad is not None and handle.prompts.tokens.grad.abs().sum() > 0
        with pytest.raises(ValueError, match="already has visual prompts"):
            insert_visual_prompts(visual, 2)
    finally:
        handle.remove()
        spy.remove()
        visual.zero_grad(set_to_none=True)
    assert not hasattr(visual, "visual_prompts")
    with torch.no_grad():
        assert torch.equal(visual(images), before)


# ---------------------------------------------------------------------------------------- LoRA
def test_lora_targets_attention_and_mlp_of_both_open_clip_towers(old):
    targets = lora_targets(old.model)
    expected = [
        f"{tower}.resblocks.{i}.{m}"
        for tower in ("visual.transformer", "transformer")
        for i in range(2)
        for m in ("attn", "mlp.c_fc", "mlp.c_proj")
    ]
    assert targets == expected


def test_lora_trains_without_touching_base_weights_and_removes_exactly(new):
    model = build_model("cf-tiny", seed=3).model.eval()
    images, tokens = torch.randn(4, 3, 64, 64), build_model("cf-tiny").tokenizer(captions(4))
    with torch.no_grad():
        ref_img, ref_txt = model.encode_image(images), model.encode_text(tokens)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle = attach_lora(model, r=4, alpha=4, dropout=0.1)
    lora = handle.named_parameters()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in lora}
    for _, p in lora:  # lora_B starts at 0; move it so every matrix gets a gradient
        nn.init.normal_(p, std=0.05)
    optimizer = torch.optim.SGD([p for _, p in lora], lr=0.1)
    model.train()
    for _ in range(3):
        loss = model.encode_image(images).pow(2).mean() + model.encode_text(tokens).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in lora)
        optimizer.step()
    assert all(torch.equal(v, state[k]) for k, v in base_state_dict(model).items())  # bit-identical base
    handle.remove()
    model.eval()
    assert set(model.state_dict()) == set(state)
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), ref_img)
        assert torch.equal(model.encode_text(tokens), ref_txt)


def test_lora_on_the_pretrained_minilm_text_tower_gets_gradients():
    bundle = build_model("cf-foundation-minilm", seed=0)
    targets = lora_targets(bundle.model, ("text",))
    per_layer = (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    )
    assert targets == [f"text.transformer.encoder.layer.{i}.{m}" for i in range(6) for m in per_layer]
    handle = attach_lora(bundle.model, ("text",), r=2, alpha=2, dropout=0.0)
    for _, p in handle.named_parameters():
        nn.init.normal_(p, std=0.05)
    bundle.model.encode_text(bundle.tokenizer(captions(3))).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in handle.named_parameters())
    assert all(p.grad is None for n, p in bundle.model.named_parameters() if ".lora_" not in n)


# -------------------------------------------------------------------------------------- losses
def test_stage1_loss_matches_hand_computation_and_normalises_the_noisy_input():
    s = 2.0
    w = one_hot(4, 8)
    expected = math.log(1 + 3 * math.exp(-s))  # logits s*I: -log(e^s / (e^s + 3))
    assert stage1_loss(nn.Identity(), w, w, 0.0, s).item() == pytest.approx(expected, rel=1e-5)
    seen = []

    def spy(z: torch.Tensor) -> torch.Tensor:
        seen.append(z)
        return z[:, :8]

    gen = torch.Generator().manual_seed(0)
    noisy = stage1_loss(spy, w, w, 0.5, s, generator=gen)
    assert torch.allclose(seen[0].norm(dim=-1), torch.ones(4))  # norm(w_new + eps)
    assert not torch.allclose(seen[0], w) and noisy.item() > expected


def test_xbt_loss_is_clip_loss_of_the_projected_pair_and_direct_loss_adds_both_cross_terms():
    s = 2.0
    v, w = F.normalize(torch.randn(6, 4), dim=-1), F.normalize(torch.randn(6, 4), dim=-1)
    assert torch.equal(xbt_loss(v, w, s), clip_loss(v, w, s))
    e = one_hot(4, 4)
    # v_bar = w_old and w_bar = v_old: each cross term is log(1 + 3 e^-s)
    assert direct_loss(e, e, e, e, s).item() == pytest.approx(2 * math.log(1 + 3 * math.exp(-s)), rel=1e-5)
    vo, wo = F.normalize(torch.randn(6, 4), dim=-1), F.normalize(torch.randn(6, 4), dim=-1)
    assert torch.allclose(direct_loss(v, w, vo, wo, s), clip_loss(v, wo, s) + clip_loss(w, vo, s))


# ------------------------------------------------------------------------------------------ fit
def test_stage2_trains_exactly_lora_prompts_and_phi_layernorms(new, old, data):
    config = get_method("xbt").make_config({**SMALL, "steps": 2, "stage1_steps": 2})
    phi = XBTProjection(new.embed_dim, old.embed_dim)
    adapted = xbt_module.AdaptedNewModel(new, phi, config, torch.device("cpu"))
    base_before = {k: v.clone() for k, v in base_state_dict(adapted.bundle.model).items()}
    phi_before = {k: v.clone() for k, v in phi.state_dict().items()}
    grads = {}

    def capture(optimizer, args, kwargs):  # gradients right before every optimiser step
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[id(p)] = p.grad is not None and bool(p.grad.abs().sum() > 0)

    with torch.no_grad():
        for _, p in adapted.lora.named_parameters():  # lora_B = 0 blocks lora_A's gradient at step 0
            p.normal_(std=0.02)
    hook = register_optimizer_step_pre_hook(capture)
    try:
        xbt_module.train_stage2(adapted, data, config)
    finally:
        hook.remove()
    groups = adapted.trainable_groups("layernorm")
    names = [n for items in groups.values() for n, _ in items]
    lora_names = [f"new.{n}" for n, p in adapted.bundle.model.named_parameters() if ".lora_" in n]
    assert len(lora_names) == 8 * 8  # 8 blocks x (A, B) x (attn in_proj, attn out_proj, c_fc, c_proj)
    assert names == lora_names + [
        "new.visual.visual_prompts.tokens",
        "phi.net.1.weight",
        "phi.net.1.bias",
        "phi.net.4.weight",
        "phi.net.4.bias",
    ]
    trained = {id(p) for items in groups.values() for _, p in items}
    assert set(grads) == trained and all(grads.values())
    all_params = [*adapted.bundle.model.parameters(), *phi.parameters()]
    assert all(p.grad is None for p in all_params if id(p) not in trained)
    assert all(torch.equal(v, base_before[k]) for k, v in base_state_dict(adapted.bundle.model).items())
    changed = {k for k, v in phi.state_dict().items() if not torch.equal(v, phi_before[k])}
    assert changed == {"net.1.weight", "net.1.bias", "net.4.weight", "net.4.bias"}


def test_fit_never_calls_the_old_model_in_stage_2(new, old, data, monkeypatch):
    events = []
    hooks = [
        old.model.visual.register_forward_hook(lambda *a: events.append("old image")),
        old.model.transformer.register_forward_hook(lambda *a: events.append("old text")),
    ]
    original = xbt_module.train_stage2

    def marked(*args, **kwargs):
        events.append("stage 2")
        return original(*args, **kwargs)

    monkeypatch.setattr(xbt_module, "train_stage2", marked)
    try:
        method = get_method("xbt")
        method.fit(new, old, data, method.make_config({**SMALL, "steps": 2, "stage1_steps": 2}))
    finally:
        for hook in hooks:
            hook.remove()
    assert events.count("stage 2") == 1
    stage2_at = events.index("stage 2")
    assert "old text" in events[:stage2_at]  # stage 1 used the old text encoder ...
    assert (
        events[stage2_at + 1 :] == [] and "old image" not in events
    )  # ... and nothing of the old model after


def test_fitted_model_serves_the_old_space_and_records_training(fitted, old):
    contract = fitted.contract
    assert (contract.method, contract.dim, contract.old_vector_rule, contract.keeps_space) == (
        "xbt",
        64,
        "as_is",
        True,
    )
    images = torch.randn(3, 3, 64, 64)
    out = fitted.encode_images(images)
    assert out.shape == (3, 64) and torch.allclose(out.norm(dim=-1), torch.ones(3))
    assert fitted.encode_texts(captions(2)).shape == (2, 64)
    r, width, mlp = 4, 128, 512  # cf-small: 4 + 4 blocks of width 128; A [r, in] + B [out, r] per matrix
    per_block = r * (width + 3 * width) + r * (width + width) + 2 * r * (width + mlp)
    lora = 8 * per_block
    phi = sum(p.numel() for p in XBTProjection(128, 64).parameters())
    assert fitted.trainable_parameters == lora + 3 * 128 + phi
    assert fitted.training_info["steps"] == 3 and fitted.training_info["stage1"]["steps"] == 5
    assert fitted.logit_scale == pytest.approx(1 / 0.07, rel=1e-4)


def test_removing_adapters_restores_the_original_new_model_bit_for_bit(new, old, data):
    method = get_method("xbt")
    model = method.fit(new, old, data, method.make_config({**SMALL, "steps": 2, "stage1_steps": 2}))
    images, texts = torch.randn(4, 3, 64, 64), captions(4)
    ref_img, ref_txt = new.encode_images(images), new.encode_texts(texts)
    copy_ = model.original_new_model()
    assert torch.equal(copy_.encode_images(images), ref_img) and torch.equal(
        copy_.encode_texts(texts), ref_txt
    )
    restored = model.remove_adapters()
    assert torch.equal(restored.encode_images(images), ref_img)
    assert torch.equal(restored.encode_texts(texts), ref_txt)
    with pytest.raises(CompatError, match="removed"):
        model.encode_images(images)


def test_save_load_round_trip(fitted, tmp_path):
    fitted.save(tmp_path / "xbt")
    loaded = load_compat_model(tmp_path / "xbt")
    assert isinstance(loaded, XBTModel) and loaded.contract == fitted.contract
    assert loaded.trainable_parameters == fitted.trainable_parameters
    images, texts = torch.randn(3, 3, 64, 64), captions(3)
    assert torch.allclose(loaded.encode_images(images), fitted.encode_images(images), atol=1e-6)
    assert torch.allclose(loaded.encode_texts(texts), fitted.encode_texts(texts), atol=1e-6)


def test_stage1_corpus_file_and_bad_corpus(new, old, data, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a red circle\n\na red circle\nblue square top left\n")
    config = get_method("xbt").make_config({"text_corpus": str(corpus)})
    assert xbt_module.stage1_texts(data, config) == ["a red circle", "blue square top left"]
    missing = get_method("xbt").make_config({"text_corpus": str(tmp_path / "nope.txt")})
    with pytest.raises(CompatError, match="does not exist"):
        xbt_module.stage1_texts(data, missing)
    with pytest.raises(CompatError, match="unknown setting"):
        get_method("xbt").make_config({"noise": 0.1})


# ------------------------------------------------------------------------------- known answer
def r_at_1(queries: torch.Tensor, gallery: torch.Tensor) -> float:
    return float(((queries @ gallery.T).argmax(dim=1) == torch.arange(len(queries))).float().mean())


def test_text_only_phi_learns_the_hidden_rotation_and_carries_it_to_images(old):
    """new = old isometrically embedded in 128-d + noise: phi, trained on texts only, learns the inverse."""
    new = rotated_copy(old, 128, noise=0.05)
    train = batches(256, 64, seed=1)
    held_texts, held_images = captions(320, seed=9)[-48:], torch.randn(48, 3, 64, 64)
    old_txt, old_img = old.encode_texts(held_texts), old.encode_images(held_images)
    method = get_method("xbt")
    untrained = XBTProjection(128, 64)
    with torch.no_grad():
        before_txt = F.normalize(untrained(new.encode_texts(held_texts)), dim=-1)
        before_img = F.normalize(untrained(new.encode_images(held_images)), dim=-1)
    config = method.make_config(
        {
            "lora_rank": 4,
            "num_prompts": 3,
            "steps": 2,
            "stage1_steps": 250,
            "stage1_batch_size": 128,
            "stage1_lr": 1e-3,
        }
    )
    model = method.fit(new, old, train, config)
    after_txt, after_img = model.encode_texts(held_texts), model.encode_images(held_images)
    assert r_at_1(before_txt, old_txt) < 0.15
    assert r_at_1(after_txt, old_txt) >= 0.9  # held-out texts find their own old embedding
    cos_before = F.cosine_similarity(before_img, old_img).mean()
    cos_after = F.cosine_similarity(after_img, old_img).mean()
    assert cos_before < 0.2 and cos_after > cos_before + 0.3  # images were never seen by phi


# ------------------------------------------------------------------------------------------ Base
def test_xbt_base_trains_a_random_phi_fully_against_the_old_model(new, old, data, tmp_path):
    assert {"xbt", "xbt_base"} <= set(available_methods())
    method = get_method("xbt_base")
    calls = []
    hook = old.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        model = method.fit(new, old, data, method.make_config({"lora_rank": 4, "num_prompts": 3, "steps": 2}))
    finally:
        hook.remove()
    assert len(calls) == 2  # L_Direct needs the old image features of every batch
    assert model.contract.method == "xbt_base" and model.contract.dim == 64
    untrained = XBTProjection(128, 64)
    assert model.trainable_parameters == sum(p.numel() for p in untrained.parameters()) + (
        sum(p.numel() for _, p in model.adapted.lora.named_parameters()) + 3 * 128
    )
    assert model.training_info["trainable_parameters"]["phi"] == sum(
        p.numel() for p in untrained.parameters()
    )
    model.save(tmp_path / "base")
    assert type(load_compat_model(tmp_path / "base")).__name__ == "XBTBaseModel"


def test_paper_augmentation_draws_per_image_and_keeps_the_normalised_range(new, old, data):
    from compat.modules.augment import augment_for

    augment = augment_for(new.model.visual, 64)
    torch.manual_seed(0)
    image = torch.randn(1, 3, 64, 64).clamp(-1.5, 1.5)
    out = augment(image.repeat(4, 1, 1, 1))
    assert out.shape == (4, 3, 64, 64)
    assert not torch.allclose(out[0], out[1])  # each image gets its own draw
    mean, std = augment.mean, augment.std
    assert (out * std + mean).min() >= -1e-5 and (out * std + mean).max() <= 1 + 1e-5  # valid pixels
    method = get_method("xbt")
    model = method.fit(
        new, old, data[:1], method.make_config({**SMALL, "steps": 1, "stage1_steps": 1, "augment": True})
    )
    assert model.training_info["steps"] == 1
