"""Pipeline configs: valid, local generated from the model, cluster only what production changes, and every
a step would meet after minutes of running is refused when the config is loaded."""

import re

import pytest
import yaml
from _pipelines import write_local_config

from pipelines.config import CONFIG_DIR, ConfigError, load_config


@pytest.mark.parametrize("name", ["local", "cluster"])
def test_shipped_configs_are_valid(name):
    assert load_config(name, local_paths=name == "local").name == name


def test_a_run_of_the_cluster_config_needs_its_start_weights_here():
    """cluster.yaml starts from open_clip's ViT-B-32 / laion2b_s34b_b79k: a run refuses to start where those
    weights are not (nothing is downloaded at run time), naming the command that puts them there."""
    with pytest.raises(ConfigError, match=r"compatflow models fetch ViT-B-32 laion2b_s34b_b79k --to"):
        load_config("cluster")


def test_the_local_config_is_the_one_the_model_generates():
    """Every setting with its default and description: `python -m components.deployment` writes it again."""
    from components.deployment import defaults_yaml

    assert (CONFIG_DIR / "local.yaml").read_text() == defaults_yaml()


def test_the_cluster_config_writes_only_what_production_changes():
    from components.deployment import Deployment

    defaults = Deployment().to_dict()
    written = yaml.safe_load((CONFIG_DIR / "cluster.yaml").read_text())

    def restated(node, default, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and key not in ("node_selector", "options"):
                yield from restated(value, default[key], f"{prefix}{key}.")
            elif value == default[key]:
                yield f"{prefix}{key}"

    assert list(restated(written, defaults)) == []  # a default restated there hides the next default change


def test_bad_config_names_file_and_field(tmp_path):
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    document["training"]["steps"] = 0
    document["rollout"]["order"] = 3  # (a missing setting takes its default)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert "training.steps" in message
    assert "rollout" in message and "order" in message


def test_loader_workers_reach_the_training_step(tmp_path):
    """training.loader_workers is the training step's decoding processes; 0 (decode in the training process)
    is allowed, a negative count is refused naming the field."""
    from components.training.continual import TrainingSettings

    cluster = load_config("cluster", local_paths=False)  # its start weights are the cluster's, not here
    assert TrainingSettings.from_section(cluster.training).loader_workers == 8
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    path = tmp_path / "workers.yaml"
    for workers in (0, -1):
        document["training"]["loader_workers"] = workers
        path.write_text(yaml.safe_dump(document))
        if workers >= 0:
            assert TrainingSettings.from_section(load_config(path).training).loader_workers == 0
            continue
        with pytest.raises(ConfigError, match=r"training.loader_workers"):
            load_config(path)


def test_replay_rows_must_fit_the_batch(tmp_path):
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    document["training"].update(batch_size=16, replay_buffer_size=100, replay_rows=16)
    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match=r"training: replay_rows is 16.*\[1, 14\]"):
        load_config(path)
    document["training"]["replay_buffer_size"] = 0  # no buffer: the rows setting is unused
    path.write_text(yaml.safe_dump(document))
    assert load_config(path).training.replay_rows == 16


def test_compat_options_are_checked_against_the_method(tmp_path):
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    path = tmp_path / "options.yaml"
    for options, method, match in (
        ({"influence_weight": "high"}, "bct", r"compat.options \(bct\): influence_weight"),
        ({"synthesize_unmatched": True}, "lambda_orth", r"unknown setting\(s\) \['synthesize_unmatched'\]"),
        ({"steps": 5}, "bct", r"compat.options may not set \['steps'\]"),
    ):
        document["compat"].update(method=method, options=options)
        path.write_text(yaml.safe_dump(document))
        with pytest.raises(ConfigError, match=match) as err:
            load_config(path)
        assert str(path) in str(err.value)
    document["compat"].update(method="bct", options={"influence_weight": 2.0})
    path.write_text(yaml.safe_dump(document))
    assert load_config(path).compat.options == {"influence_weight": 2.0}


def test_unparseable_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(path)


def _policy(tmp_path, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return str(path)


LATE_MISTAKES = {
    # id: (change(document, tmp_path), what the message says after "<file>: ")
    "fractions_not_increasing": (
        lambda d, _: d["rollout"].update(fractions=[0.5, 0.25, 1.0]),
        r"rollout\.fractions must increase strictly within \(0, 1\] and end at 1\.0 "
        r".*got \[0\.5, 0\.25, 1\.0\]",
    ),
    "fractions_not_ending_at_1": (
        lambda d, _: d["rollout"].update(fractions=[0.1, 0.5]),
        r"rollout\.fractions must .*end at 1\.0 .*got \[0\.1, 0\.5\]",
    ),
    "gate_policy_missing": (
        lambda d, t: d["gate"].update(policy=str(t / "no-such-policy.yaml")),
        r"gate\.policy: cannot read the gate policy .*no-such-policy\.yaml",
    ),
    "gate_policy_breaks_its_schema": (
        lambda d, t: d["gate"].update(policy=_policy(t, "min_margin: high\nks: [0]\n")),
        r"gate\.policy: .*policy\.yaml is not a valid GatePolicy:(.|\n)*min_margin",
    ),
    "gate_policy_not_a_mapping": (
        lambda d, t: d["gate"].update(policy=_policy(t, "- t2i\n")),
        r"gate\.policy: gate policy .*policy\.yaml must be a YAML mapping",
    ),
    "unknown_rollout_order": (  # the model's Literal catches it
        lambda d, _: d["rollout"].update(order="newest_first"),
        r"rollout\.order: Input should be 'random', 'oldest_first', 'lambda_orth' or 'uncertainty' "
        r"\(got 'newest_first'\)",
    ),
    "misspelt_setting": (
        lambda d, _: d["training"].update(stpes=5),
        r"training\.stpes: is not a setting of this section",
    ),
    "gpu_count_without_accelerator": (
        lambda d, _: d["resources"]["gpu"].update(accelerator=None, accelerator_count=1),
        r"resources\.gpu: accelerator_count is 1 but accelerator is not set",
    ),
    "gpu_accelerator_without_count": (
        lambda d, _: d["resources"]["gpu"].update(accelerator="nvidia.com/gpu", accelerator_count=0),
        r"resources\.gpu: accelerator_count must be at least 1 when accelerator is set",
    ),
    "toleration_unknown_field": (
        lambda d, _: d["resources"]["gpu"].update(tolerations=[{"key": "gpu", "toleration_seconds": 5}]),
        r"resources\.gpu\.tolerations\.0\.toleration_seconds: is not a setting of this section",
    ),
    "toleration_exists_with_value": (
        lambda d, _: d["resources"]["gpu"].update(
            tolerations=[{"key": "gpu", "operator": "Exists", "value": "true", "effect": "NoSchedule"}]
        ),
        r"resources\.gpu\.tolerations\.0: value must be empty when operator is Exists",
    ),
    "toleration_seconds_without_no_execute": (
        lambda d, _: d["resources"]["gpu"].update(
            tolerations=[
                {"key": "spot", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}
            ]
        ),
        r"resources\.gpu\.tolerations\.0: tolerationSeconds is set, so effect must be NoExecute",
    ),
    "unknown_model_config": (
        lambda d, _: d["training"].update(model_config="cf-nope"),
        r"training\.model_config: unknown model config 'cf-nope'; known configs: .*cf-tiny",
    ),
}


@pytest.mark.parametrize(("change", "message"), LATE_MISTAKES.values(), ids=LATE_MISTAKES.keys())
def test_late_mistakes_are_refused_at_load(tmp_path, change, message):
    path = write_local_config(tmp_path / "late.yaml", lambda d: change(d, tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert re.search(message, text), text
    assert str(path) in text


def test_every_problem_is_reported_together_one_line_each(tmp_path):
    """The sections' own rules together, then (once the sections hold) the rules of the code using them."""

    def change(document):
        document["training"].update(batch_size=16, replay_buffer_size=100, replay_rows=16)
        document["resources"]["gpu"].update(accelerator=None, accelerator_count=2)

    def later(document):
        document["gate"]["policy"] = str(tmp_path / "missing.yaml")
        document["rollout"]["fractions"] = [0.5, 0.25]

    for edit, fields in (
        (change, ["training: replay_rows ", "resources.gpu: accelerator_count "]),
        (later, ["gate.policy: ", "rollout.fractions "]),
    ):
        path = write_local_config(tmp_path / "many.yaml", edit)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        lines = str(err.value).splitlines()
        assert len(lines) == len(fields), lines
        for line, field in zip(lines, fields, strict=True):
            assert line.startswith(f"{path}: {field}"), line
