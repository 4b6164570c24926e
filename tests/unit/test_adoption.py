"""The proof of an adoption (:func:`components.adoption.prove`) on a stand-in model: what it accepts and each
refusal, with the figures."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from components.adoption import AdoptionRefused, Source, prove

N = 20


class Model:
    """Embeds the i-th image as ``vectors[i]`` (in the order asked), as a bundle's ``encode_images`` does."""

    image_size = 16

    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors = vectors

    def encode_images(self, images):
        order = [int(image.info["index"]) for image in images]
        return SimpleNamespace(numpy=lambda: self.vectors[order])


@pytest.fixture
def sample(tmp_path, monkeypatch):
    """N rows with unit vectors and an image file each (the image knows its row)."""
    import components.adoption as adoption

    vectors = np.random.default_rng(0).standard_normal((N, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    rows = []
    for i in range(N):
        Image.new("RGB", (16, 16), (i, 0, 0)).save(tmp_path / f"{i}.png")
        rows.append({"pk": i, "emb": vectors[i].tolist()})
    real = adoption.read_image_file

    def read_image_file(uri, size):
        image = real(uri, size)
        image.info["index"] = int(uri.rsplit("/", 1)[1].split(".")[0])
        return image

    monkeypatch.setattr(adoption, "read_image_file", read_image_file)
    source = Source("team.db", "items", "pk", "emb", image_template=str(tmp_path / "{id}.png"))
    return source, rows, vectors


def test_the_model_that_made_the_vectors_is_accepted_with_its_figures(sample):
    source, rows, vectors = sample
    proof = prove(Model(vectors * 3.0), rows, source, "COSINE")  # compared after L2 normalisation
    assert proof.passed and proof.n_sample == N and proof.n_unreadable == 0
    assert proof.cosine_min == pytest.approx(1.0, abs=1e-5) and proof.cosine_median == pytest.approx(1.0)
    assert "threshold 0.99" in proof.summary() and "median 1.0000" in proof.summary()


def test_another_model_is_refused_with_the_figures(sample):
    source, rows, vectors = sample
    other = np.roll(vectors, 1, axis=0)
    proof = prove(Model(other), rows, source, "COSINE")
    assert not proof.passed and proof.cosine_median < 0.99
    assert "does not reproduce the stored vectors" in proof.reasons[0] and "--weights" in proof.reasons[0]


def test_unreadable_images_beyond_the_fraction_are_refused(sample, tmp_path):
    source, rows, vectors = sample
    (tmp_path / "3.png").unlink()
    kept = prove(Model(vectors), rows, source, "COSINE")  # 1 of 20: the 5 % allowed
    assert kept.passed and kept.n_unreadable == 1 and kept.cosine_min == pytest.approx(1.0, abs=1e-5)
    (tmp_path / "4.png").write_bytes(b"not an image")
    refused = prove(Model(vectors), rows, source, "COSINE")
    assert refused.n_unreadable == 2 and "2 of 20 sampled images cannot be read" in refused.reasons[0]
    assert prove(Model(vectors), rows, source, "COSINE", max_unreadable=0.1).passed


def test_a_metric_that_ranks_otherwise_than_cosine_is_refused(sample):
    source, rows, vectors = sample
    assert prove(Model(vectors), rows, source, "IP").passed  # unit vectors: IP ranks as cosine
    long = [{**row, "emb": (np.asarray(row["emb"]) * 2).tolist()} for row in rows]
    refused = prove(Model(vectors), long, source, "L2")
    assert not refused.passed and "searched with L2 on vectors not of unit norm" in refused.reasons[0]


def test_an_image_must_be_named():
    with pytest.raises(AdoptionRefused, match="--image-field"):
        Source("uri", "items", "pk", "emb")
    with pytest.raises(AdoptionRefused, match=r"as \{id\}"):
        Source("uri", "items", "pk", "emb", image_template="/data/image.jpg")


def test_an_items_own_image_file_is_read_by_path_or_file_uri(tmp_path):
    from compat.data.images import ImageDecodeError, read_image_file

    Image.new("RGB", (40, 20), (10, 20, 30)).save(tmp_path / "a.png")
    assert read_image_file(str(tmp_path / "a.png"), 10).size == (20, 10)
    assert read_image_file(f"file://{tmp_path / 'a.png'}").size == (40, 20)
    with pytest.raises(OSError, match="only local paths"):
        read_image_file("https://example.com/a.png")
    with pytest.raises(ImageDecodeError, match="over 10 bytes"):
        read_image_file(str(tmp_path / "a.png"), max_bytes=10)
