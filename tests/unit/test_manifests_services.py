"""The training job, the schedule and the services agree with the pipeline and the tools themselves: torchrun
under the operator's environment, compiled task settings, ``mlflow server`` and ``feast serve`` options,
Feast's loader on the cluster ``feature_store.yaml``, the Milvus Helm values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from _manifests import (
    GPU,
    K8S,
    NAMESPACE,
    OVERLAYS,
    PIPELINE_RUNNER,
    ROOT,
    _cluster_config,
    compiled_executors,
    configmap_data,
    container_env,
    expand,
    load_docs,
    rel,
    task_setting_violations,
    the,
    the_container,
)

from pipelines.compile import COMPILED_DIR, COMPILED_NAME


def test_training_job_replicas_share_one_pod_template_and_gpu_count(rendered) -> None:
    for overlay, docs in rendered.items():
        job = the(docs, "PyTorchJob", "compatflow-train")
        master, worker = (job["spec"]["pytorchReplicaSpecs"][r]["template"] for r in ("Master", "Worker"))
        assert master == worker, f"{overlay}: Master and Worker pod templates drifted apart"
        gpus = master["spec"]["containers"][0]["resources"]["limits"][GPU]
        assert job["spec"]["nprocPerNode"] == str(gpus), f"{overlay}: one torchrun process per GPU"
        assert job["spec"]["runPolicy"]["suspend"] is True, "applying the stack must not start training"
        ports = master["spec"]["containers"][0]["ports"]
        assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in ports


def test_torchrun_takes_its_topology_from_the_operator_environment(monkeypatch) -> None:
    from torch.distributed.run import get_args_parser

    job = load_docs(K8S / "training" / "pytorchjob.yaml")[0]
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    # What the training operator injects into replica 2 of a 4-node job with nprocPerNode 8.
    env = {
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "8",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "compatflow-train-master-0",
        "PET_MASTER_PORT": "23456",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = get_args_parser().parse_args(container["args"])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("4", "8", 2)
    assert (args.master_addr, args.master_port, args.no_python) == ("compatflow-train-master-0", 23456, True)
    assert [args.training_script, *args.training_script_args][:3] == ["compatflow", "train", "continual"]


def training_container(docs: list[dict[str, Any]], replica: str = "Master") -> dict[str, Any]:
    job = the(docs, "PyTorchJob", "compatflow-train")
    return job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_training_command_parses_as_the_compatflow_command(rendered, overlay: str) -> None:
    import typer.main

    from pipelines.cli import app

    cli = typer.main.get_command(app)
    assert "train" in cli.commands, "the training container runs `compatflow train`"
    docs = rendered[overlay]
    container = training_container(docs)
    env = container_env(container, configmap_data(docs))
    args = [expand(a, env) for a in container["args"]]
    assert args[:2] == ["--no-python", "compatflow"]
    group = cli.commands[args[2]]
    assert args[3] in getattr(group, "commands", {}), f"no `compatflow {args[2]} {args[3]}`"
    context = group.commands[args[3]].make_context(args[3], args[4:])  # unknown/missing/invalid options raise
    assert str(context.params["deployment"]) == env["COMPATFLOW_CONFIG"]  # every training setting from it
    assert str(context.params["out"]).startswith(env["COMPATFLOW_WORKSPACE"] + "/")


def test_cluster_overlay_matches_the_cluster_pipeline_config(rendered) -> None:
    path = ROOT / "pipelines" / "configs" / "cluster.yaml"
    config = _cluster_config()
    docs = rendered["cluster"]
    data = the(docs, "ConfigMap", "compatflow-pipeline-config")["data"]
    assert Path(data["COMPATFLOW_CONFIG"]).name == path.name
    expected = {
        "COMPATFLOW_WORKSPACE": config["workspace"],
        "COMPATFLOW_TRACKING_URI": config["registry"]["tracking_uri"],
        "COMPATFLOW_MILVUS_URI": config["index"]["uri"],
        "COMPATFLOW_STREAM_URI": config["stream"]["uri"],
        "COMPATFLOW_FEAST_REPO": config["lineage"]["repo"],
    }
    mismatches = {k: f"manifests {data[k]} != cluster.yaml {v}" for k, v in expected.items() if data[k] != v}
    assert not mismatches, mismatches

    job = the(docs, "PyTorchJob", "compatflow-train")
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    assert claims[mounts[config["workspace"]]] == "compatflow-workspace"
    feast = the(docs, "Deployment", "feast")["spec"]["template"]["spec"]
    repo_mount = {m["mountPath"]: m["name"] for m in feast["containers"][0]["volumeMounts"]}
    assert config["lineage"]["repo"] in repo_mount

    args = dict(a.split("=", 1) for a in pod["containers"][0]["args"] if a.startswith("--") and "=" in a)
    assert args["--deployment"] == "$(COMPATFLOW_CONFIG)"  # the job trains as the pipeline's step would
    assert not {"--config", "--method", "--steps", "--batch-size"} & args.keys()  # no second copy to drift
    gpu = config["resources"]["gpu"]
    assert gpu["accelerator"] == GPU
    assert gpu["node_selector"].items() <= pod["nodeSelector"].items()
    tolerations = [{k: v for k, v in t.items() if v is not None} for t in gpu["tolerations"]]
    assert all(t in pod["tolerations"] for t in tolerations)
    assert pod["containers"][0]["image"] == config["resources"]["gpu"]["image"]


def test_committed_pipeline_task_settings_reference_the_manifests(rendered) -> None:
    package = COMPILED_DIR / COMPILED_NAME
    assert package.is_file(), f"{package} is missing: run `compatflow compile`"
    executors = compiled_executors(package)
    assert any(k8s for _, _, k8s in executors), "the committed pipeline carries no task settings"
    config = _cluster_config()
    violations = task_setting_violations(executors, rendered["cluster"], config)
    assert not violations, "\n".join(violations)


def test_schedule_runs_as_the_manifests_runner_weekly_one_at_a_time(rendered, tmp_path: Path) -> None:
    """What ``compatflow pipeline schedule`` sends by default names the manifests' objects and takes the
    committed package's parameters (its images pinned by digest, as a cluster's package must be)."""
    from _pipelines import pinned_package

    from pipelines import submit

    assert submit.SERVICE_ACCOUNT == PIPELINE_RUNNER and submit.NAMESPACE == NAMESPACE
    for docs in rendered.values():
        assert the(docs, "RoleBinding", PIPELINE_RUNNER)["subjects"][0]["name"] == submit.SERVICE_ACCOUNT
    package = submit.load_package(pinned_package(tmp_path))
    job = submit.Job(package, submit.SCHEDULE_NAME, {}, cron=submit.WEEKLY)
    body = submit.plan("http://kfp:8888", job)["requests"][-1]["body"]
    assert body["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * 1"  # Mondays 03:00, KFP's seconds first
    assert (body["max_concurrency"], body["no_catchup"]) == (1, True)
    assert body["runtime_config"]["parameters"].keys() <= package.parameters.keys()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_uris_point_at_the_services(rendered, overlay: str) -> None:
    docs = rendered[overlay]
    config = the(docs, "ConfigMap", "compatflow-pipeline-config")["data"]
    assert config["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert config["COMPATFLOW_FEAST_REGISTRY_PATH"].startswith("s3://")
    for key, service in (("MLFLOW_TRACKING_URI", "mlflow"), ("COMPATFLOW_FEAST_SERVER_URL", "feast")):
        port = the(docs, "Service", service)["spec"]["ports"][0]["port"]
        assert config[key] == f"http://{service}.{NAMESPACE}.svc.cluster.local:{port}"
    assert config["COMPATFLOW_TRACKING_URI"] == config["MLFLOW_TRACKING_URI"]
    hosts = config["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert config["MLFLOW_TRACKING_URI"].removeprefix("http://") in hosts


def helm_target(path: Path) -> tuple[str, str]:
    match = re.search(r"helm upgrade --install (\S+) zilliztech/milvus --namespace (\S+)", path.read_text())
    assert match, f"{rel(path)}: the header must show the helm install command"
    return match.group(1), match.group(2)


def credential_values(node: Any, trail: str = "") -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{trail}.{key}" if trail else str(key)
            if (
                isinstance(value, str)
                and value
                and re.search(r"(secret|access)key|password|token", key, re.I)
            ):
                found.append(here)
            found += credential_values(value, here)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found += credential_values(item, f"{trail}[{i}]")
    return found


@pytest.mark.parametrize("variant", ["standalone", "cluster"])
def test_milvus_values(rendered, variant: str) -> None:
    path = K8S / "milvus" / f"values-{variant}.yaml"
    values = load_docs(path)[0]
    assert values["cluster"]["enabled"] is (variant == "cluster")
    assert re.fullmatch(r"v\d+\.\d+\.\d+", values["image"]["all"]["tag"])
    assert values["service"]["type"] == "ClusterIP"
    assert values["streaming"]["enabled"] and values["woodpecker"]["enabled"]
    assert not values["pulsarv3"]["enabled"] and not values["kafka"]["enabled"]
    user = yaml.safe_load(values["extraConfigFiles"]["user.yaml"])
    assert user["common"]["security"]["authorizationEnabled"] is True
    assert not credential_values(values), "credentials belong in Secrets, not in Helm values"
    if variant == "cluster":
        assert not values["minio"]["enabled"]
        assert values["externalS3"]["enabled"] and values["externalS3"]["useIAM"]
    else:
        assert values["standalone"]["messageQueue"] == "woodpecker"
    release, namespace = helm_target(path)
    assert "milvus" in release  # the chart then names the Service after the release
    for overlay, docs in rendered.items():
        uri = the(docs, "ConfigMap", "compatflow-pipeline-config")["data"]["COMPATFLOW_MILVUS_URI"]
        assert uri == f"http://{release}.{namespace}.svc.cluster.local:{values['service']['port']}", overlay
        egress = the(docs, "NetworkPolicy", "pipeline-egress")["spec"]["egress"]
        assert any(
            peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
            == namespace
            and {"protocol": "TCP", "port": values["service"]["port"]} in rule["ports"]
            for rule in egress
            for peer in rule.get("to", [])
        ), f"{overlay}: pipeline pods may not reach Milvus in namespace {namespace}"


def test_milvus_variants_run_the_same_version() -> None:
    tags = {
        v: load_docs(K8S / "milvus" / f"values-{v}.yaml")[0]["image"]["all"]["tag"]
        for v in ("standalone", "cluster")
    }
    assert len(set(tags.values())) == 1, tags
    assert credential_values({"externalS3": {"secretKey": "abc"}})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_search_service_runs_compatflow_serve_on_the_pod_address(
    rendered, overlay: str, tmp_path: Path
) -> None:
    import typer.main

    from components.serving.app import create_app
    from pipelines.cli import app

    docs = rendered[overlay]
    deployment = the(docs, "Deployment", "search")
    pod = deployment["spec"]["template"]["spec"]
    container = the_container(deployment)
    configmaps = configmap_data(docs)
    args = [expand(a, container_env(container, configmaps)) for a in container["args"]]
    assert container["command"] == ["compatflow"] and args[0] == "serve"
    params = typer.main.get_command(app).commands["serve"].make_context("serve", args[1:]).params
    assert params["config"] == configmaps["compatflow-pipeline-config"]["COMPATFLOW_CONFIG"]
    # `serve` binds loopback unless --host names one interface (0.0.0.0 is refused): the pod's own address,
    # which the Service, the kubelet's probes and a rollout's pace reach
    assert params["host"] == "$(POD_IP)"
    pod_ip = next(v for v in container["env"] if v["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = params["port"]
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]
    routes = {route.path for route in create_app(tmp_path / "serving.json").routes}
    probes = {
        kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/healthz"
    for kind, probe in probes.items():
        assert probe["path"] in routes and probe["port"] in ("http", port), kind
    config = _cluster_config()
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    workspace = mounts[config["workspace"]]
    assert volumes[workspace["name"]]["persistentVolumeClaim"]["claimName"] == "compatflow-workspace"
    assert not workspace.get("readOnly"), "the service announces itself in <workspace>/services/"
    feast = volumes[mounts[config["lineage"]["repo"]]["name"]]
    assert feast["configMap"]["name"] == "compatflow-feast-repo"
    service = the(docs, "Service", "search")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_search_service_runs_the_pipelines_cpu_image_and_survives_drains(rendered) -> None:
    image = the_container(the(rendered["cluster"], "Deployment", "search"))["image"]
    assert image == _cluster_config()["resources"]["cpu"]["image"]
    for overlay, docs in rendered.items():
        deployment = the(docs, "Deployment", "search")
        replicas = deployment["spec"]["replicas"]
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, overlay
        budget = the(docs, "PodDisruptionBudget", "search")["spec"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()
        allowed = budget["maxUnavailable"]
        assert isinstance(allowed, int) and allowed >= 1, f"{overlay}: a drain must be able to proceed"
        assert replicas == 1 or replicas - allowed >= 1, f"{overlay}: a drain would stop every replica"
    assert the(rendered["cluster"], "Deployment", "search")["spec"]["replicas"] >= 2
