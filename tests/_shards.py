"""Small webdataset shards of JPEGs for the loader tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from compat.data.synth import generate_stream, phase_urls


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("loader-stream")
    generate_stream(
        out,
        phases=1,
        samples_per_phase=50,
        seed=9,
        eval_per_domain=6,
        gallery_per_domain=8,
        samples_per_shard=7,
        image_size=32,
    )
    return out


@pytest.fixture(scope="module")
def train_urls(stream: Path) -> list[str]:
    return phase_urls(stream, 0, "train")


def jpeg(colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def members(key: str, image: bytes | None = None, caption: str | None = "a red square") -> dict[str, bytes]:
    out = {"jpg": jpeg() if image is None else image}
    if caption is not None:
        out["txt"] = caption.encode()
    out["json"] = json.dumps({"key": key}).encode()
    return out
