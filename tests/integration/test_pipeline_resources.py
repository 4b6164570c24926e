"""Task-level Kubernetes settings of the compiled pipeline (pipelines/resources.py).

Pipelines built from the real components of ``components.kfp_ops`` are compiled to IR YAML and
the YAML is read back: container resources and accelerators in ``deploymentSpec``, retry and
caching in the DAG tasks, node selectors, tolerations, volumes, ConfigMaps and Secrets in the
``platforms.kubernetes`` platform spec. No ``from __future__ import annotations``: KFP reads
the pipeline functions' annotations at runtime.
"""

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kfp import compiler, dsl

from components import kfp_ops
from components.deployment import Deployment
from pipelines import resources
from pipelines.config import ConfigError

GPU = "nvidia.com/gpu"
POOL = {"example.com/accelerator": "a100"}
TAINT = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
IMAGE = "registry.example.com/compatflow-cuda:9.9.9"
CPU_IMAGE = "registry.example.com:5000/team/compatflow-cpu:9.9.9@sha256:" + "0" * 64


def shipped(name: str) -> dict[str, Any]:
    """A shipped config with every setting it leaves out at its default, as a run reads it."""
    from pipelines.config import load_config

    return load_config(name, local_paths=False).to_dict()


def gpu_pool_config() -> dict[str, Any]:
    """The local config's values on a cluster: a GPU pool (2 GPUs per task), a volume, a Feast repo."""
    config = shipped("local")
    config["name"] = "gpu-pool-test"
    config["workspace"] = "/mnt/ws"
    config["lineage"]["repo"] = "/etc/feast-repo"
    config["resources"] = {
        "cpu": {"cpu": "3", "memory": "5Gi", "image": CPU_IMAGE},
        "gpu": {
            "cpu": "7",
            "memory": "30Gi",
            "image": IMAGE,
            "accelerator": GPU,
            "accelerator_count": 2,
            "node_selector": dict(POOL),
            "tolerations": [
                dict(TAINT),
                {
                    "key": "spot",
                    "operator": "Equal",
                    "value": "true",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
            ],
        },
    }
    config["rollout"]["workers"] = 2  # backfill stages fanned out: every op of the pipeline is compiled
    return config


# --------------------------------------------------------------------------------------------
# Reading the compiled YAML


def load_compiled(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pipeline spec and the Kubernetes executors of the platform spec ({} if none)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    spec = docs[0]
    platform = docs[1] if len(docs) > 1 else {}
    executors = (
        platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
    )
    return spec, executors


def op_name(component_ref: str) -> str:
    """``comp-note-blocked-op-2`` -> ``note_blocked_op``."""
    match = re.fullmatch(r"comp-(.+?)(?:-\d+)?", component_ref)
    assert match, component_ref
    return match.group(1).replace("-", "_")


def compiled_tasks(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container task in every DAG (root, conditions, exit handler) with what configure set."""
    components = spec["components"]
    dags = [spec["root"]["dag"]] + [c["dag"] for c in components.values() if "dag" in c]
    out = []
    for dag in dags:
        for name, task in dag["tasks"].items():
            ref = task["componentRef"]["name"]
            label = components[ref].get("executorLabel")
            if label is None:
                continue
            container = spec["deploymentSpec"]["executors"][label]["container"]
            out.append(
                {
                    "task": name,
                    "op": op_name(ref),
                    "executor": label,
                    "container": container,
                    "resources": container.get("resources", {}),
                    "retry": task.get("retryPolicy"),
                    "cache": task.get("cachingOptions", {}).get("enableCache", False),
                }
            )
    return out


def check_task_settings(path: Path, config: dict[str, Any], *, runner: str = "kubernetes") -> set[str]:
    """Assert every configured task carries exactly its stage's settings; returns the ops seen."""
    spec, executors = load_compiled(path)
    tasks = compiled_tasks(spec)
    assert tasks
    res = config["resources"]
    gpu_pool = bool(res["gpu"]["accelerator"])
    for t in tasks:
        where = f"{t['task']} ({t['op']})"
        kind = resources.STEP_KINDS[t["op"]]
        want = res[kind]
        r = t["resources"]
        for field in ("resourceCpuRequest", "resourceCpuLimit"):
            assert r.get(field) == want["cpu"], f"{where}: {field}"
        for field in ("resourceMemoryRequest", "resourceMemoryLimit"):
            assert r.get(field) == want["memory"], f"{where}: {field}"
        k8s = executors.get(t["executor"], {})
        assert t["container"]["image"] == want["image"], f"{where}: image is not resources.{kind}.image"
        if kind == "gpu" and gpu_pool:
            assert r["accelerator"]["resourceType"] == GPU, where
            assert r["accelerator"]["resourceCount"] == str(res["gpu"]["accelerator_count"]), where
            assert k8s.get("nodeSelector", {}).get("labels") == res["gpu"]["node_selector"], where
            # protobuf's JSON form writes int64 tolerationSeconds as a string
            tolerations = [
                {k: int(v) if k == "tolerationSeconds" else v for k, v in tol.items()}
                for tol in k8s.get("tolerations", [])
            ]
            given = [{k: v for k, v in t.items() if v is not None} for t in res["gpu"]["tolerations"]]
            assert tolerations == given, where
        else:
            assert "accelerator" not in r, (
                f"{where}: a CPU stage (or a config without a GPU pool) asks for GPUs"
            )
            assert not k8s.get("nodeSelector") and not k8s.get("tolerations"), where
        shm = [m for m in k8s.get("emptyDirMounts", []) if m["mountPath"] == "/dev/shm"]
        assert (shm == [{"medium": "Memory", "mountPath": "/dev/shm", "volumeName": "dshm"}]) == (
            kind == "gpu"
        ), where
        if t["op"] in resources.RETRYABLE and runner == "kubernetes":
            assert t["retry"] == {
                "maxRetryCount": 2,
                "backoffDuration": "60s",
                "backoffFactor": 2.0,
                "backoffMaxDuration": "3600s",
            }, where
        else:
            assert t["retry"] is None, f"{where}: retried although {t['op']} is not retry-safe here"
        assert t["cache"] is (t["op"] in resources.CACHEABLE), f"{where}: caching"
        check_cluster_wiring(k8s, config, where)
    return {t["op"] for t in tasks}


def check_cluster_wiring(k8s: dict[str, Any], config: dict[str, Any], where: str) -> None:
    env_maps = {
        (e["configMapName"], e["optional"]): [k["configMapKey"] for k in e["keyToEnv"]]
        for e in k8s["configMapAsEnv"]
    }
    assert env_maps == {
        ("compatflow-pipeline-config", False): list(resources.CONFIG_MAP_ENV),
        ("compatflow-pipeline-config", True): ["AWS_ENDPOINT_URL_S3", "COMPATFLOW_KFP_UI_URL"],
    }, where
    assert {"COMPATFLOW_WORKSPACE", "COMPATFLOW_TRACKING_URI"} <= set(resources.CONFIG_MAP_ENV)
    secrets = {
        (s["secretName"], s["optional"]): {k["secretKey"]: k["envVar"] for k in s["keyToEnv"]}
        for s in k8s["secretAsEnv"]
    }
    assert secrets[("compatflow-milvus", False)] == {"token": "COMPATFLOW_MILVUS_TOKEN"}, where
    assert set(secrets[("compatflow-object-store", True)]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert k8s["imagePullPolicy"] == "IfNotPresent", where
    workspace = config["workspace"]
    pvcs = [(p["constant"], p["mountPath"]) for p in k8s.get("pvcMount", [])]
    assert pvcs == ([("compatflow-workspace", workspace)] if workspace.startswith("/") else []), where
    repo = config["lineage"]["repo"]
    volumes = [(v["configMapName"], v["mountPath"]) for v in k8s.get("configMapAsVolume", [])]
    assert volumes == ([("compatflow-feast-repo", repo)] if repo and repo.startswith("/") else []), where


# --------------------------------------------------------------------------------------------
# A pipeline of the real components with every stage kind


def compile_stages(tmp_path: Path, settings: dict[str, Any], name: str = "stages.yaml") -> Path:
    """The real pipeline built under ``settings`` (every task goes through ``resources.configure``)."""
    from pipelines.compile import build_pipeline

    path = tmp_path / name
    compiler.Compiler().compile(build_pipeline(settings), str(path))
    return path


def test_every_component_is_classified_and_the_choices_hold() -> None:
    ops = {n for n, v in vars(kfp_ops).items() if hasattr(v, "component_spec") and n.endswith("_op")}
    assert set(resources.STEP_KINDS) == ops, "classify every component of components.kfp_ops"
    assert set(resources.STEP_KINDS.values()) <= {"cpu", "gpu"}
    assert {op for op, kind in resources.STEP_KINDS.items() if kind == "gpu"} == {
        "continual_op",
        "compat_op",
        "evaluate_op",
        "serve_first_model_op",  # embeds the whole gallery
        "ingest_op",  # embeds a phase's new items
        "rollout_op",  # re-embeds it
        "rollout_range_op",  # re-embeds one rank range of it
    }
    assert resources.RETRYABLE <= set(ops) and resources.CACHEABLE <= set(ops)
    assert "register_op" not in resources.RETRYABLE  # each call creates a model version
    state_readers = {
        "plan_op",
        "resolve_production_op",
        "gate_op",
        "register_op",
        "serve_first_model_op",
        "ingest_op",
        "rollout_op",
        "rollout_ranges_op",
        "rollout_range_op",
        "note_blocked_op",
        "finish_op",
    }
    assert not resources.CACHEABLE & state_readers
    assert resources.CACHEABLE <= resources.RETRYABLE  # a pure function of its inputs is also safe to rerun


def test_gpu_pool_config_sets_gpu_and_pool_only_on_gpu_stages(tmp_path: Path) -> None:
    config = gpu_pool_config()
    path = compile_stages(tmp_path, resources.compile_settings(config))
    assert check_task_settings(path, config) == set(resources.STEP_KINDS)


def test_shipped_cluster_config_requests_its_gpu_pool(tmp_path: Path) -> None:
    config = shipped("cluster")
    path = compile_stages(tmp_path, resources.compile_settings("cluster"))
    check_task_settings(path, config)
    spec, executors = load_compiled(path)
    gpu_tasks = [t for t in compiled_tasks(spec) if resources.STEP_KINDS[t["op"]] == "gpu"]
    stages = len(resources.compile_settings("cluster")["config"].rollout.fractions)
    assert len(gpu_tasks) == 6 + stages and all(  # the six GPU steps and one rank-range task per stage
        t["resources"]["accelerator"]["resourceType"] == GPU for t in gpu_tasks
    )


def test_every_executor_of_the_committed_pipeline_runs_an_image_of_the_config() -> None:
    """The compiled YAML a cluster runs: each executor's image is the config's image of its op's kind
    (``resources.cpu.image`` / ``resources.gpu.image``), registry-qualified; no other image appears."""
    import yaml

    from components.deployment import qualified_image
    from pipelines.compile import COMPILED_DIR, COMPILED_NAME

    config = shipped("cluster")
    spec = next(yaml.safe_load_all((COMPILED_DIR / COMPILED_NAME).read_text()))
    executors = spec["deploymentSpec"]["executors"]
    images = {label: e["container"]["image"] for label, e in executors.items()}
    for task in compiled_tasks(spec):
        kind = resources.STEP_KINDS[task["op"]]
        assert images[task["executor"]] == config["resources"][kind]["image"], task["task"]
    assert set(images.values()) <= {config["resources"]["cpu"]["image"], config["resources"]["gpu"]["image"]}
    assert all(qualified_image(image) for image in images.values())
    assert len(images) == len({t["executor"] for t in compiled_tasks(spec)})  # every executor is a task's


def test_a_local_build_carries_only_what_kfp_local_acts_on(tmp_path: Path) -> None:
    """Caching per step; no retries, resources or platform spec (kfp.local ignores them), even
    when the config names a GPU pool."""
    path = compile_stages(tmp_path, resources.compile_settings(gpu_pool_config(), runner="local"))
    spec, _ = load_compiled(path)
    tasks = compiled_tasks(spec)
    assert {t["op"] for t in tasks} >= {"plan_op", "continual_op", "rollout_op", "finish_op"}
    for t in tasks:
        assert t["cache"] is (t["op"] in resources.CACHEABLE), t["task"]
        assert t["retry"] is None and not t["resources"], t["task"]
    text = path.read_text()
    for absent in ("platforms", "accelerator", "nodeSelector", "configMapAsEnv", "retryPolicy"):
        assert absent not in text, f"a local build carries {absent}"


def test_the_checks_catch_a_misconfigured_task(tmp_path: Path) -> None:
    config = gpu_pool_config()
    wrong = resources.compile_settings(config)
    wrong["gpu"] = dict(wrong["gpu"], node_selector={})  # the GPU pool's selector lost
    with pytest.raises(AssertionError, match=r"\((continual|compat|evaluate|rollout|rollout_range)_op\)"):
        check_task_settings(compile_stages(tmp_path, wrong, "a.yaml"), config)
    saved = set(resources.CACHEABLE)
    try:
        resources.CACHEABLE.add("plan_op")  # a state-reading stage cached
        path = compile_stages(tmp_path, resources.compile_settings(config), "b.yaml")
    finally:
        resources.CACHEABLE.clear()
        resources.CACHEABLE.update(saved)
    with pytest.raises(AssertionError, match="plan-op.*caching"):
        check_task_settings(path, config)


def test_configure_refuses_an_unclassified_op() -> None:
    settings = resources.compile_settings("local")

    @dsl.component(base_image="python:3.11")
    def reindex_op() -> None:
        pass

    with pytest.raises(ValueError, match="reindex_op.*STEP_KINDS"):

        @dsl.pipeline(name="unclassified")
        def pipeline() -> None:
            resources.configure(reindex_op(), "reindex_op", settings)


# --------------------------------------------------------------------------------------------
# Where the settings come from


def test_compile_settings_sources(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(resources.COMPILE_CONFIG_ENV, raising=False)
    assert resources.compile_settings()["name"] == "cluster"
    assert resources.compile_settings()["retry"] == resources.RETRY_POLICY
    monkeypatch.setenv(resources.COMPILE_CONFIG_ENV, "local")
    local = resources.compile_settings()
    assert local["name"] == "local" and local["gpu"]["accelerator"] == ""
    assert local["workspace_mount"] is None and local["feast_mount"] is None
    custom = tmp_path / "pool.yaml"
    custom.write_text(yaml.safe_dump(gpu_pool_config()))
    monkeypatch.setenv(resources.COMPILE_CONFIG_ENV, str(custom))
    settings = resources.compile_settings()
    assert (settings["name"], settings["gpu"]["accelerator_count"]) == ("gpu-pool-test", 2)
    assert (settings["workspace_mount"], settings["feast_mount"]) == ("/mnt/ws", "/etc/feast-repo")
    with resources.using(local):
        assert resources.compile_settings() is local
        assert resources.compile_settings("cluster")["name"] == "cluster"  # an explicit config wins
    assert resources.compile_settings()["name"] == "gpu-pool-test"
    assert resources.compile_settings("cluster", runner="local")["retry"] is None
    with pytest.raises(ValueError, match="runner"):
        resources.compile_settings("cluster", runner="argo")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["resources"]["gpu"].update(accelerator_count=0), "accelerator_count must be at least 1"),
        (
            lambda c: c["resources"]["gpu"]["tolerations"].append(
                {"key": "x", "effect": "NoSchedule", "toleration_seconds": 5}
            ),
            r"tolerations\.2\.toleration_seconds: is not a setting of this section",
        ),
        (lambda c: c["resources"]["gpu"].update(accelerator_count="1"), "accelerator_count"),
        (lambda c: c["resources"]["cpu"].update(image=""), r"resources\.cpu\.image"),
        (lambda c: c["resources"]["gpu"].update(image="compatflow-cuda:0.1.0"), "registry-qualified"),
        (lambda c: c["resources"]["cpu"].update(image="ghcr.io/compatflow/compatflow-cpu"), "TAG"),
    ],
)
def test_bad_resource_settings_fail_with_the_field(change, message: str) -> None:
    config = gpu_pool_config()
    change(config)
    with pytest.raises(ConfigError, match=message):
        resources.compile_settings(config)


def test_missing_compile_config_names_the_choices(monkeypatch) -> None:
    monkeypatch.setenv(resources.COMPILE_CONFIG_ENV, "no-such-config")
    with pytest.raises(ConfigError, match="no-such-config.*cluster"):
        resources.compile_settings()


# --------------------------------------------------------------------------------------------
# The local runner


@pytest.mark.filterwarnings(
    "ignore:You may be attemping to run a task that uses custom or non-Python base image"
)
def test_configured_tasks_run_under_kfp_local(tmp_path: Path) -> None:
    """kfp.local runs a task configured for the cluster's GPU pool (resources, platform spec ignored: what
    the rehearsal relies on) and returns an already executed task from configure unchanged."""
    import json
    import warnings

    from kfp import local

    settings = resources.compile_settings(gpu_pool_config())

    @dsl.pipeline(name="local-settings")
    def pipeline(run_dir: str) -> None:
        resources.configure(
            kfp_ops.note_blocked_op(run_dir=run_dir, step="gate", reason="cluster settings"),
            "note_blocked_op",
            settings,
        )

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "root"),
        raise_on_error=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline(run_dir=str(tmp_path / "run"))
    blocked = json.loads((tmp_path / "run" / "blocked.json").read_text())
    assert blocked == {"step": "gate", "reason": "cluster settings"}
    assert any("no effect in the current local runner" in str(w.message) for w in caught)

    task = kfp_ops.note_blocked_op(run_dir=str(tmp_path / "direct"), step="validate", reason="direct")
    assert resources.configure(task, "note_blocked_op", resources.compile_settings(gpu_pool_config())) is task
    assert (tmp_path / "direct" / "blocked.json").is_file()


# --------------------------------------------------------------------------------------------
# The full pipeline and the CLI


def test_full_pipeline_carries_the_stage_settings(tmp_path: Path) -> None:
    from pipelines.compile import compile_pipeline, default_run_config

    config = gpu_pool_config()
    path = compile_pipeline(tmp_path, config=config)
    spec, executors = load_compiled(path)
    default = spec["root"]["inputDefinitions"]["parameters"]["config"]["defaultValue"]
    assert default == default_run_config(Deployment.coerce(config))
    ops = check_task_settings(path, config)
    assert ops == set(resources.STEP_KINDS), f"stages without settings: {set(resources.STEP_KINDS) - ops}"


def test_default_run_config_is_portable() -> None:
    import json

    from pipelines.compile import default_run_config

    cluster = json.loads(default_run_config(Deployment.coerce(shipped("cluster"))))
    assert cluster["gate"]["policy"] is None  # the image's own shipped policy, not this machine's path
    assert cluster["workspace"] == "/mnt/compatflow" and cluster["stream"]["uri"].startswith("s3://")
    chosen = shipped("cluster")
    chosen["gate"]["policy"] = "/etc/compatflow/gate.yaml"
    chosen_json = default_run_config(Deployment.coerce(chosen))
    assert json.loads(chosen_json)["gate"]["policy"] == "/etc/compatflow/gate.yaml"


def test_compile_command_takes_a_config(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from pipelines.cli import app

    monkeypatch.delenv(resources.COMPILE_CONFIG_ENV, raising=False)
    runner = CliRunner()
    result = runner.invoke(app, ["compile", "--out", str(tmp_path / "local"), "--config", "local"])
    assert result.exit_code == 0, result.output
    spec, _ = load_compiled(tmp_path / "local" / "continual_upgrade.yaml")
    assert '"name": "local"' in spec["root"]["inputDefinitions"]["parameters"]["config"]["defaultValue"]
    result = runner.invoke(
        app, ["compile", "--out", str(tmp_path / "x"), "--config", str(tmp_path / "none.yaml")]
    )
    assert result.exit_code == 2 and "none.yaml" in result.output
    bad = copy.deepcopy(gpu_pool_config())
    bad["resources"]["gpu"]["accelerator_count"] = 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    result = runner.invoke(
        app, ["compile", "--out", str(tmp_path / "y"), "--config", str(tmp_path / "bad.yaml")]
    )
    assert result.exit_code == 2 and "accelerator_count" in result.output
    assert not (tmp_path / "y").exists()


# --------------------------------------------------------------------------------------------
# torchrun


def test_the_documented_torchrun_line_trains_every_rank_with_the_deployments_section(monkeypatch) -> None:
    """manifests/README.md's command for a run outside the pipeline: torchrun parses it, the training command
    takes its options, and the settings are the config's training section, the options given overriding."""
    import typer.main
    from torch.distributed.run import get_args_parser

    from components.deployment import TrainingSection
    from components.training.continual import TrainingSettings
    from pipelines.cli import app
    from pipelines.commands.train import _training_section, settings_given
    from pipelines.config import CONFIG_DIR

    for key in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_STANDALONE"):
        monkeypatch.delenv(key, raising=False)
    readme = (Path(__file__).resolve().parents[2] / "manifests" / "README.md").read_text()
    line = re.search(r"torchrun --standalone .*? compatflow train continual \\\n(.*)\n", readme)
    assert line, "manifests/README.md no longer shows the torchrun line"
    documented = line.group(0).replace("\\\n", " ")
    config = CONFIG_DIR / "cluster.yaml"
    placeholders = {"N": "4", "CONFIG": config, "STREAM": "/mnt/stream", "P": "3", "RUN_DIR": "/mnt/runs/r"}
    for name, value in placeholders.items():
        documented = re.sub(rf"={name}\b", f"={value}", documented)
    command = documented.split() + ["--seed=23"]
    args = get_args_parser().parse_args(command[1:])
    assert (args.standalone, args.nnodes, args.nproc_per_node, args.no_python) == (True, "1", "4", True)
    assert [args.training_script, *args.training_script_args][:3] == ["compatflow", "train", "continual"]

    train = typer.main.get_command(app).commands["train"].commands["continual"]
    params = train.make_context("continual", list(args.training_script_args[2:])).params
    assert (str(params["stream"]), params["phase"], str(params["out"])) == (
        "/mnt/stream",
        3,
        "/mnt/runs/r/continual",
    )
    section = TrainingSection.model_validate(shipped("cluster")["training"])
    from_command = TrainingSettings.from_section(
        _training_section(params["deployment"]), **settings_given(params)
    )
    weights = f"{shipped('cluster')['workspace']}/weights"  # the deployment's workspace's weights folder
    assert from_command == TrainingSettings.from_section(section, seed=23, weights_dir=weights)


def test_the_committed_pipeline_fans_each_backfill_stage_out_over_gpu_tasks() -> None:
    """rollout.workers 8 in the cluster config: one ParallelFor per backfill stage, parallelism 8, over
    rollout-range tasks with the GPU pool's accelerator, each loop's ranges from a rollout-ranges task that
    collects the previous loop's (the fan-in), and rollout-op after the last."""
    from pipelines.compile import COMPILED_DIR, COMPILED_NAME

    config = shipped("cluster")
    spec = next(yaml.safe_load_all((COMPILED_DIR / COMPILED_NAME).read_text()))
    loops = {
        name: task
        for comp in spec["components"].values()
        for name, task in comp.get("dag", {}).get("tasks", {}).items()
        if name.startswith("for-loop") and task["taskInfo"]["name"].startswith("backfill-stage-")
    }
    stages = sorted(task["taskInfo"]["name"] for task in loops.values())
    assert stages == [
        f"backfill-stage-{j}" for j in range(1, len(config["rollout"].get("fractions", [1] * 4)) + 1)
    ]
    assert {t["iteratorPolicy"]["parallelismLimit"] for t in loops.values()} == {config["rollout"]["workers"]}
    ranged = [t for t in compiled_tasks(spec) if t["op"] == "rollout_range_op"]
    assert len(ranged) == len(stages)
    assert all(t["resources"]["accelerator"]["resourceType"] == GPU for t in ranged)
    collecting = [t for t in compiled_tasks(spec) if t["op"] == "rollout_ranges_op"]
    assert len(collecting) == len(stages) + 1
