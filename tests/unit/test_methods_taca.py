"""TaCA: tied adapters (Eq. 3-4) in every vision block, the projector, the losses (Eq. 5-7 / Algorithm 1) on
hand-checkable cases, the trainable set, serving, exact removal, save/load and a known-answer toy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _toy_models import batches, captions
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from compat.losses import clip_loss
from compat.methods import get_method
from compat.methods.contract import CompatError
from compat.methods.model import load_compat_model
from compat.methods.none import independent_model
from compat.methods.taca import TaCAModel, contrastive_loss, distillation_loss, taca_loss
from compat.models import build_model
from compat.modules.adapters import TiedAdapter, insert_tied_adapters
from compat.modules.projection import TwoLayerProjector
from compat.modules.serving import base_state_dict

SMALL = {"projector_hidden": 64, "bottleneck": 16, "log_every": 1}


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
    method = get_method("taca")
    return method.fit(new, old, data, method.make_config({**SMALL, "steps": 3}))


# ---------------------------------------------------------------------------------- building blocks
def test_tied_adapter_is_eq_3_with_w_up_the_transpose_of_w_down():
    adapter = TiedAdapter(6, 2, init_std=0.5)
    x = torch.randn(4, 6)
    w = adapter.weight
    assert w.shape == (2, 6) and sum(p.numel() for p in adapter.parameters()) == 6 * 2
    assert torch.allclose(adapter(x), x + F.gelu(x @ w.T) @ w)
    assert adapter.w_up.data_ptr() == adapter.w_down.data_ptr() and torch.equal(adapter.w_up, w.T)
    with pytest.raises(ValueError, match="bottleneck"):
        TiedAdapter(6, 7)
    with pytest.raises(ValueError, match="fixed point"):
        TiedAdapter(6, 2, init_std=0.0)


def test_adapters_sit_after_every_block_mlp_train_and_remove_exactly(old):
    visual = old.model.visual.eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        before = visual(images)
    handle = insert_tied_adapters(visual, 8, init_std=0.1)
    try:
        blocks = visual.transformer.resblocks
        assert len(handle.adapters) == len(blocks) == 2
        names = [n for n, _ in visual.named_parameters() if ".adapter." in n]
        assert names == ["transformer.resblocks.0.adapter.weight", "transformer.resblocks.1.adapter.weight"]
        h = torch.randn(3, 5, 64)
        with torch.no_grad():  # block.mlp(h) is now Adapter(original MLP(h))
            plain = blocks[0].mlp.c_proj(blocks[0].mlp.gelu(blocks[0].mlp.c_fc(h)))
            assert torch.allclose(blocks[0].mlp(h), handle.adapters[0](plain))
        out = visual(images)
        assert not torch.allclose(out, before)
        out.pow(2).sum().backward()
        assert all(a.weight.grad is not None and a.weight.grad.abs().sum() > 0 for a in handle.adapters)
        with pytest.raises(ValueError, match="already has adapters"):
            insert_tied_adapters(visual, 8)
    finally:
        handle.remove()
        visual.zero_grad(set_to_none=True)
    assert not any(".adapter." in n for n, _ in visual.named_parameters())
    with torch.no_grad():
        assert torch.equal(visual(images), before)
    with pytest.raises(TypeError, match="VisionTransformer"):
        insert_tied_adapters(nn.Linear(3, 3), 2)


def test_projector_is_two_layer_mlp_with_4096_hidden_by_default():
    projector = TwoLayerProjector(128, 64)
    assert [type(m) for m in projector.net] == [nn.Linear, nn.GELU, nn.Linear]
    assert (projector.net[0].in_features, projector.net[0].out_features) == (128, 4096)
    assert (projector.net[2].in_features, projector.net[2].out_features) == (4096, 64)
    assert projector(torch.randn(3, 128)).shape == (3, 64)


# ------------------------------------------------------------------------------------------- losses
def test_distillation_is_zero_for_equal_features_and_the_mean_euclidean_distance_otherwise():
    v = F.normalize(torch.randn(5, 8), dim=-1)
    assert distillation_loss(v, v.clone()).item() == 0.0
    e = torch.eye(2)
    assert distillation_loss(e, e.flip(0)).item() == pytest.approx(math.sqrt(2))  # orthogonal unit vectors
    new = v.clone().requires_grad_(True)
    old = F.normalize(torch.randn(5, 8), dim=-1).requires_grad_(True)
    distillation_loss(new, old).backward()
    assert new.grad is not None and old.grad is None  # the old side is a fixed target
    with pytest.raises(ValueError, match="same shape"):
        distillation_loss(torch.randn(2, 8), torch.randn(2, 4))


def test_contrastive_term_is_algorithm_1_and_clip_loss_on_the_cross_pairs():
    s = 14.0
    nv, ot = F.normalize(torch.randn(6, 4), dim=-1), F.normalize(torch.randn(6, 4), dim=-1)
    logits = nv @ ot.T * s  # Algorithm 1: logits = new_visual @ old_text.T / exp(tau)
    labels = torch.arange(6)
    by_hand = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    assert torch.allclose(contrastive_loss(nv, ot, s), by_hand)
    assert torch.allclose(contrastive_loss(nv, ot, s), clip_loss(nv, ot, s))
    ov = F.normalize(torch.randn(6, 4), dim=-1)
    terms = taca_loss(nv, ov, ot, s)  # lambda = 2 by default
    assert torch.allclose(terms.total, terms.contra + 2 * terms.distill)
    assert torch.allclose(
        taca_loss(nv, ov, ot, s, distill_weight=0.5).total, terms.contra + 0.5 * terms.distill
    )


# ---------------------------------------------------------------------------------------------- fit
def test_only_adapters_and_projector_train(new, old, data):
    grads = {}

    def capture(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[id(p)] = p.grad is not None and bool(p.grad.abs().sum() > 0)

    old_state = {k: v.clone() for k, v in old.model.state_dict().items()}
    hook = register_optimizer_step_pre_hook(capture)
    try:
        method = get_method("taca")
        model = method.fit(new, old, data, method.make_config({**SMALL, "steps": 2}))
    finally:
        hook.remove()
    trainable = model.adapted.trainable()
    assert [n for n, _ in trainable] == [
        f"new.visual.transformer.resblocks.{i}.adapter.weight" for i in range(4)
    ] + ["projector.net.0.weight", "projector.net.0.bias", "projector.net.2.weight", "projector.net.2.bias"]
    assert set(grads) == {id(p) for _, p in trainable} and all(grads.values())
    trained = {id(p) for _, p in trainable}
    everything = [*model.adapted.bundle.model.parameters(), *model.adapted.projector.parameters()]
    assert all(p.grad is None for p in everything if id(p) not in trained)
    new_state = new.model.state_dict()
    assert all(torch.equal(v, new_state[k]) for k, v in base_state_dict(model.adapted.bundle.model).items())
    assert all(torch.equal(v, old_state[k]) for k, v in old.model.state_dict().items())
    layers, width, bottleneck, hidden = 4, 128, 16, 64
    projector = (128 * hidden + hidden) + (hidden * 64 + 64)
    assert model.trainable_parameters == layers * width * bottleneck + projector  # L k d' + projector


def test_serving_images_through_taca_and_texts_through_the_old_encoder(fitted, old):
    contract = fitted.contract
    assert (contract.method, contract.dim, contract.old_vector_rule, contract.keeps_space) == (
        "taca",
        64,
        "as_is",
        True,
    )
    images, texts = torch.randn(3, 3, 64, 64), captions(3)
    out = fitted.encode_images(images)
    assert out.shape == (3, 64) and torch.allclose(out.norm(dim=-1), torch.ones(3))
    assert torch.equal(fitted.encode_texts(texts), old.encode_texts(texts))
    assert fitted.config.logit_scale == pytest.approx(old.model.logit_scale.exp().item())
    assert fitted.training_info["bottleneck"] == 16 and fitted.training_info["steps"] == 3


def test_default_bottleneck_is_an_eighth_of_the_width(new, old, data):
    method = get_method("taca")
    model = method.fit(new, old, data[:1], method.make_config({"projector_hidden": 32, "steps": 1}))
    assert model.adapted.bottleneck == 128 // 8


def test_removing_adapters_restores_the_original_new_model_bit_for_bit(new, old, data):
    method = get_method("taca")
    model = method.fit(new, old, data, method.make_config({**SMALL, "steps": 2}))
    images = torch.randn(4, 3, 64, 64)
    reference = new.encode_images(images)
    assert torch.equal(model.original_new_model().encode_images(images), reference)
    assert torch.equal(model.remove_adapters().encode_images(images), reference)
    with pytest.raises(CompatError, match="removed"):
        model.encode_images(images)


def test_save_load_round_trip(fitted, tmp_path):
    fitted.save(tmp_path / "taca")
    loaded = load_compat_model(tmp_path / "taca")
    assert isinstance(loaded, TaCAModel) and loaded.contract == fitted.contract
    assert loaded.trainable_parameters == fitted.trainable_parameters
    assert loaded.config.logit_scale == pytest.approx(fitted.config.logit_scale)
    images, texts = torch.randn(3, 3, 64, 64), captions(3)
    assert torch.allclose(loaded.encode_images(images), fitted.encode_images(images), atol=1e-6)
    assert torch.allclose(loaded.encode_texts(texts), fitted.encode_texts(texts), atol=1e-6)


def test_on_top_of_an_earlier_release_it_keeps_that_release_text_network(new, old, data):
    """Production after an earlier release: TaCA serves its text network; one with adapters is refused."""
    from compat.methods.lambda_orth import Adapters

    method = get_method("taca")
    production = independent_model(old, 64)  # a released plain model: its texts are its network's
    model = method.fit(new, production, data, method.make_config({**SMALL, "steps": 1}))
    texts = captions(4)
    assert torch.allclose(model.encode_texts(texts), production.encode_texts(texts), atol=1e-6)
    assert model.text_bundle() is production.text_bundle()

    lambda_orth = get_method("lambda_orth")
    config = lambda_orth.make_config({})
    adapted = lambda_orth.assemble(old, Adapters(config.variant, old.embed_dim, old.embed_dim), config, {})
    with pytest.raises(CompatError, match="lambda_orth model whose text encoder passes through adapters"):
        method.fit(new, adapted, data, method.make_config({**SMALL, "steps": 1}))
