"""A cluster compile of the config (kfp's compiler) leaves the gate policy's path to the task."""

import pytest
import yaml
from _pipelines import write_local_config

from pipelines.config import ConfigError, load_config


def test_a_cluster_compile_leaves_the_policy_path_to_the_task(tmp_path):
    """A compile reads the config on another machine than the tasks: gate.policy is the container's path."""
    from pipelines import resources

    pod_only = "/etc/compatflow/not-on-this-machine.yaml"
    path = write_local_config(tmp_path / "pod.yaml", lambda d: d["gate"].update(policy=pod_only))
    with pytest.raises(ConfigError, match="gate.policy"):
        load_config(path)
    assert load_config(path, local_paths=False).gate.policy == pod_only
    assert resources.compile_settings(path)["config"].gate.policy == pod_only
    broken = write_local_config(
        tmp_path / "gpu.yaml", lambda d: d["resources"]["gpu"].update(accelerator_count=1)
    )
    with pytest.raises(ConfigError, match=r"gpu\.yaml: resources\.gpu: accelerator_count is 1"):
        resources.compile_settings(broken)
    mapping = yaml.safe_load(broken.read_text())  # one rule, whichever way the config arrives
    with pytest.raises(ConfigError, match=r"resources\.gpu: accelerator_count is 1"):
        resources.compile_settings(mapping)
