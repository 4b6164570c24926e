"""The typed deployment: one model for every setting, its JSON schema generated from it, the same object
rebuilt from the JSON a KFP op receives, and every workspace location spelled by the Workspace alone."""

import json
import re
from pathlib import Path

import pytest

from components.deployment import ConfigError, Deployment
from components.state.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]


def test_every_default_lives_in_the_model_and_matches_the_local_config():
    from pipelines.config import load_config

    assert Deployment() == load_config("local")  # local.yaml spells out the defaults, nothing else


def test_a_kfp_op_rebuilds_the_same_object_from_its_json():
    from pipelines.config import load_config, resolve

    resolved = resolve(load_config("cluster", local_paths=False))
    assert Deployment.coerce(resolved.to_json()) == resolved
    assert json.loads(resolved.to_json())["training"]["model_config"] == "ViT-B-32"  # the YAML's name


def test_resolved_makes_every_service_explicit_through_the_workspace(tmp_path, monkeypatch):
    for name in ("COMPATFLOW_TRACKING_URI", "COMPATFLOW_MILVUS_URI", "COMPATFLOW_FEAST_REPO"):
        monkeypatch.delenv(name, raising=False)
    resolved = Deployment(workspace=str(tmp_path / "ws")).resolved()
    ws = Workspace.of(resolved)
    assert resolved.workspace == str(tmp_path / "ws")
    assert resolved.registry.tracking_uri == f"sqlite:///{ws.mlflow_store}"
    assert resolved.index.uri == str(ws.milvus_dir / "gallery.db")
    assert resolved.lineage.repo == str(tmp_path / "ws" / "feast")
    assert Path(resolved.gate.policy).name == "default_policy.yaml"
    # A pod's environment fills what the config leaves unset; a configured value wins over it.
    monkeypatch.setenv("COMPATFLOW_MILVUS_URI", "http://127.0.0.1:19530")
    assert Deployment(workspace=str(tmp_path / "ws")).resolved().index.uri == "http://127.0.0.1:19530"
    explicit = Deployment.coerce({"workspace": str(tmp_path / "ws"), "index": {"uri": "http://milvus:1"}})
    assert explicit.resolved().index.uri == "http://milvus:1"


def test_a_resolved_configs_derived_services_follow_a_changed_workspace(tmp_path, monkeypatch):
    """Resolve the shipped local config (its workspace relative to the current folder), then change only its
    workspace, as a dict or through with_changes: every URI derived from the workspace follows it; a
    service set apart from the workspace stays where it was."""
    from pipelines.config import load_config, resolve

    for name in ("COMPATFLOW_TRACKING_URI", "COMPATFLOW_MILVUS_URI", "COMPATFLOW_FEAST_REPO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    resolved = resolve(load_config("local"))
    assert resolved.resolved_for == resolved.workspace == str(tmp_path / "workspace")
    moved = Workspace(tmp_path / "ws")
    document = resolved.to_dict()
    document["workspace"] = str(tmp_path / "ws")
    for changed in (Deployment.coerce(document), resolved.with_changes(workspace=str(tmp_path / "ws"))):
        assert changed.registry.tracking_uri == moved.mlflow_uri == f"sqlite:///{moved.mlflow_store}"
        assert changed.index.uri == moved.index_uri and changed.lineage.repo == str(moved.feast_dir)
        assert changed.resolved_for == str(moved.root) and changed.resolved() == changed
        assert Workspace.of(changed).mlflow_uri == moved.mlflow_uri
    served = resolved.with_changes(index={"uri": "http://milvus:1"}).with_changes(workspace=str(moved.root))
    assert served.index.uri == "http://milvus:1" and served.registry.tracking_uri == moved.mlflow_uri
    # A URI the environment gave at resolve time is not the workspace's: it stays.
    monkeypatch.setenv("COMPATFLOW_TRACKING_URI", "http://mlflow:5000")
    from_env = resolve(load_config("local")).with_changes(workspace=str(moved.root))
    assert from_env.registry.tracking_uri == "http://mlflow:5000" and from_env.index.uri == moved.index_uri


def test_changes_are_checked_like_a_loaded_config():
    changed = Deployment().with_changes(training={"steps": 7})
    assert changed.training.steps == 7 and changed.training.batch_size == Deployment().training.batch_size
    with pytest.raises(ConfigError, match=r"training\.steps: Input should be greater than or equal to 1"):
        Deployment().with_changes(training={"steps": 0})
    with pytest.raises(ConfigError, match="a config is a YAML mapping"):
        Deployment.parse(["not", "a", "mapping"], source="x.yaml")


# Workspace-level names only components/state/ (the workspace and its run folders) may spell (the grep the
# layout promise rests on).
WORKSPACE_NAMES = re.compile(
    r"""["'/](rollout_state\.json|serving\.json|state\.json|mlflow\.db|gallery\.db|probe\.json|validated|"""
    r"""\.compatflow(\.steps)?\.lock|mlartifacts)["'/]|["']feast["']|["']services["']|/ ?["']models["']"""
)


def test_no_module_but_the_workspace_spells_a_workspace_location():
    offenders = []
    for package in ("components", "pipelines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.parent == ROOT / "components" / "state":  # the workspace and its run folders
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if WORKSPACE_NAMES.search(code) and not code.strip().startswith(('"""', "``")):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "ask components.state.workspace.Workspace instead:\n" + "\n".join(offenders)


def test_the_workspace_grep_sees_a_planted_path(tmp_path):
    assert WORKSPACE_NAMES.search('path = root / "serving.json"')
    assert WORKSPACE_NAMES.search("ws / 'feast'")
    assert not WORKSPACE_NAMES.search("path = ws.serving_path")


# The run folder's files: only components/state/run_dir.py spells their names (its constants) or joins a name
# onto a run folder; the others ask RunDir. Help texts and messages may name a file in prose.
def _run_file_names() -> list[str]:
    from components.state import run_dir, workspace

    return sorted(
        value
        for name, value in vars(run_dir).items()
        if name.isupper() and isinstance(value, str) and "." in value and name not in vars(workspace)
    )


RUN_FILE_PATH = re.compile(r"(^|/)(" + "|".join(map(re.escape, _run_file_names())) + r")$")


def _run_dir_spellings(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal of code (not a docstring) that is a run file's name or a path
    ending in one, and of each ``run_dir / "<name>"`` (``Path(run_dir) / ...`` too)."""
    import ast

    tree = ast.parse(source)
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if RUN_FILE_PATH.search(node.value):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left = node.left.args[0] if isinstance(node.left, ast.Call) and node.left.args else node.left
            if (
                isinstance(left, ast.Name)
                and left.id == "run_dir"
                and isinstance(node.right, ast.Constant | ast.JoinedStr)
            ):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_module_but_the_run_dir_spells_a_run_file():
    offenders = []
    for package in ("components", "pipelines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative == "components/state/run_dir.py":
                continue
            offenders += [f"{relative}:{n}: {text}" for n, text in _run_dir_spellings(path.read_text())]
    assert not offenders, "ask components.state.run_dir.RunDir (or its constants) instead:\n" + "\n".join(
        offenders
    )


def test_the_run_dir_grep_sees_a_planted_spelling():
    assert {"gate.json", "run.json", "pipeline.log", "drift_report.html"} <= set(_run_file_names())
    planted = '''
def f(run_dir, out):
    """Reads ``gate.json`` (prose in a docstring is fine)."""
    a = run_dir / "gate" / GATE_FILE
    b = Path(run_dir) / "usage"
    c = out / "metrics.json"
    d = runs.glob(f"*/**/outcome.json")
    e = run.gate_file
    f = "see gate.json for why"
'''
    assert [line for line, _ in _run_dir_spellings(planted)] == [4, 5, 6, 7]
