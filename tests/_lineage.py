"""Lineage tallies for tests: items per model version, read from a lineage repo's offline parts."""

from __future__ import annotations

from components.adapters.lineage import LineageStore, _arrow_schema


def version_counts(store: LineageStore) -> dict[str, int]:
    """Items per model version, from the offline rows' newest entry per item.

    Reads the offline parts whole, as Arrow columns: a repo-wide tally for tests and small galleries (on a
    large gallery :meth:`LineageStore.check_against_index` streams)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    if not store.has_items():
        return {}
    parts = sorted(store.items_dir.glob("*.parquet"))
    table = ds.dataset([str(p) for p in parts], format="parquet", schema=_arrow_schema()).to_table(
        columns=["item_id", "model_version", "written_at", "embedded_at"]
    )
    order = pc.sort_indices(
        table, [("item_id", "ascending"), ("written_at", "ascending"), ("embedded_at", "ascending")]
    )
    ids, versions = table["item_id"].take(order), table["model_version"].take(order)
    # The newest row of an item is the last of its run in this order.
    last = pc.not_equal(ids[:-1], ids[1:]) if len(ids) > 1 else pa.array([], pa.bool_())
    newest = pc.filter(versions, pa.concat_arrays([last.combine_chunks(), pa.array([True])]))
    counts = pc.value_counts(newest)
    return {str(c["values"]): int(c["counts"]) for c in counts.to_pylist()}


def versions_by_item(store: LineageStore, item_ids: list[str]) -> dict[str, str | None]:
    """``{item_id: model_version}`` from the online store (``None``: not recorded)."""
    return {row["item_id"]: row["model_version"] for row in store.get_items(item_ids)}
