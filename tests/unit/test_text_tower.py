"""The numpy text tower serves the same query vectors as the full model, from the checkpoint's own weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compat.models import build_model, read_config, save_checkpoint
from compat.models.checkpoint import ChecksumError
from compat.models.text_tower import PLAIN_TEXT_METHODS, load_text_tower, unsupported

TEXTS = [
    "a red circle",
    "A BLUE  square &amp; two triangles!!",
    "naïve café 123 — “quoted”, it's the dog's",
    "word " * 40,  # over the context length: truncated, ends with end-of-text
    "",
]


def test_the_numpy_tower_matches_the_model(tmp_path: Path) -> None:
    bundle = build_model("cf-tiny", seed=3)
    save_checkpoint(bundle, tmp_path / "v1", version="v1")
    tower = load_text_tower(tmp_path / "v1")
    assert tower is not None
    assert (tower.tokenizer(TEXTS) == bundle.tokenizer(TEXTS).numpy()).all()
    expected = bundle.encode_texts(TEXTS).numpy()
    assert np.abs(tower.encode_texts(TEXTS) - expected).max() < 1e-5

    weights = tmp_path / "v1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        load_text_tower(tmp_path / "v1")


def test_a_changed_text_tower_or_an_adapter_needs_the_full_model(tmp_path: Path) -> None:
    config = read_config("cf-tiny")
    assert unsupported(config) is None
    assert unsupported({**config, "quick_gelu": True})
    assert unsupported({**config, "text_cfg": {**config["text_cfg"], "pool_type": "last"}})
    assert unsupported({**config, "text_cfg": {**config["text_cfg"], "hf_model_name": "x"}})
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "compat.json").write_text(json.dumps({"method": "lambda_orth", "parts": ["new", "B"]}))
    assert load_text_tower(tmp_path / "m") is None


def test_plain_text_methods_are_those_serving_their_new_part_as_is() -> None:
    from compat.methods import available_methods, get_method
    from compat.methods.none import PlainModel

    plain = {name for name in available_methods() if issubclass(get_method(name).model_class, PlainModel)}
    assert plain == PLAIN_TEXT_METHODS
