"""Pipeline configs: valid against their schema, local and cluster differ only in values."""

import pytest
import yaml

from pipelines.config import CONFIG_DIR, ConfigError, load_config


def _key_paths(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{prefix}{key}"
            if key not in ("node_selector", "options"):  # free-form maps: their keys are values
                yield from _key_paths(value, f"{prefix}{key}.")


@pytest.mark.parametrize("name", ["local", "cluster"])
def test_shipped_configs_are_valid(name):
    config = load_config(name)
    assert config["name"] == name


def test_local_and_cluster_share_every_key():
    local, cluster = load_config("local"), load_config("cluster")
    assert set(_key_paths(local)) == set(_key_paths(cluster))


def test_bad_config_names_file_and_field(tmp_path):
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    document["training"]["steps"] = 0
    del document["rollout"]["order"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert "training.steps" in message
    assert "rollout" in message and "order" in message


def test_replay_rows_must_fit_the_batch(tmp_path):
    document = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    document["training"].update(batch_size=16, replay_buffer_size=100, replay_rows=16)
    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match=r"training.replay_rows is 16.*\[1, 14\]"):
        load_config(path)
    document["training"]["replay_buffer_size"] = 0  # no buffer: the rows setting is unused
    path.write_text(yaml.safe_dump(document))
    assert load_config(path)["training"]["replay_rows"] == 16


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
    assert load_config(path)["compat"]["options"] == {"influence_weight": 2.0}


def test_unparseable_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(path)
