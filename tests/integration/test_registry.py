"""MLflow registry on a real sqlite store: runs, versions, aliases after pass / block / rollback."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from _registry import BLOCK, PASS, candidate, done, make_checkpoint
from safetensors.numpy import load_file

from compat.models.integrity import CheckpointIntegrityError, verify_checkpoint
from components.adapters.registry import (
    PromotionError,
    Registry,
    RegistryError,
    RollbackHookError,
    metric_key,
)
from components.state.rollout_document import RolloutState
from components.state.workspace import Workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("ws"))


def aliases(registry: Registry) -> dict[str, str | None]:
    return {a: registry.alias_version(a) for a in ("production", "candidate", "previous")}


def test_aliases_after_pass_block_and_rollback(workspace: Workspace, tmp_path: Path) -> None:
    registry = Registry(workspace, model_name="clip-cycle")
    assert aliases(registry) == {"production": None, "candidate": None, "previous": None}

    v1, files1 = candidate(registry, tmp_path, "run-1", 1, PASS, phase=0)
    assert aliases(registry) == {"production": None, "candidate": v1, "previous": None}
    registry.promote(rollout=None)  # the first production model
    assert aliases(registry) == {"production": v1, "candidate": v1, "previous": None}

    v2, files2 = candidate(registry, tmp_path, "run-2", 2, PASS, phase=1)
    with pytest.raises(PromotionError, match="rollout status is 'backfilling'"):
        registry.promote(rollout=RolloutState.model_construct(status="backfilling", new_version=v2))
    with pytest.raises(PromotionError, match="without a completed rollout"):
        registry.promote(v2, rollout=None)
    with pytest.raises(PromotionError, match=f"rollout is of version {v1}, not {v2}"):
        registry.promote(v2, rollout=done(v1))
    assert registry.alias_version("production") == v1
    registry.promote(v2, rollout=done(v2))
    assert aliases(registry) == {"production": v2, "candidate": v2, "previous": v1}

    v3, _ = candidate(registry, tmp_path, "run-3", 3, BLOCK, phase=2)
    with pytest.raises(PromotionError, match="gate decision is block.*ecc_margin"):
        registry.promote(rollout=done(v3))
    assert aliases(registry) == {"production": v2, "candidate": v3, "previous": v1}
    tags = registry.version_info(v3)["tags"]
    assert tags["gate.decision"] == "block" and "ecc_margin" in tags["gate.reasons"]
    assert tags["data_phase"] == "2" and tags["method"] == "bct"

    events: list[dict] = []
    result = registry.rollback(undo=[events.append])
    assert (result["from_version"], result["to_version"], result["previous_version"]) == (v2, v1, None)
    assert aliases(registry) == {"production": v1, "candidate": v3, "previous": None}
    assert events and events[0]["to_version"] == v1 and events[0]["workspace"] == str(workspace.root)
    assert "rolled_back_at" in registry.version_info(v2)["tags"]
    with pytest.raises(RegistryError, match="no previous version"):
        registry.rollback()

    # the production checkpoint comes back through models:/name@production, byte for byte
    local = registry.download("production", tmp_path / "dl")
    assert {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in local.iterdir() if p.name in files1
    } == files1
    assert load_file(str(local / "model.safetensors"))["visual.proj"].shape == (8, 4)
    assert files1 != files2


def test_repeated_rollbacks_walk_the_history(workspace: Workspace, tmp_path: Path) -> None:
    registry = Registry(workspace, model_name="clip-history")
    versions = []
    for i in range(3):
        version, _ = candidate(registry, tmp_path, f"hist-{i}", 10 + i, PASS, phase=i)
        registry.promote(version, rollout=done(version))
        versions.append(version)
    assert registry.status()["history"] == versions
    registry.rollback()
    assert aliases(registry)["production"] == versions[1] and aliases(registry)["previous"] == versions[0]
    registry.rollback()
    assert aliases(registry)["production"] == versions[0] and aliases(registry)["previous"] is None
    status = registry.status()
    assert status["production"]["tags"]["data_phase"] == "0" and status["history"] == versions[:1]


def test_a_failing_hook_moves_nothing_and_a_retry_completes(workspace: Workspace, tmp_path: Path) -> None:
    registry = Registry(workspace, model_name="clip-hook")
    for i in range(2):
        version, _ = candidate(registry, tmp_path, f"hook-{i}", 20 + i, PASS, phase=i)
        registry.promote(version, rollout=done(version))

    def broken(event: dict) -> None:
        raise ConnectionError("index alias unreachable")

    def refuses(event: dict) -> None:
        raise RuntimeError("the collection that served before is gone")

    before = aliases(registry)
    with pytest.raises(RegistryError, match="refused, nothing changed: .*refuses: .*served before is gone"):
        registry.rollback(prepare=[refuses], undo=[broken])
    assert aliases(registry) == before  # refused before any hook undid anything
    with pytest.raises(RollbackHookError, match="index alias unreachable.*run the rollback again") as err:
        registry.rollback(undo=[broken])
    assert aliases(registry) == before  # all or nothing
    assert (
        registry.rollback()["to_version"] == err.value.result["to_version"] == aliases(registry)["production"]
    )


def test_download_detects_tampering(workspace: Workspace, tmp_path: Path) -> None:
    registry = Registry(workspace, model_name="clip-tamper")
    version, _ = candidate(registry, tmp_path, "tamper", 30, PASS, phase=0)
    local = registry.download(version, tmp_path / "dl")
    verify_checkpoint(local)
    (local / "config.json").write_text("{}")
    with pytest.raises(CheckpointIntegrityError, match="config.json"):
        verify_checkpoint(local)
    # Swapped and consistently re-hashed (manifest rewritten): only the registered digest catches it.
    from compat.models.integrity import MANIFEST, file_manifest

    (local / MANIFEST).unlink()
    (local / MANIFEST).write_text(json.dumps(file_manifest(local), indent=2, sort_keys=True) + "\n")
    verify_checkpoint(local)
    with pytest.raises(CheckpointIntegrityError, match="digest registered with the model version"):
        registry.verify_copy(version, local)


def test_runs_resume_and_refuse_pickles(workspace: Workspace, tmp_path: Path) -> None:
    registry = Registry(workspace, model_name="clip-runs")
    first = registry.start_run("pipeline-7", params={"compat": {"method": "bct"}})
    registry.end_run(first)
    assert registry.start_run("pipeline-7") == first
    registry.log_metrics(first, {"t2i": {"new/old": {"R@1": 41.5}}}, step=3)
    history = registry.client.get_metric_history(first, metric_key("t2i.new/old.R@1"))
    assert [(m.value, m.step) for m in history] == [(41.5, 3)]
    with pytest.raises(RegistryError, match="cannot log parameters"):
        registry.log_params(first, {"compat": {"method": "taca"}})
    bad = tmp_path / "pickled"
    bad.mkdir()
    (bad / "model.pt").write_bytes(b"\x80\x04")
    with pytest.raises(RegistryError, match="safetensors"):
        registry.register_candidate(first, bad, data_phase=0, method="bct", gate=PASS)


def test_cli_status_and_rollback(workspace: Workspace, tmp_path: Path) -> None:
    registry = Registry(workspace, model_name="clip-cli")
    for i in range(2):
        version, _ = candidate(registry, tmp_path, f"cli-{i}", 40 + i, PASS, phase=i)
        registry.promote(version, rollout=done(version))
    gate_dir = workspace.run_dir("cli-1") / "gate"
    gate_dir.mkdir(parents=True)
    (gate_dir / "gate.json").write_text(json.dumps({**PASS, "decided_at": "2026-11-22T00:00:00+00:00"}))

    from typer.testing import CliRunner

    from pipelines.cli import app

    def cli(*args: str):  # in-process: the same commands, without re-importing MLflow per call
        result = CliRunner().invoke(
            app, [*args, "--workspace", str(workspace.root), "--model-name", "clip-cli"]
        )
        result.returncode = result.exit_code
        return result

    out = cli("status", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["registry"]["production"]["version"] == "2" and doc["registry"]["previous"]["version"] == "1"
    assert doc["last_gate"]["decision"] == "pass" and doc["last_gate"]["run_id"] == "cli-1"
    assert "rollout" in doc and doc["gallery"]["count"] == 0  # no gallery indexed in this workspace

    out = cli("rollback")
    assert out.returncode == 0, out.stderr
    assert "production 2 -> 1" in out.stdout
    assert registry.alias_version("production") == "1"
    text = cli("status")
    assert text.returncode == 0 and "production  v1" in text.stdout and "\nnext:" in text.stdout
    again = cli("rollback")
    assert again.returncode == 1 and "no previous version" in again.stderr
    assert "next: `compatflow status`" in again.stderr

    copy = registry.local_copy("1")  # the served copy, then tampered with: status says so and exits 1
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    tampered = cli("status")
    assert tampered.returncode == 1 and "checksum    FAILED" in tampered.stdout, tampered.output
    assert "checksum of production v1 FAILED" in tampered.stderr and "next:       delete" in tampered.stdout


def test_status_names_an_index_that_disagrees_with_the_registry() -> None:
    from pipelines.status import next_step, problems

    doc = {
        "registry": {"production": {"version": "2"}},
        "gallery": {"query_model_version": "1"},
        "rollout": {"status": "completed", "new_version": "2"},  # v2's rollout completed and was promoted
        "production_check": {"version": "2", "ok": True, "message": "ok"},
    }
    found = problems(doc)
    assert found == [
        "the index and the registry disagree: queries are served by v1 but production is v2, "
        "and no rollout is under way"
    ]
    assert "compatflow rollback" in next_step(doc, found)
    assert problems({**doc, "rollout": {"status": "running"}}) == []  # mid-rollout the record leads


def test_status_of_an_empty_workspace_creates_nothing(tmp_path: Path) -> None:
    from pipelines.status import collect

    doc = collect(tmp_path / "fresh")
    assert doc["registry"]["production"] is None and "no registry yet" in doc["registry"]["note"]
    assert doc["last_gate"] is None and doc["rollout"]["status"] == "none" and doc["gallery"]["count"] == 0
    assert not (tmp_path / "fresh").exists()


def test_register_run_logs_reports_metrics_and_weights(workspace: Workspace, tmp_path: Path) -> None:
    report = {"retrieval": {"t2i": {"new/old": {"R@1": 34.5}}}, "margins": {"t2i": {"R@1": {"margin": 4.5}}}}
    (tmp_path / "compat_report.json").write_text(json.dumps(report))
    metrics = {
        "curve": [{"step": 0, "loss": 4.1}, {"step": 10, "loss": 2.2}],
        "domains": {"street": {"t2i": {"R@1": 31.0}}},
    }
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "gate.json").write_text(json.dumps(PASS))
    make_checkpoint(tmp_path / "ckpt", 60)
    info = Registry(workspace, model_name="clip-stage").register_run(
        "stage-run",
        tmp_path / "ckpt",
        data_phase=2,
        method="taca",
        gate=tmp_path / "gate.json",
        compat_report=tmp_path / "compat_report.json",
        training_metrics=tmp_path / "metrics.json",
        reports=[tmp_path / "gate.json"],
        params={"compat": {"method": "taca"}},
    )
    client = Registry(workspace, model_name="clip-stage").client
    run = client.get_run(info["mlflow_run_id"])
    assert run.data.metrics[metric_key("retrieval.t2i.new/old.R@1")] == 34.5
    assert run.data.metrics[metric_key("phase.domains.street.t2i.R@1")] == 31.0
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train.loss")] == [
        (0, 4.1),
        (10, 2.2),
    ]
    assert run.data.params["compat.method"] == "taca"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "reports")}
    assert {"reports/compat_report.json", "reports/metrics.json", "reports/gate.json"} <= artifacts
    assert info["tags"]["gate.decision"] == "pass" and info["tags"]["method"] == "taca"
    assert info["aliases"] == ["candidate"]


def test_training_logged_as_it_runs_is_not_logged_again_at_registration(
    workspace: Workspace, tmp_path: Path
) -> None:
    registry = Registry(workspace, model_name="clip-live")
    run_id = registry.start_run("live-run")
    live = registry.step_logger(run_id, "train.", every=2)
    for step, loss in ((1, 4.0), (2, 3.5), (3, 3.1)):
        live({"step": step, "loss": loss, "lr": 1e-3, "kept": True})  # a bool is not a metric
    client = registry.client
    assert [m.step for m in client.get_metric_history(run_id, "train.loss")] == [1, 2]  # one batch of two
    live.flush()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train.loss")] == [
        (1, 4.0),
        (2, 3.5),
        (3, 3.1),
    ]
    assert not client.get_metric_history(run_id, "train.kept")
    (tmp_path / "metrics.json").write_text(json.dumps({"curve": [{"step": 3, "loss": 3.1}]}))
    make_checkpoint(tmp_path / "ckpt", 61)
    info = registry.register_run(
        "live-run",
        tmp_path / "ckpt",
        data_phase=0,
        method="bootstrap",
        training_metrics=tmp_path / "metrics.json",
    )
    assert info["mlflow_run_id"] == run_id
    assert len(client.get_metric_history(run_id, "train.loss")) == 3  # the curve was not logged twice


def test_a_resumed_run_registers_once(workspace: Workspace, tmp_path: Path) -> None:
    """Same pipeline run, same weights: the same version. Other weights: the unserved earlier version is
    deleted first, so an interrupted run leaves no orphan."""
    registry = Registry(workspace, model_name="clip-resume")
    v1, _ = candidate(registry, tmp_path / "a", "run-r", 1, PASS, phase=1)
    again, _ = candidate(registry, tmp_path / "b", "run-r", 1, PASS, phase=1)  # the same weights again
    assert again == v1
    copy = registry.download(v1, workspace.models_dir / f"v{v1}")  # the step's workspace copy
    changed, _ = candidate(registry, tmp_path / "c", "run-r", 2, PASS, phase=1)  # retrained: other weights
    assert changed != v1
    assert not copy.exists()  # the deleted version leaves no folder behind
    versions = registry.client.search_model_versions("name='clip-resume'")
    assert [str(v.version) for v in versions] == [changed]
    assert registry.alias_version("candidate") == changed


def test_plain_mlflow_on_a_copied_workspace_writes_into_the_copy(tmp_path: Path) -> None:
    """MLflow keeps absolute artifact URIs: once compatflow has opened a copied workspace's registry, the
    store names the copy's artifacts, so plain MLflow there logs into the copy and reads the copy's model
    files, and the original's folder does not change."""
    import shutil

    from mlflow import MlflowClient

    original = Registry(Workspace(tmp_path / "a"), model_name="clip-copied")
    version, _ = candidate(original, tmp_path, "copied", 40, PASS, phase=0)
    run_id = original.version_info(version)["run_id"]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    before = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())

    copy = Registry(Workspace(tmp_path / "b"), model_name="clip-copied")
    assert copy.alias_version("candidate") == version  # read without MLflow: nothing rewritten yet
    copy.client  # noqa: B018 - compatflow opens the copy's store
    plain = MlflowClient(tracking_uri=copy.tracking_uri, registry_uri=copy.tracking_uri)
    here = (tmp_path / "b" / "mlartifacts").as_uri()
    assert plain.get_run(run_id).info.artifact_uri.startswith(here + "/")
    assert plain.get_model_version("clip-copied", version).source.startswith(here + "/")
    note = tmp_path / "note.txt"
    note.write_text("logged on the copy")
    plain.log_artifact(run_id, str(note))
    assert list((tmp_path / "b" / "mlartifacts").rglob("note.txt"))
    after = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert after == before and not list((tmp_path / "a").rglob("note.txt"))
    assert copy.download(version, tmp_path / "dl")  # the copy's files, verified
    assert (
        Registry(Workspace(tmp_path / "a"), model_name="clip-copied")
        .client.get_run(run_id)
        .info.artifact_uri.startswith((tmp_path / "a" / "mlartifacts").as_uri() + "/")
    )
