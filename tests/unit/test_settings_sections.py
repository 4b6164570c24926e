"""One owner per setting: the runtime settings built from a config section take every value the section owns
from it (no second default), and a section field the mapping does not know is refused, not dropped."""

from __future__ import annotations

import dataclasses

import pytest

from components.deployment import RolloutSection, SloSection, TrainingSection
from components.rollout.types import RolloutConfig
from components.training.continual import NOT_CARRIED, TrainingSettings, _train_config
from components.training.continual import SECTION_FIELDS as TRAINING_FIELDS


def _without_default(cls: type) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


def test_rollout_config_takes_every_section_setting_from_the_section() -> None:
    section = RolloutSection()
    config = RolloutConfig.from_section(section, new_version="v2")
    values = {**section.model_dump(exclude={"slo"}), "fractions": tuple(section.fractions)}
    values.update(slo_p99_factor=section.slo.p99_factor, max_items_per_s=section.slo.max_items_per_s)
    for name, expected in values.items():
        assert getattr(config, name) == expected, name
    assert config.order == "lambda_orth" == RolloutSection.model_fields["order"].default
    # the section's settings have no second default in RolloutConfig: built without the section, they fail
    assert _without_default(RolloutConfig) == set(values) | {"new_version"}
    with pytest.raises(TypeError, match="order"):
        RolloutConfig(new_version="v2")  # type: ignore[call-arg]


def test_rollout_config_carries_a_set_section_and_the_run_s_own_settings() -> None:
    section = RolloutSection(
        fractions=[0.5, 1.0],
        order="random",
        batch_size=32,
        workers=2,
        floors={"R@1": 20.0},
        probe_tolerance=0.5,
        slo=SloSection(p99_factor=1.5, max_items_per_s=100.0),
    )
    config = RolloutConfig.from_section(section, new_version="v3", seed=7, space="s", flush_rows=10)
    assert (config.fractions, config.order) == ((0.5, 1.0), "random")
    assert (config.batch_size, config.workers) == (32, 2)
    assert (config.floors, config.probe_tolerance) == ({"R@1": 20.0}, 0.5)
    assert (config.slo_p99_factor, config.max_items_per_s) == (1.5, 100.0)
    assert (config.new_version, config.seed, config.space, config.flush_rows) == ("v3", 7, "s", 10)
    assert RolloutConfig.from_section(section, new_version="v3", order="oldest_first").order == "oldest_first"


def test_rollout_config_refuses_a_section_field_it_does_not_map() -> None:
    class Extended(RolloutSection):
        pause_s: float = 1.0

    with pytest.raises(TypeError, match="pause_s"):
        RolloutConfig.from_section(Extended(), new_version="v2")


def test_training_settings_take_every_section_setting_from_the_section() -> None:
    section = TrainingSection()
    settings = TrainingSettings.from_section(section)
    values = dict(section)
    assert set(TRAINING_FIELDS) | set(NOT_CARRIED) == set(TrainingSection.model_fields)
    assert not set(TRAINING_FIELDS) & set(NOT_CARRIED)
    for key, name in TRAINING_FIELDS.items():
        assert getattr(settings, name) == values[key], name
    assert (settings.replay_buffer_size, settings.replay_rows) == (1000, 16)
    # the section's settings have no second default in TrainingSettings
    assert _without_default(TrainingSettings) == set(TRAINING_FIELDS.values())
    with pytest.raises(TypeError):
        TrainingSettings()  # type: ignore[call-arg]


def test_training_settings_carry_alpha_for_modx_only_and_take_overrides() -> None:
    assert TrainingSettings.from_section(TrainingSection(alpha=5.0)).alpha == 5.0
    assert TrainingSettings.from_section(TrainingSection(method="finetune")).alpha is None
    assert TrainingSettings.from_section(TrainingSection(), method="joint").alpha is None
    given = TrainingSettings.from_section(TrainingSection(), method="finetune", alpha=2.0, precision="fp32")
    assert (given.method, given.alpha, given.precision) == ("finetune", 2.0, "fp32")  # refused at run time


def test_the_trainer_config_takes_every_shared_setting_from_the_training_settings() -> None:
    """compat's TrainConfig keeps a library's defaults; the step sets each one TrainingSettings also has."""
    shared = {f.name for f in dataclasses.fields(TrainingSettings)} - {"alpha"}
    settings = TrainingSettings.from_section(
        TrainingSection(
            steps=7, batch_size=12, replay_rows=4, lr=0.01, warmup_fraction=0.3, checkpoint_every=3, seed=5
        ),
        accum_steps=2,
        weight_decay=0.1,
        precision="fp32",
        selective_correction=False,
    )
    config = _train_config(settings, 3.0)
    names = {f.name for f in dataclasses.fields(config)} & shared
    assert names >= {"steps", "batch_size", "lr", "warmup_fraction", "checkpoint_every", "seed"}
    for name in names:
        assert getattr(config, name) == getattr(settings, name), name
    assert config.alpha == 3.0
