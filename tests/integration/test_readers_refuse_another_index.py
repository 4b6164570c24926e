"""The read-only commands refuse a config whose index disagrees with the serving record, as ``compatflow run``
does: ``status``, ``search``, ``serve`` and ``lineage --check`` would otherwise answer from the record's index
while the config names another one."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from components.serving.record import write_serving
from components.state.workspace import Workspace
from pipelines.cli import app
from tests._pipelines import write_local_config

OTHER = "http://127.0.0.1:9"


@pytest.fixture
def disagreeing(tmp_path: Path) -> tuple[Workspace, Path]:
    """A workspace served from its embedded index, and a config naming a server index instead."""
    ws = Workspace(tmp_path / "ws")
    ws.root.mkdir(parents=True)
    write_serving(
        ws.serving_path,
        uri=ws.index_uri,
        alias="gallery",
        collection="gallery_s_1",
        space="s",
        dim=8,
        query_model={"version": "1", "uri": str(ws.model_dir("1"))},
    )

    def change(document: dict) -> None:
        document["workspace"] = str(ws.root)
        document["index"]["uri"] = OTHER

    return ws, write_local_config(tmp_path / "config.yaml", change)


@pytest.mark.parametrize(
    "args",
    [["status"], ["search", "-k", "5", "a red circle"], ["serve", "--port", "18999"], ["lineage", "--check"]],
    ids=["status", "search", "serve", "lineage-check"],
)
def test_a_reader_refuses_a_config_naming_another_index(disagreeing, args, monkeypatch) -> None:
    ws, config = disagreeing
    monkeypatch.setattr("pipelines.commands.serve._server", lambda *a, **k: pytest.fail("serve listened"))
    result = CliRunner().invoke(app, [*args, "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    message = " ".join(result.output.split())
    assert f"index.uri is {OTHER} but this workspace's gallery is served from {ws.index_uri}" in message
    assert f"set index.uri to {ws.index_uri} (or leave it unset)" in message
    assert "Traceback" not in result.output


def test_status_with_the_served_index_configured_answers(disagreeing, tmp_path: Path) -> None:
    ws, _ = disagreeing

    def change(document: dict) -> None:
        document["workspace"] = str(ws.root)
        document["index"]["uri"] = ws.index_uri

    agreeing = write_local_config(tmp_path / "agreeing.yaml", change)
    result = CliRunner().invoke(app, ["status", "--config", str(agreeing)])
    assert result.exit_code == 1 and "index.uri is" not in result.output, result.output
    assert f"the serving record's index {ws.index_uri} does not exist" in result.output  # named, not opened
    Path(ws.index_uri).mkdir(parents=True)
    result = CliRunner().invoke(app, ["status", "--config", str(agreeing)])
    assert result.exit_code == 0 and "gallery     gallery_s_1" in result.output, result.output
