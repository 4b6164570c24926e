"""Feast definitions of the gallery item entity and its lineage features.

One row per write of an item's vector: ``item_id`` (entity), ``caption``, ``image_uri``,
``model_version`` and ``space_id`` (the model and embedding space that wrote the vector),
``embedded_at`` (when, in epoch microseconds: Feast's Milvus online store has no timestamp type),
``phase`` and ``domain`` (where the item came from), and ``written_at``
(the event timestamp: the newest write is what the online store serves). Rows are pushed through the
PushSource ``gallery_items_push`` (online); the offline rows are the append-only parquet parts of its batch
source. Self-contained (Feast only) so that ``feast apply`` works in a copied repo (the cluster's ConfigMap
holds this file: manifests/k8s/feast/configmap.yaml).
"""

from datetime import timedelta

from feast import Entity, FeatureView, Field, FileSource, PushSource, ValueType
from feast.types import Int64, String

PROJECT = "compatflow"
ITEMS_VIEW = "gallery_items"
ITEMS_SOURCE_DIR = "data/items"  # a directory of parquet parts, relative to the repo
ITEMS_PUSH = "gallery_items_push"

item = Entity(
    name="item",
    join_keys=["item_id"],
    value_type=ValueType.STRING,
    description="A gallery item (image + captions) indexed for retrieval.",
)

items_source = FileSource(
    name="gallery_items_source",
    path=ITEMS_SOURCE_DIR,
    timestamp_field="written_at",
    description="Append-only parquet parts written by compatflow's indexing and backfill stages.",
)

items_push = PushSource(
    name=ITEMS_PUSH,
    batch_source=items_source,
    description="Lineage rows pushed by compatflow's indexing, backfill and rollback (online).",
)

gallery_items = FeatureView(
    name=ITEMS_VIEW,
    entities=[item],
    ttl=timedelta(0),  # lineage never expires
    schema=[
        Field(name="caption", dtype=String),
        Field(name="image_uri", dtype=String),
        Field(name="model_version", dtype=String),
        Field(name="space_id", dtype=String),
        Field(name="embedded_at", dtype=Int64),  # epoch microseconds
        Field(name="phase", dtype=Int64),
        Field(name="domain", dtype=String),
    ],
    online=True,
    source=items_push,
    description="Which model version and embedding space wrote each gallery item's current vector, and when.",
    tags={"owner": "compatflow"},
)

FEATURE_NAMES = ["caption", "image_uri", "model_version", "space_id", "embedded_at", "phase", "domain"]
FEATURES = [f"{ITEMS_VIEW}:{name}" for name in FEATURE_NAMES]
