"""The synthetic upgrade's rollout (benchmarks.synthetic_upgrade) and encoders that die at a chosen call, the
state a kill -9 mid-backfill leaves: shared by the rollback tests."""

from __future__ import annotations

from benchmarks.synthetic_upgrade import MODULE as SYNTH_MODULE
from benchmarks.synthetic_upgrade import synthetic_encoders, synthetic_upgrade
from components import rollout as ro
from components.deployment import RolloutSection

N, Q, SEED = 400, 200, 3
OPTS = {"n_items": str(N), "n_queries": str(Q), "seed": str(SEED)}
UPGRADE = synthetic_upgrade(n_items=N, n_queries=Q, seed=SEED)
PROBE = ro.ProbeSet(UPGRADE.query_texts, [[UPGRADE.item_ids[p[0]]] for p in UPGRADE.positives])


class Died(Exception):
    """What the dying encoders raise."""


def rollout_config(version: str) -> ro.RolloutConfig:
    query_model = {"factory": f"{SYNTH_MODULE}:synthetic_query_encoder", "options": OPTS, "side": "new"}
    return ro.RolloutConfig.from_section(
        RolloutSection(), new_version=version, query_model=query_model, batch_size=32, order="random"
    )


def dying_encoders(at_call: int) -> ro.RolloutEncoders:
    """The synthetic encoders, whose gallery encoder raises :class:`Died` at its ``at_call``-th call."""
    good = synthetic_encoders({"options": OPTS})
    calls = {"n": 0}

    def gallery(refs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise Died("the process died here")
        return good.new_gallery(refs)

    return ro.RolloutEncoders(good.old_query, good.new_query, gallery)
