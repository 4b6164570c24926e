"""After ``compatflow adopt``, the weekly cycle goes on from the adopted model: phase 1 trains from it, is
made compatible with it, evaluated and gated against it, registered as version 2, rolled out over the adopted
items (re-embedded from their own image files) and rolled back to them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from _pipelines import Cycle, chain_config

TINY = {  # the shape of cf-tiny, so that config reads the weights
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


def _team_gallery(stream_dir: Path, root: Path, uri: str) -> Path:
    """The stream's phase-0 gallery as a team serves it: image files, a collection of its own field names
    with vectors of a checkpoint open_clip wrote; returns the checkpoint."""
    import open_clip
    from pymilvus import DataType, MilvusClient

    from compat.data.loader import load_captioned_set
    from components.adapters.index import LITE_GRPC_OPTIONS

    torch.manual_seed(7)
    model = open_clip.CLIP(**TINY).eval()
    weights = root / "team_clip.pt"
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, weights)
    items = load_captioned_set(sorted(str(p) for p in stream_dir.glob("phase-00/gallery/*.tar")))
    (root / "images").mkdir()
    paths = []
    for key, image in zip(items.keys, items.images, strict=True):
        paths.append(root / "images" / f"{key}.png")
        image.save(paths[-1])
    preprocess = open_clip.image_transform(64, is_train=False)
    with torch.no_grad():
        pixels = torch.stack([preprocess(image) for image in items.images])
        vectors = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1).numpy()
    client = MilvusClient(uri, grpc_options=dict(LITE_GRPC_OPTIONS))  # as every client of a loopback server
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("sku", DataType.VARCHAR, is_primary=True, max_length=128)
    schema.add_field("vec", DataType.FLOAT_VECTOR, dim=64)
    schema.add_field("path", DataType.VARCHAR, max_length=512)
    schema.add_field("title", DataType.VARCHAR, max_length=512)
    index = client.prepare_index_params()
    index.add_index(field_name="vec", index_type="HNSW", metric_type="COSINE", params={"M": 8})
    client.create_collection("shop", schema=schema, index_params=index)
    client.insert(
        "shop",
        [
            {"sku": key, "vec": np.asarray(v).tolist(), "path": str(p), "title": captions[0]}
            for key, v, p, captions in zip(items.keys, vectors, paths, items.captions, strict=True)
        ],
    )
    client.flush("shop")
    client.close()
    return weights


def test_the_next_phase_trains_and_is_gated_against_the_adopted_model(
    stream_dir, milvus_lite_server, tmp_path
):
    from components import steps
    from components.adoption import Source, adopt
    from components.deployment import Deployment
    from components.state.workspace import Workspace

    weights = _team_gallery(stream_dir, tmp_path, milvus_lite_server)
    config = chain_config(tmp_path, stream_dir, "bct")
    # 3 training steps on a few dozen items: the probe of so small a model is noise; what is checked here is
    # that the rollout reads the adopted items and the rollback returns to them
    config["rollout"]["probe_tolerance"] = 100.0
    deployment = Deployment.coerce(config)
    source = Source(milvus_lite_server, "shop", "sku", "vec", image_field="path", caption_field="title")
    try:
        summary = adopt(
            Workspace.of(deployment),
            source,
            arch="cf-tiny",
            weights=str(weights),
            model_name=deployment.registry.model_name,
        )
        assert summary["proof"]["cosine_median"] >= 0.99 and summary["n_items"] > 0
        production = steps.resolve_production(config)
        assert Path(production) == Path(config["workspace"]) / "models" / "v1"

        plan, run_dir, compat = Cycle(config).train(1)  # ingest, drift, continual and compat from version 1
        assert plan["phase"] == 1
        steps.evaluate_step(
            config, run_dir, production, compat, plan["eval_shards"], run_dir / "_evaluate", 1
        )
        decision = steps.gate_step(
            config,
            run_dir,
            str(run_dir / "_evaluate" / "compat_report.json"),
            str(run_dir / "_validation.json"),
            str(run_dir / "_drift.json"),
            run_dir / "_gate",
        )
        assert decision == "pass"  # the permissive policy: what runs after a pass, not the gate's judgement
        registered = steps.register_step(config, run_dir, 1, compat)
        assert registered["version"] == "2"
        registry = steps.registry_of(config)
        assert registry.alias_version("production") == "1" and registry.alias_version("candidate") == "2"

        # the rollout re-embeds the adopted items from their own image files, then a rollback returns to them
        from components.adapters.index import gallery_status
        from components.rollout import read_serving

        ws = Workspace.of(deployment)
        adopted = read_serving(ws.serving_path).collection
        shipped = steps.rollout_step(config, run_dir, "2")
        assert shipped["promoted"], (shipped["rollout"]["status"], shipped["rollout"].get("halt_reason"))
        served = read_serving(ws.serving_path)
        assert served.collection != adopted and set(
            gallery_status(served.uri, served.alias)["by_version"]
        ) == {"2"}
        result = steps.rollback_production(registry)
        assert registry.alias_version("production") == "1", result
        back = read_serving(ws.serving_path)
        assert back.collection == adopted
        assert set(gallery_status(back.uri, back.alias)["by_version"]) == {"1"}
        from components.adapters.lineage import check_from_index

        check = check_from_index(ws.lineage_dir, back.uri, back.alias, definition=ws.lineage_definition)
        assert check["agree"] and set(check["lineage"]) == {"1"}, check
    finally:
        from pymilvus import MilvusClient

        from components.adapters.index import LITE_GRPC_OPTIONS

        client = MilvusClient(milvus_lite_server, grpc_options=dict(LITE_GRPC_OPTIONS))
        client.drop_collection("shop")
        client.close()
