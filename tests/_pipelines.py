"""The pipeline as the end-to-end tests drive it: small local configs, a gate policy that clears any
candidate, and :class:`Cycle`, the pipeline's steps for one workspace in the order the pipeline runs them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import yaml

from components.runs import record_phase


def write_local_config(path: Path, change) -> Path:
    """The shipped local config with ``change(document)`` applied, written to ``path``."""
    from pipelines.config import CONFIG_DIR

    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    change(document)
    path.write_text(yaml.safe_dump(document))
    return path


def local_config(tmp_path, phases=2):
    from pipelines.config import CONFIG_DIR

    config = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(
        uri=str(tmp_path / "ws" / "stream"),
        phases=phases,
        samples_per_phase=160,
        eval_per_domain=20,
        gallery_per_domain=40,
    )
    config["drift"]["sample_size"] = 80
    config["training"].update(steps=6, batch_size=16, replay_buffer_size=40, replay_rows=4)
    config["compat"].update(steps=6, batch_size=16)
    return config


# Clears any candidate: for checking what runs after a pass, not the gate's judgement
# (tests/unit/test_gate.py).
PERMISSIVE_POLICY = """
min_margin: -100.0
require_ci_lower_above_zero: false
min_eval_images: 1
min_eval_captions: 1
retention: {floor: 0.0}
"""


def chain_config(tmp_path: Path, stream: Path, method: str, scenario: str = "continual") -> dict:
    from pipelines.config import CONFIG_DIR, resolve

    config = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy = tmp_path / "permissive.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    config["workspace"] = str(tmp_path / "ws")
    config["stream"].update(uri=str(stream), generate_if_missing=False)
    config["drift"]["sample_size"] = 24
    config["training"].update(steps=3, batch_size=16, replay_buffer_size=16, replay_rows=4)
    # XBT pretrains its projection on text alone for 2000 steps by default (compat/methods/xbt.py); a few do
    # here: what is tested is that its model ships and upgrades, not how well the projection fits.
    options = {"stage1_steps": 5} if method == "xbt" else {}
    config["compat"].update(method=method, scenario=scenario, steps=3, batch_size=16, options=options)
    # The foundation scenario's own architecture, small here: what is tested is that a model trained from
    # its own initialisation and mapped into production's space becomes the next production model.
    config["compat"]["foundation_config"] = "cf-tiny"
    config["gate"]["policy"] = str(policy)
    config["rollout"]["batch_size"] = 16
    return resolve(config).to_dict()


class Cycle:
    """The pipeline's steps for one workspace, in the order the pipeline runs them."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def _validated(self, phase: int) -> tuple[dict, Path, Path]:
        from components import steps

        plan = steps.plan_step(self.config, phase, f"run-{phase}-{len(self.runs())}")
        run_dir = Path(plan["run_dir"])
        validated = run_dir / "_validated"
        steps.validate_step(
            self.config, run_dir, phase, plan["train_shards"], validated, run_dir / "_validation.json"
        )
        return plan, run_dir, validated

    def runs(self) -> list[Path]:
        root = Path(self.config["workspace"]) / "runs"
        return sorted(root.iterdir()) if root.is_dir() else []

    def bootstrap(self) -> None:
        from components import steps
        from components.rollout import RolloutPaths

        plan, run_dir, validated = self._validated(0)
        steps.continual_step(
            self.config, run_dir, 0, plan["stream_dir"], str(validated), "", run_dir / "_candidate"
        )
        version = steps.register_step(self.config, run_dir, 0, str(run_dir / "_candidate"), bootstrap=True)
        registry = steps.registry_of(self.config)  # the training curve was logged as training ran, once
        history = registry.client.get_metric_history(version["mlflow_run_id"], "train.loss")
        assert [m.step for m in history] == list(range(1, self.config["training"]["steps"] + 1))
        steps.serve_first_model_step(self.config, run_dir, version["version"], plan["gallery_shards"])
        # Retrieval examples for the report: the newest gallery captions searched as served, with pictures.
        examples = json.loads((run_dir / "rollout" / "examples.json").read_text())["queries"]
        assert len(examples) == 3 and all(len(q["hits"]) == 3 for q in examples)
        assert all(h["thumbnail"].startswith("data:image/jpeg;base64,") for q in examples for h in q["hits"])
        # Every caption of a probed picture is a query (five per picture here).
        probe = json.loads(RolloutPaths.for_workspace(self.config["workspace"]).probe.read_text())
        per_picture = Counter(ids[0] for ids in probe["positives"])
        assert per_picture and set(per_picture.values()) == {5}, per_picture
        record_phase(Path(self.config["workspace"]), 0, "succeeded", run_dir.name)  # the exit handler's part

    def train(self, phase: int) -> tuple[dict, Path, str]:
        """Validate, drift, continual and compat training of ``phase`` against production."""
        from components import steps

        production = steps.resolve_production(self.config)
        assert production, "no production model"
        plan, run_dir, validated = self._validated(phase)
        steps.drift_step(
            self.config,
            run_dir,
            plan["reference_shards"],
            str(validated),
            production,
            run_dir / "_drift.html",
            run_dir / "_drift.json",
        )
        steps.continual_step(
            self.config,
            run_dir,
            phase,
            plan["stream_dir"],
            str(validated),
            production,
            run_dir / "_candidate",
        )
        steps.ingest_step(self.config, run_dir, plan["gallery_shards"])
        compat = steps.compat_step(
            self.config,
            run_dir,
            phase,
            str(run_dir / "_candidate" / "model"),
            production,
            str(validated),
            run_dir / "_compat",
        )
        return plan, run_dir, compat

    def ship(self, phase: int, *, probes_can_halt: bool = False) -> dict:
        """One upgrade through evaluate, gate, register and rollout; returns the rollout summary."""
        from components import steps
        from components.rollout import RolloutPaths

        plan, run_dir, compat = self.train(phase)
        production = steps.resolve_production(self.config)
        steps.evaluate_step(
            self.config, run_dir, production, compat, plan["eval_shards"], run_dir / "_evaluate", phase
        )
        decision = steps.gate_step(
            self.config,
            run_dir,
            str(run_dir / "_evaluate" / "compat_report.json"),
            str(run_dir / "_validation.json"),
            str(run_dir / "_drift.json"),
            run_dir / "_gate",
        )
        assert decision == "pass"
        sizes = json.loads((run_dir / "_evaluate" / "compat_report.json").read_text())["eval_sizes"]
        assert sizes["captions"] == 5 * sizes["images"] > 0  # recall over every caption of every picture
        version = steps.register_step(self.config, run_dir, phase, compat)["version"]
        # Every gallery item relevant to every probe query: the probes cannot halt this rollout. These
        # tests check that each kind of model loads, serves and upgrades; tests/integration/test_rollout.py
        # the probes.
        if not probes_can_halt:
            probe = RolloutPaths.for_workspace(self.config["workspace"]).probe
            doc = json.loads(probe.read_text())
            everything = sorted({p for positives in doc["positives"] for p in positives})
            probe.write_text(json.dumps({"texts": doc["texts"][:8], "positives": [everything] * 8}))
        summary = steps.rollout_step(self.config, run_dir, version)
        examples = json.loads((run_dir / "rollout" / "examples.json").read_text())["queries"]
        served = summary["version"] if summary["promoted"] else None
        assert examples and all(
            h["model_version"] == (served or h["model_version"]) for q in examples for h in q["hits"]
        )
        status = "succeeded" if summary["promoted"] else "rejected"
        record_phase(Path(self.config["workspace"]), phase, status, run_dir.name)
        return summary


def served_gallery(config: dict) -> dict:
    """:func:`components.adapters.index.gallery_status` of the gallery the workspace's serving record names
    (its alias is the deployment's own unless the config names one)."""
    from components.adapters.index import gallery_status
    from components.serving.record import read_serving

    record = read_serving(Path(config["workspace"]) / "serving.json")
    return gallery_status(record.uri, record.alias)


def assert_serves(config: dict, version: str, n_items: int) -> None:
    """Production is ``version``, the gallery holds one vector per item, all written by it, and a text
    search through the serving alias answers with gallery items and their captions (read from the shards
    the rows name)."""
    from components import steps
    from components.serving.search import search

    registry = steps.registry_of(config)
    assert registry.alias_version("production") == version
    gallery = served_gallery(config)
    assert gallery["by_version"] == {version: n_items}
    (hits,) = search(["a red circle"], k=3, workspace=config["workspace"], captions=True)
    assert len(hits) == 3 and all(hit["model_version"] == version for hit in hits)
    assert all(isinstance(hit["caption"], str) and hit["caption"] for hit in hits), hits


def pinned_package(out_dir: Path) -> Path:
    """The committed compiled pipeline with its images pinned by a (made-up) digest, as ``compatflow compile
    --digest`` writes them: what ``pipeline submit`` accepts (the committed one names its images by tag)."""
    import re

    from pipelines.compile import COMPILED_DIR, COMPILED_NAME

    text = (COMPILED_DIR / COMPILED_NAME).read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / COMPILED_NAME
    path.write_text(re.sub(r"(\n +image: \S+:[\w.-]+)\n", rf"\1@sha256:{'c' * 64}\n", text))
    return path
