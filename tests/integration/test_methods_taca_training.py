"""TaCA trained to a known answer: it learns the hidden rotation of the image space."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _toy_models import batches, rotated_copy

from compat.methods import get_method
from compat.models import build_model
from compat.modules.projection import TwoLayerProjector


# ------------------------------------------------------------------------------------- known answer
def test_taca_learns_the_hidden_rotation_of_the_image_space():
    """new = old embedded isometrically in 128-d + noise: held-out new images must find their old vector."""
    old = build_model("cf-tiny", seed=1)
    new = rotated_copy(old, 128, noise=0.05)
    held = torch.randn(48, 3, 64, 64)
    old_img = old.encode_images(held)
    mean = old_img.mean(dim=0)

    def centred_cos(q: torch.Tensor) -> float:
        return float(F.cosine_similarity(q - mean, old_img - mean).mean())

    def r_at_1(q: torch.Tensor) -> float:
        return float(((q @ old_img.T).argmax(dim=1) == torch.arange(len(q))).float().mean())

    untrained = TwoLayerProjector(128, 64, 512)
    with torch.no_grad():
        before = F.normalize(untrained(new.encode_images(held, normalize=False)), dim=-1)
    method = get_method("taca")
    model = method.fit(
        new,
        old,
        batches(256, 64, seed=1),
        method.make_config({"steps": 100, "lr": 1e-3, "projector_hidden": 512, "log_every": 50}),
    )
    after = model.encode_images(held)
    assert r_at_1(before) < 0.1 and abs(centred_cos(before)) < 0.1
    assert r_at_1(after) >= 0.5 and centred_cos(after) > 0.3
    history = model.training_info["history"]
    assert history[-1]["distill"] < 0.5 * history[0]["distill"]
