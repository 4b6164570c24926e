"""The MLflow model of a registered version: a ``python_function`` flavour around the serving encoder.

A version's source is an MLflow model directory (``MLmodel``, environment files, input examples) whose
``data/checkpoint/`` is the model directory as compatflow writes it, with its ``MANIFEST.sha256.json``.
``mlflow.pyfunc.load_model("models:/<name>@production")`` loads it through :func:`_load_pyfunc`: the files are
checked against the manifest and the manifest against the registry's digest (:func:`expected_digest`), then
loaded by :func:`compat.production.load_production`, so its embeddings are compatflow's own. ``predict``
embeds a row's ``image`` (encoded bytes) when it has one, else its ``text``: one float32 vector per row.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from compat.models.integrity import CheckpointIntegrityError, verify_checkpoint

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"  # the model files inside the MLflow model: data/checkpoint
FILES = f"data/{CHECKPOINT_DIR}"
MLMODEL = "MLmodel"


class EmbeddingModel:
    """What ``mlflow.pyfunc.load_model`` wraps: texts and images in, serving-space embeddings out."""

    def __init__(self, path: str | Path) -> None:
        from compat.compat_training import decode_size
        from compat.production import load_production

        self.production = load_production(path)
        self.decode_size = decode_size(self.production.encoder)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """One embedding per row (float32 [n, dim]); see the module docstring for the input."""
        import numpy as np

        frame = _as_frame(model_input)
        if "text" not in frame and "image" not in frame:
            raise ValueError(
                f"the input has no 'text' or 'image' column (columns: {list(frame.columns)}): give texts as "
                "{'text': [...]} and images as {'image': [encoded bytes, ...]}"
            )
        columns = frame.reindex(columns=["text", "image"])  # a missing column reads as all NaN
        texts, images = list(columns["text"]), list(columns["image"])
        image_rows = [i for i, v in enumerate(images) if _present(v)]
        text_rows = sorted(set(range(len(images))) - set(image_rows))
        missing = [i for i in text_rows if not isinstance(texts[i], str)]
        if missing:
            raise ValueError(
                f"row {missing[0]} has neither a text nor an image: give each row a 'text' string or "
                "'image' bytes (an encoded JPEG, PNG or WebP)"
            )
        encoder = self.production.encoder
        parts = []
        if text_rows:
            parts.append((text_rows, encoder.encode_texts([texts[i] for i in text_rows])))
        if image_rows:
            pictures = [self._decode(images[i], i) for i in image_rows]
            parts.append((image_rows, encoder.encode_images(pictures)))
        if not parts:
            return np.zeros((0, 0), dtype=np.float32)
        out = np.zeros((len(frame), parts[0][1].shape[1]), dtype=np.float32)
        for rows, vectors in parts:
            out[rows] = vectors.detach().cpu().numpy()
        return out

    def _decode(self, value: Any, row: int) -> Any:
        import base64

        from compat.data.images import decode_rgb

        data = value if isinstance(value, bytes | bytearray) else base64.b64decode(value, validate=True)
        try:
            return decode_rgb(bytes(data), size=self.decode_size)
        except ValueError as exc:
            raise ValueError(f"row {row}: the image cannot be decoded ({exc})") from exc


def _present(value: Any) -> bool:
    try:
        import pandas as pd

        return not bool(pd.isna(value))
    except (TypeError, ValueError):  # bytes and arrays are not scalars pd.isna can judge
        return True


def _as_frame(model_input: Any) -> Any:
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        cells = {c: model_input[c].iloc[0] for c in ("text", "image") if c in model_input}
        # MLflow makes {"text": [...]} one row
        if len(model_input) == 1 and cells and all(isinstance(v, list | tuple) for v in cells.values()):
            return pd.DataFrame({c: list(v) for c, v in cells.items()})
        return model_input.reset_index(drop=True)
    if isinstance(model_input, dict):
        return pd.DataFrame(
            {k: list(v) if isinstance(v, list | tuple) else [v] for k, v in model_input.items()}
        )
    if isinstance(model_input, list | tuple) and all(isinstance(v, str) for v in model_input):
        return pd.DataFrame({"text": list(model_input)})
    if isinstance(model_input, str):
        return pd.DataFrame({"text": [model_input]})
    raise TypeError(
        f"expected a DataFrame or dict with 'text' and/or 'image' columns, or a list of texts; "
        f"got {type(model_input).__name__}"
    )


def _load_pyfunc(data_path: str) -> EmbeddingModel:
    """MLflow's entry point: ``data_path`` (``data/checkpoint``) checked against :func:`expected_digest`."""
    digest, where = expected_digest(data_path)
    try:
        verify_checkpoint(data_path, digest)
    except CheckpointIntegrityError as exc:
        raise CheckpointIntegrityError(
            f"{exc} (checked against {where}): the model's files were changed after registration; "
            "refusing to load them: load another version, or register the intended files again"
        ) from exc
    return EmbeddingModel(data_path)


def expected_digest(data_path: str | Path) -> tuple[str, str]:
    """The manifest digest the files at ``data_path`` must match, and where it was read: the registry's
    ``checkpoint.sha256`` of the version when the model is loaded through a ``models:/`` URI (the files and
    the MLmodel beside them can be rewritten together; the registry's record is not theirs), else the
    MLmodel's own (:func:`recorded_digest`). A ``models:/`` version that records none is refused."""
    uri = _loading_uri()
    if uri is None or not uri.startswith("models:/"):
        return recorded_digest(data_path), "compatflow.checkpoint_sha256 in the model's MLmodel"
    from mlflow import MlflowClient
    from mlflow.store.artifact.utils.models import get_model_name_and_version
    from mlflow.tracking import get_registry_uri

    client = MlflowClient(registry_uri=get_registry_uri())
    found = get_model_name_and_version(client, uri)
    if len(found) != 2:  # a logged model's id (models:/m-...): no registered version to ask
        return recorded_digest(data_path), "compatflow.checkpoint_sha256 in the model's MLmodel"
    name, version = found
    digest = client.get_model_version(name, str(version)).tags.get("checkpoint.sha256")
    if not digest:
        raise CheckpointIntegrityError(
            f"{name} version {version} ({uri}) records no checkpoint.sha256 in the registry: no digest to "
            f"verify {data_path} against; refusing to load it (register the model again with compatflow)"
        )
    return digest, f"the registry's checkpoint.sha256 of {name} version {version}, not the MLmodel's"


def _loading_uri() -> str | None:
    """The ``model_uri`` of the ``mlflow.pyfunc.load_model`` call this loader runs under, or None. MLflow
    hands a flavour's loader only the downloaded folder; the URI it was asked for is read from that call's
    frame, the one place it is kept."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "load_model" and frame.f_globals.get("__name__") == "mlflow.pyfunc":
            uri = frame.f_locals.get("model_uri")
            return str(uri) if uri is not None else None
        frame = frame.f_back
    return None


def recorded_digest(data_path: str | Path) -> str:
    """The manifest digest the MLflow model around ``data_path`` (its ``data/checkpoint``) records in its
    MLmodel metadata (``compatflow.checkpoint_sha256``, the version's ``checkpoint.sha256`` tag);
    :class:`~compat.models.integrity.CheckpointIntegrityError` when there is none to check against."""
    import yaml

    mlmodel = Path(data_path).parents[1] / MLMODEL
    try:
        doc = yaml.safe_load(mlmodel.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointIntegrityError(
            f"cannot read {mlmodel} ({exc}): no digest to verify {data_path} against; refusing to load it"
        ) from exc
    metadata = doc.get("metadata") if isinstance(doc, dict) else None
    facts = metadata.get("compatflow") if isinstance(metadata, dict) else None
    digest = facts.get("checkpoint_sha256") if isinstance(facts, dict) else None
    if not isinstance(digest, str) or not digest:
        raise CheckpointIntegrityError(
            f"{mlmodel} records no compatflow.checkpoint_sha256: no digest to verify {data_path} against; "
            "refusing to load it (register the model again with compatflow)"
        )
    return digest


def describe(model_dir: Path) -> dict[str, Any] | None:
    """What the MLflow model records about a compatflow model directory (embedding size, method, version,
    space, serving contract), read from its files without loading it; None when it is not one."""
    import json

    from compat.methods.contract import COMPAT_FILE
    from compat.production import ProductionModelError, identity, model_kind, space_id_of

    try:
        kind = model_kind(model_dir)
        ident = identity(model_dir)
        if kind == "compat":
            doc = json.loads((model_dir / COMPAT_FILE).read_text())
            contract, dim = doc["contract"], int(doc["contract"]["dim"])
        else:
            from compat.models import read_sidecar

            contract, dim = None, int(read_sidecar(model_dir)["embed_dim"])
        space = space_id_of(model_dir)
    except (ProductionModelError, OSError, ValueError, KeyError, TypeError) as exc:
        log.info("%s is not a compatflow model directory (%s): registered as files only", model_dir, exc)
        return None
    return {
        "method": ident["method"],
        "query_model_version": ident["version"],
        "space_id": space,
        "embed_dim": dim,
        "contract": contract,
    }


def save(model_dir: Path, checkpoint_dir: Path, facts: dict[str, Any], digest: str) -> Path:
    """Write the MLflow model of ``checkpoint_dir`` (its files and manifest) to ``model_dir``."""
    import numpy as np
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.pyfunc import save_model
    from mlflow.types import ColSpec, Schema, TensorSpec

    import compat
    import components

    signature = ModelSignature(
        inputs=Schema(
            [ColSpec("string", "text", required=False), ColSpec("binary", "image", required=False)]
        ),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, facts["embed_dim"]), "embedding")]),
    )
    save_model(
        path=str(model_dir),
        loader_module=__name__,
        data_path=str(checkpoint_dir),
        signature=signature,
        input_example=pd.DataFrame({"text": ["a red circle on a striped background"]}),
        pip_requirements=_requirements(),
        # compatflow's own packages, which the loader imports (not published): MLflow puts code/ on the path
        code_paths=[str(Path(package.__file__).parent) for package in (compat, components)],
        metadata={"compatflow": {**facts, "checkpoint_sha256": digest}},
    )
    if not (model_dir / FILES).is_dir():  # MLflow copies data_path to data/<its name>
        raise RuntimeError(f"{model_dir}: the MLflow model holds no {FILES}")
    return model_dir


def _requirements() -> list[str]:
    """The installable distributions the flavour's loader needs, at their installed public versions (a
    local label such as torch's ``+cpu`` dropped: the index that serves it is not the model's business)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "open_clip_torch", "safetensors", "pillow", "numpy", "pandas"):
        try:
            found.append(f"{name}=={version(name).split('+', 1)[0]}")
        except PackageNotFoundError:
            found.append(name)
    return found
