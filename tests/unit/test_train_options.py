"""`compatflow train continual` sets every setting of the training section: an option per setting (none
dropped on the way to torchrun's ranks or a PyTorchJob), and ``--deployment`` takes a whole section."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_of_the_training_section_has_an_option_of_the_command():
    import typer.main

    from components.training.continual import SECTION_FIELDS
    from pipelines.cli import app
    from pipelines.commands.train import TRAINER_SETTINGS
    from pipelines.config import setting_option

    command = typer.main.get_command(app).commands["train"].commands["continual"]
    options = {option for param in command.params for option in param.opts}
    settings = [*SECTION_FIELDS.values(), *TRAINER_SETTINGS]
    missing = [setting_option(s) for s in settings if setting_option(s) not in options]
    assert not missing, f"options the command lacks: {missing}"


def test_deployment_gives_the_clusters_whole_training_section():
    from components.deployment import TrainingSection
    from components.training.continual import TrainingSettings
    from pipelines.commands.train import _training_section
    from pipelines.config import load_config

    cluster = ROOT / "pipelines" / "configs" / "cluster.yaml"
    section = _training_section(cluster)
    expected = load_config(cluster, local_paths=False).training
    settings = TrainingSettings.from_section(section)
    assert settings.pretrained == expected.pretrained == "laion2b_s34b_b79k"
    assert (settings.alpha, settings.replay_buffer_size, settings.replay_rows) == (2.0, 20000, 70)
    assert (settings.loader_workers, settings.device, settings.steps) == (8, "cuda", 20000)
    assert settings.weights_dir == "/mnt/compatflow/weights"  # the workspace's, as the pipeline step's
    assert TrainingSettings.from_section(_training_section(None)) == TrainingSettings.from_section(
        TrainingSection()
    )


def test_a_deployment_with_epochs_needs_steps(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from pipelines.cli import app

    document = yaml.safe_load((ROOT / "pipelines" / "configs" / "local.yaml").read_text())
    document["workspace"] = str(tmp_path / "ws")
    document["training"]["epochs"] = 2
    config = tmp_path / "epochs.yaml"
    config.write_text(yaml.safe_dump(document))
    result = CliRunner().invoke(
        app,
        [
            "train",
            "continual",
            f"--deployment={config}",
            "--stream=s",
            "--phase=0",
            f"--out={tmp_path / 'o'}",
        ],
    )
    assert result.exit_code != 0 and "training.epochs is 2" in result.output and "--steps" in result.output


@pytest.mark.parametrize("bad", ["no-such.yaml"])
def test_a_missing_deployment_is_named(tmp_path, bad):
    from typer.testing import CliRunner

    from pipelines.cli import app

    result = CliRunner().invoke(
        app, ["train", "continual", f"--deployment={tmp_path / bad}", "--stream=s", "--phase=0", "--out=o"]
    )
    assert result.exit_code != 0 and bad in result.output


def test_every_rank_takes_an_equal_share_of_the_global_batch_or_the_batch_is_refused() -> None:
    """What a torchrun of the training command needs of ``batch_size``: it splits evenly over the ranks."""
    from compat.training.ddp import DistInfo

    shares = [DistInfo(rank=r, world_size=4).local_slice(8) for r in range(4)]
    assert shares == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(ValueError, match="global batch 8 does not split evenly over 3 ranks"):
        DistInfo(rank=0, world_size=3).local_slice(8)
