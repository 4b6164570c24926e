"""Unreadable bytes in a workspace file: every command that reads it names the file and exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.cli import app

GARBAGE = b"\xff\xfe\x00\x80 not text \xc3\x28"


@pytest.mark.parametrize(
    ("name", "commands"),
    [
        ("serving.json", [["status"], ["search", "a red circle"]]),
        ("rollout_state.json", [["status"], ["rollout", "status"]]),
        ("state.json", [["status"]]),
    ],
)
def test_binary_garbage_is_named_and_refused(tmp_path: Path, name: str, commands: list[list[str]]) -> None:
    (tmp_path / name).write_bytes(GARBAGE)
    for command in commands:
        result = CliRunner().invoke(app, [*command, "--workspace", str(tmp_path)])
        assert result.exit_code != 0, (command, result.output)
        assert f"{tmp_path / name}: not UTF-8 text" in result.output or (
            f"{tmp_path / name} is unreadable" in result.output
        ), (command, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


@pytest.mark.parametrize("root", ["/", "/etc", "/usr", "~"])
def test_the_root_or_a_system_folder_is_refused_as_workspace(root: str) -> None:
    from pipelines.config import ConfigError, load_config, resolve

    result = CliRunner().invoke(app, ["status", "--workspace", root])
    assert result.exit_code == 2 and "must be a folder of its own" in result.output, result.output
    config = load_config("local").with_changes(workspace=root)
    with pytest.raises(ConfigError, match="config field 'workspace': workspace .* is refused"):
        resolve(config)
