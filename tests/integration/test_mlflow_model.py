"""Each registered version is a real MLflow model: a pyfunc flavour around the serving encoder, loaded by
``mlflow.pyfunc.load_model("models:/<name>@production")``, with the embeddings compatflow's loader gives."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

TEXTS = ["a red circle on a striped background", "a small blue square", "a green star at the top"]


def png(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A workspace whose production is a plain checkpoint and whose candidate a compatible model (``none``),
    both registered by the pipeline's register step."""
    from compat.io import utc_now
    from compat.methods.config import MethodConfig
    from compat.methods.none import independent_model
    from compat.models import build_model, save_checkpoint
    from components.gate import GateDecision
    from components.steps.base import registry_of
    from components.steps.release import register_step
    from pipelines.config import load_config, resolve

    tmp = tmp_path_factory.mktemp("mlflow-model")
    raw = load_config("local").with_changes(workspace=str(tmp / "ws"))  # before resolve: the tracking URI
    config = resolve(raw)  # is the workspace's
    assert str(tmp) in config.registry.tracking_uri
    first = tmp / "v1"
    save_checkpoint(build_model("cf-tiny", seed=0), first, version="v1")
    run1 = tmp / "ws" / "runs" / "run-1"
    run1.mkdir(parents=True)
    v1 = register_step(config, run1, 0, str(first), bootstrap=True)["version"]
    registry = registry_of(config)
    registry.promote(v1, rollout=None)

    compat = tmp / "v2"
    wrapped = independent_model(
        build_model("cf-tiny", seed=1), 64, MethodConfig(version="v2", old_space_id="v1")
    )
    wrapped.save(compat)
    run2 = tmp / "ws" / "runs" / "run-2"
    GateDecision(decision="pass", reasons=[], checks=[], report_sha256="a" * 64, decided_at=utc_now()).write(
        run2 / "gate"
    )
    config = config.with_changes(compat={"method": "none", "options": {}})
    v2 = register_step(config, run2, 1, str(compat))["version"]
    return {"config": config, "registry": registry, "versions": (v1, v2)}


def compatflow_embeddings(config: dict, version: str) -> tuple[np.ndarray, np.ndarray]:
    """Texts and images embedded through compatflow's own production loader (its verified workspace copy)."""
    from compat.compat_training import decode_size
    from compat.data.images import decode_rgb
    from compat.production import load_production
    from components.steps.release import model_dir_of

    encoder = load_production(model_dir_of(config, version)).encoder
    pictures = [decode_rgb(png(i), size=decode_size(encoder)) for i in range(2)]
    return encoder.encode_texts(TEXTS).numpy(), encoder.encode_images(pictures).numpy()


def test_production_loads_as_an_mlflow_pyfunc_with_compatflows_embeddings(
    released: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc
    from mlflow.models import get_model_info

    registry, config = released["registry"], released["config"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    uri = f"models:/{registry.model_name}@production"
    model = mlflow.pyfunc.load_model(uri)
    texts = model.predict(pd.DataFrame({"text": TEXTS}))
    images = model.predict(pd.DataFrame({"image": [png(0), png(1)]}))
    want_texts, want_images = compatflow_embeddings(config, released["versions"][0])
    assert texts.dtype == np.float32 and texts.shape == want_texts.shape == (3, 64)
    # The same inputs in the same batches through the same weights: bit for bit.
    np.testing.assert_array_equal(texts, want_texts)
    np.testing.assert_array_equal(images, want_images)
    mixed = model.predict(pd.DataFrame({"text": [TEXTS[0], None], "image": [None, png(1)]}))
    # A mixed frame embeds each row in a batch of one, and BLAS kernels sum in an order that depends on the
    # batch shape: rows of these unit vectors move by a few float32 ulps (6e-8 seen, eps is 1.2e-7). 1e-5
    # is ~100 ulps and far below what a wrong weight or preprocessing would change (1e-2 and up).
    np.testing.assert_allclose(mixed, np.stack([want_texts[0], want_images[1]]), rtol=0, atol=1e-5)

    info = get_model_info(uri)
    assert [c.name for c in info.signature.inputs.inputs] == ["text", "image"]
    assert info.signature.outputs.inputs[0].shape == (-1, 64)
    assert info.flavors["python_function"]["loader_module"] == "components.adapters.registry.pyfunc"
    facts = info.metadata["compatflow"]
    assert facts["method"] == "checkpoint" and facts["contract"] is None and facts["embed_dim"] == 64
    assert (
        facts["checkpoint_sha256"]
        == registry.version_info(released["versions"][0])["tags"]["checkpoint.sha256"]
    )
    assert info.saved_input_example_info["artifact_path"] == "input_example.json"


def test_a_version_registered_under_the_earlier_loader_name_still_loads(
    released: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MLmodel files registered before the adapters had their own folder name ``components.registry.pyfunc``
    as their loader: MLflow imports that name, so it must keep loading the same model."""
    import mlflow.artifacts
    import mlflow.pyfunc

    registry, config = released["registry"], released["config"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    uri = f"models:/{registry.model_name}@production"
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path)))
    mlmodel = local / "MLmodel"
    current = "loader_module: components.adapters.registry.pyfunc"
    assert current in mlmodel.read_text()
    mlmodel.write_text(mlmodel.read_text().replace(current, "loader_module: components.registry.pyfunc"))
    texts = mlflow.pyfunc.load_model(str(local)).predict(pd.DataFrame({"text": TEXTS}))
    np.testing.assert_array_equal(texts, compatflow_embeddings(config, released["versions"][0])[0])


def test_a_compatible_model_carries_its_contract_and_serves_its_own_space(
    released: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc
    from mlflow.models import get_model_info

    registry, config = released["registry"], released["config"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    uri = f"models:/{registry.model_name}@candidate"
    facts = get_model_info(uri).metadata["compatflow"]
    assert facts["method"] == "none" and facts["contract"]["space_id"] == "v2"
    assert facts["contract"]["old_space_id"] == "v1" and facts["space_id"] == "v2"
    want_texts, _ = compatflow_embeddings(config, released["versions"][1])
    model = mlflow.pyfunc.load_model(uri)
    np.testing.assert_array_equal(model.predict({"text": TEXTS}), want_texts)
    with pytest.raises(Exception, match="no 'text' or 'image' column"):
        model.predict(pd.DataFrame({"caption": TEXTS}))


def test_tampered_weights_are_refused_by_the_pyfunc_loader(
    released: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc

    from compat.models.integrity import CheckpointIntegrityError

    registry = released["registry"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    source = registry.local_artifacts(registry.version_info(released["versions"][1])["source"])
    weights = next((source / "data" / "checkpoint").rglob("*.safetensors"))
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        with pytest.raises(CheckpointIntegrityError, match="differs from its manifest"):
            mlflow.pyfunc.load_model(f"models:/{registry.model_name}@candidate")
    finally:
        weights.write_bytes(original)


def test_consistently_rewritten_files_are_refused_against_the_models_digest(
    released: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Other weights with their compat.json and a recomputed manifest pass a check against the manifest:
    the loader refuses them against the digest the model carries in MLmodel (the registry's)."""
    import shutil

    import mlflow.pyfunc

    from compat.methods.config import MethodConfig
    from compat.methods.none import independent_model
    from compat.models import build_model
    from compat.models.integrity import MANIFEST, CheckpointIntegrityError, file_manifest, verify_checkpoint

    registry, version = released["registry"], released["versions"][1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    digest = registry.version_info(version)["tags"]["checkpoint.sha256"]
    files = registry.local_artifacts(registry.version_info(version)["source"]) / "data" / "checkpoint"
    saved = shutil.copytree(files, tmp_path / "saved")
    other = tmp_path / "other"  # another compatible model of the same version and contract
    independent_model(build_model("cf-tiny", seed=5), 64, MethodConfig(version="v2", old_space_id="v1")).save(
        other
    )
    try:
        shutil.rmtree(files)
        shutil.copytree(other, files)
        (files / MANIFEST).write_text(json.dumps(file_manifest(files), indent=2, sort_keys=True) + "\n")
        verify_checkpoint(files)  # consistent: the manifest alone passes it
        with pytest.raises(CheckpointIntegrityError, match=f"expected sha256 {digest}") as refused:
            mlflow.pyfunc.load_model(f"models:/{registry.model_name}@candidate")
        assert MANIFEST in str(refused.value) and "MLmodel" in str(refused.value)
    finally:
        shutil.rmtree(files, ignore_errors=True)
        shutil.copytree(saved, files)


def test_files_rewritten_with_their_mlmodel_are_refused_against_the_registrys_digest(
    released: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Other weights, a recomputed manifest and the MLmodel's digest rewritten to match: everything in the
    model's folder agrees, and a ``models:/`` load still refuses it against the digest the registry recorded
    for the version."""
    import shutil

    import mlflow.pyfunc
    import yaml

    from compat.methods.config import MethodConfig
    from compat.methods.none import independent_model
    from compat.models import build_model
    from compat.models.integrity import MANIFEST, CheckpointIntegrityError, file_manifest, manifest_digest

    registry, version = released["registry"], released["versions"][1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    digest = registry.version_info(version)["tags"]["checkpoint.sha256"]
    model = registry.local_artifacts(registry.version_info(version)["source"])
    saved = shutil.copytree(model, tmp_path / "saved")
    files = model / "data" / "checkpoint"
    try:
        shutil.rmtree(files)
        independent_model(
            build_model("cf-tiny", seed=6), 64, MethodConfig(version="v2", old_space_id="v1")
        ).save(files)
        manifest = file_manifest(files)
        (files / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        mlmodel = yaml.safe_load((model / "MLmodel").read_text())
        mlmodel["metadata"]["compatflow"]["checkpoint_sha256"] = manifest_digest(manifest)
        (model / "MLmodel").write_text(yaml.safe_dump(mlmodel))
        with pytest.raises(CheckpointIntegrityError, match=f"expected sha256 {digest}") as refused:
            mlflow.pyfunc.load_model(f"models:/{registry.model_name}/{version}")
        assert f"the registry's checkpoint.sha256 of {registry.model_name} version {version}" in str(
            refused.value
        )
    finally:
        shutil.rmtree(model, ignore_errors=True)
        shutil.copytree(saved, model)


def test_a_tracking_server_serves_the_model_and_its_verified_files(
    tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc

    from compat.models import build_model, save_checkpoint
    from compat.production import load_production
    from components.adapters.registry import Registry

    save_checkpoint(build_model("cf-tiny", seed=2), tmp_path / "model", version="v1")
    registry = Registry(tmp_path / "ws", tracking_uri=mlflow_server, model_name="served-clip")
    run_id = registry.start_run("run-1")
    registry.register_candidate(run_id, tmp_path / "model", data_phase=0, method="bootstrap")
    files = registry.download("candidate", tmp_path / "copy")  # through the server's artifact store
    assert (
        files == tmp_path / "copy" and (files / "model.json").is_file() and not (files / "MLmodel").exists()
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    served = mlflow.pyfunc.load_model("models:/served-clip@candidate").predict(pd.DataFrame({"text": TEXTS}))
    np.testing.assert_array_equal(served, load_production(files).encoder.encode_texts(TEXTS).numpy())


def test_mlflow_models_predict_serves_production_from_another_folder(
    released: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mlflow models predict -m models:/<name>@production --env-manager local`` (MLflow's own CLI, run from
    a folder outside the checkout) returns one embedding per input row; the model names only installable
    distributions and carries compatflow's code."""
    import json
    import os
    import subprocess
    import sys

    import mlflow.artifacts

    registry = released["registry"]
    uri = f"models:/{registry.model_name}@production"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    env = dict(os.environ)
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "copy")))
    requirements = (local / "requirements.txt").read_text().split()
    assert not [r for r in requirements if r.startswith("compatflow") or "+" in r], requirements
    assert (local / "code" / "compat").is_dir() and (local / "code" / "components").is_dir()

    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"dataframe_split": {"columns": ["text"], "data": [[t] for t in TEXTS]}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    mlflow_cli = str(Path(sys.executable).with_name("mlflow"))
    done = subprocess.run(
        [mlflow_cli, "models", "predict", "-m", uri, "--env-manager", "local", "-i", str(rows), "-t", "json"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    embeddings = np.asarray(answer["predictions"], dtype=np.float32)
    assert embeddings.shape == (len(TEXTS), 64)
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
