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
    SECRET_WORDS,
    container_env,
    expand,
    find,
    load_docs,
    mutated,
    rel,
    secret_example_keys,
    the,
    the_container,
)


def _cluster_config() -> dict:
    """cluster.yaml with every setting it leaves out at its default, as a run reads it."""
    from pipelines.config import load_config

    return load_config("cluster", local_paths=False).to_dict()


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


def configmap_data(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in find(docs, "ConfigMap")}


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
    assert context.params["device"] == "cuda"
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
    training = config["training"]
    assert (args["--config"], args["--method"]) == (training["model_config"], training["method"])
    assert (int(args["--steps"]), int(args["--batch-size"])) == (training["steps"], training["batch_size"])
    gpu = config["resources"]["gpu"]
    assert gpu["accelerator"] == GPU
    assert gpu["node_selector"].items() <= pod["nodeSelector"].items()
    assert all(t in pod["tolerations"] for t in gpu["tolerations"])
    assert pod["containers"][0]["image"] == config["resources"]["gpu"]["image"]


def compile_cluster_tasks(path: Path) -> Path:
    """A CPU and a GPU stage of the real components, configured with the cluster config."""
    from kfp import compiler, dsl

    from components import kfp_ops
    from pipelines import resources

    settings = resources.compile_settings("cluster")

    @dsl.pipeline(name="cluster-task-settings")
    def pipeline():  # no annotations: this module postpones them and KFP reads them at runtime
        validation = resources.configure(
            kfp_ops.validate_op(config="{}", phase=1, shards=[], run_dir="/mnt/compatflow/runs/r"),
            "validate_op",
            settings,
        )
        resources.configure(
            kfp_ops.continual_op(
                config="{}",
                run_dir="/mnt/compatflow/runs/r",
                phase=1,
                stream_dir="s3://stream",
                accepted=validation.outputs["accepted"],
                production="/mnt/compatflow/models/v1",
            ),
            "continual_op",
            settings,
        )

    compiler.Compiler().compile(pipeline, str(path))
    return path


def compiled_executors(path: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(executor, container, Kubernetes platform settings) of every task of a compiled pipeline."""
    docs = load_docs(path)
    platform = docs[1].get("platforms", {}).get("kubernetes", {}) if len(docs) > 1 else {}
    k8s = platform.get("deploymentSpec", {}).get("executors", {})
    return [
        (name, executor["container"], k8s.get(name, {}))
        for name, executor in docs[0]["deploymentSpec"]["executors"].items()
    ]


def task_setting_violations(
    executors: list[tuple[str, dict[str, Any], dict[str, Any]]],
    docs: list[dict[str, Any]],
    config: dict[str, Any],
) -> list[str]:
    out: list[str] = []
    configmaps = configmap_data(docs)
    secrets = secret_example_keys()
    claims = {d["metadata"]["name"] for d in find(docs, "PersistentVolumeClaim")}
    pipeline_config = configmaps["compatflow-pipeline-config"]
    job = the(docs, "PyTorchJob", "compatflow-train")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
        "spec"
    ]
    for name, container, k8s in executors:
        for source in k8s.get("configMapAsEnv", []):
            data = configmaps.get(source["configMapName"])
            for pair in source["keyToEnv"]:
                if not source["optional"] and (data is None or pair["configMapKey"] not in data):
                    out.append(
                        f"{name}: reads {source['configMapName']}/{pair['configMapKey']}, which is missing"
                    )
        for source in k8s.get("secretAsEnv", []):
            for pair in source["keyToEnv"]:
                if pair["secretKey"] not in secrets.get(source["secretName"], set()):
                    out.append(
                        f"{name}: reads Secret {source['secretName']}/{pair['secretKey']}, "
                        "which secrets.example.yaml does not document"
                    )
        for mount in k8s.get("pvcMount", []):
            if mount["constant"] not in claims:
                out.append(f"{name}: PVC {mount['constant']} missing")
            if (
                mount["mountPath"] != pipeline_config["COMPATFLOW_WORKSPACE"]
                or mount["mountPath"] != config["workspace"]
            ):
                out.append(f"{name}: workspace mounted at {mount['mountPath']}, not COMPATFLOW_WORKSPACE")
        for volume in k8s.get("configMapAsVolume", []):
            if volume["configMapName"] not in configmaps:
                out.append(f"{name}: volume ConfigMap {volume['configMapName']} missing")
            if volume["mountPath"] != pipeline_config["COMPATFLOW_FEAST_REPO"]:
                out.append(f"{name}: Feast repo mounted at {volume['mountPath']}, not COMPATFLOW_FEAST_REPO")
        for env in container.get("env", []):
            if SECRET_WORDS.search(env["name"]):
                out.append(f"{name}: {env['name']} inlined in the compiled pipeline")
        accelerator = container.get("resources", {}).get("accelerator")
        if not accelerator:
            if container["image"] != config["resources"]["cpu"]["image"]:
                out.append(f"{name}: CPU task image {container['image']} is not resources.cpu.image")
            continue
        if accelerator.get("resourceType") != GPU:
            out.append(f"{name}: accelerator {accelerator.get('resourceType')} is not {GPU}")
        if not job["nodeSelector"].items() <= k8s.get("nodeSelector", {}).get("labels", {}).items():
            out.append(f"{name}: GPU task not pinned to the training job's GPU pool {job['nodeSelector']}")
        tolerations = [
            {k: v for k, v in t.items() if k != "tolerationSeconds"} for t in k8s.get("tolerations", [])
        ]
        if not all(t in tolerations for t in job["tolerations"]):
            out.append(f"{name}: GPU task does not tolerate the GPU pool's taints {job['tolerations']}")
        if not any(
            m["mountPath"] == "/dev/shm" and m.get("medium") == "Memory"
            for m in k8s.get("emptyDirMounts", [])
        ):
            out.append(f"{name}: GPU task without a memory-backed /dev/shm")
        if container["image"] != config["resources"]["gpu"]["image"]:
            out.append(f"{name}: GPU task image {container['image']} is not resources.gpu.image")
    return out


@pytest.fixture(scope="module")
def cluster_task_executors(tmp_path_factory) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return compiled_executors(compile_cluster_tasks(tmp_path_factory.mktemp("compiled") / "tasks.yaml"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compiled_task_settings_reference_the_manifests(
    rendered, cluster_task_executors, overlay: str
) -> None:
    config = _cluster_config()
    gpu = [
        name
        for name, container, _ in cluster_task_executors
        if container.get("resources", {}).get("accelerator")
    ]
    assert gpu == ["exec-continual-op"], "the GPU stage must request the GPU pool"
    assert all(k8s.get("pvcMount") and k8s.get("secretAsEnv") for _, _, k8s in cluster_task_executors)
    violations = task_setting_violations(cluster_task_executors, rendered[overlay], config)
    if overlay != "cluster":  # only the cluster overlay retags images to the registry cluster.yaml names
        violations = [v for v in violations if "image" not in v.split(" is not ")[-1]]
    assert not violations, f"overlays/{overlay}:\n" + "\n".join(violations)


def test_task_setting_check_catches_a_broken_copy(rendered, cluster_task_executors) -> None:
    config = _cluster_config()
    docs = mutated(
        rendered["cluster"],
        "ConfigMap",
        "compatflow-pipeline-config",
        lambda d: d["data"].pop("COMPATFLOW_TRACKING_URI"),
    )
    assert any(
        "COMPATFLOW_TRACKING_URI" in v for v in task_setting_violations(cluster_task_executors, docs, config)
    )
    docs = mutated(
        rendered["cluster"],
        "PyTorchJob",
        "compatflow-train",
        lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].update(
            nodeSelector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        ),
    )
    assert any("GPU pool" in v for v in task_setting_violations(cluster_task_executors, docs, config))


def test_committed_pipeline_task_settings_reference_the_manifests(rendered) -> None:
    run = load_docs(K8S / "kfp" / "recurring-run.yaml")[0]["spec"]
    package = ROOT / run["pipeline_package_path"]
    assert package.is_file(), f"{run['pipeline_package_path']} is missing: run `compatflow compile`"
    executors = compiled_executors(package)
    assert any(k8s for _, _, k8s in executors), "the committed pipeline carries no task settings"
    config = _cluster_config()
    violations = task_setting_violations(executors, rendered["cluster"], config)
    assert not violations, "\n".join(violations)


def test_recurring_run_and_scheduled_workflow_agree() -> None:
    run = load_docs(K8S / "kfp" / "recurring-run.yaml")[0]
    swf = load_docs(K8S / "kfp" / "scheduledworkflow.yaml")[0]
    spec, sspec = run["spec"], swf["spec"]
    assert spec["cron"] == "0 3 * * 1"
    assert spec["max_concurrency"] == 1 and spec["no_catchup"] is True
    assert spec["pipeline_package_path"] == "pipelines/compiled/continual_upgrade.yaml"
    assert sspec["trigger"]["cronSchedule"]["cron"] == "0 " + spec["cron"]
    assert sspec["maxConcurrency"] == spec["max_concurrency"]
    assert sspec["noCatchup"] == spec["no_catchup"]
    assert sspec["serviceAccount"] == spec["service_account"] == PIPELINE_RUNNER
    assert swf["metadata"]["name"] == run["metadata"]["name"] == spec["job_name"]
    assert swf["metadata"]["namespace"] == run["metadata"]["namespace"] == NAMESPACE
    # Fail closed: a schedule is enabled only together with the pipeline it runs.
    assert sspec.get("enabled") is False or sspec.get("pipelineId")


def test_recurring_run_parameters_match_the_compiled_pipeline() -> None:
    run = load_docs(K8S / "kfp" / "recurring-run.yaml")[0]["spec"]
    package = ROOT / run["pipeline_package_path"]
    assert package.is_file(), f"{run['pipeline_package_path']} is missing: run `compatflow compile`"
    spec = load_docs(package)[0]
    inputs = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    unknown = set(run["params"]) - set(inputs)
    assert not unknown, f"recurring run passes parameters the pipeline does not take: {unknown}"
    required = {n for n, p in inputs.items() if "defaultValue" not in p and not p.get("isOptional")}
    assert required <= set(run["params"]), (
        f"required pipeline parameters not set: {required - set(run['params'])}"
    )


def test_mlflow_server_options_and_environment_are_mlflow_s_own() -> None:
    from mlflow.cli import server

    deployment = load_docs(K8S / "mlflow" / "deployment.yaml")[0]
    container = the_container(deployment)
    assert container["command"] == ["mlflow"] and container["args"][0] == "server"
    options = {o: p for p in server.params for o in p.opts}
    for arg in container["args"][1:]:
        assert arg.split("=", 1)[0] in options, f"mlflow server has no option {arg}"
    env = {e["name"]: e for e in container["env"]}
    assert options["--backend-store-uri"].envvar == "MLFLOW_BACKEND_STORE_URI"
    assert "secretKeyRef" in env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]
    assert options["--artifacts-destination"].envvar == "MLFLOW_ARTIFACTS_DESTINATION"
    assert "MLFLOW_ARTIFACTS_DESTINATION" in env


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


@pytest.mark.filterwarnings("ignore:Field name .vector_enabled.:UserWarning")
def test_feast_server_options_and_feature_store_yaml_load_with_feast(monkeypatch, tmp_path: Path) -> None:
    from feast.cli.cli import cli
    from feast.repo_config import load_repo_config

    container = the_container(load_docs(K8S / "feast" / "deployment.yaml")[0])
    args = container["args"]
    root_options = {o for p in cli.params for o in p.opts}
    assert args[0].split("=", 1)[0] in root_options and args[1] == "serve"
    serve_options = {o for p in cli.commands["serve"].params for o in p.opts}
    for arg in args[2:]:
        assert arg.split("=", 1)[0] in serve_options, f"feast serve has no option {arg}"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "feature-repo")
    assert args[0] == f"--chdir={mount['mountPath']}"

    repo = the(load_docs(K8S / "feast" / "configmap.yaml"), "ConfigMap", "compatflow-feast-repo")
    text = repo["data"]["feature_store.yaml"]
    provided = {e["name"] for e in container["env"]}
    values = {
        "COMPATFLOW_FEAST_REGISTRY_PATH": "s3://bucket/registry.pb",
        "COMPATFLOW_MILVUS_URI": "http://milvus.milvus.svc.cluster.local:19530",
        "COMPATFLOW_MILVUS_TOKEN": "compatflow:password",
    }
    for variable in re.findall(r"\$\{(\w+)\}", text):
        assert variable in provided, (
            f"feature_store.yaml reads ${{{variable}}}; the container does not set it"
        )
        monkeypatch.setenv(variable, values[variable])
    (tmp_path / "feature_store.yaml").write_text(text)
    config = load_repo_config(tmp_path, tmp_path / "feature_store.yaml")
    assert config.registry.path == values["COMPATFLOW_FEAST_REGISTRY_PATH"]
    assert (config.online_store.type, config.online_store.uri) == ("milvus", values["COMPATFLOW_MILVUS_URI"])
    assert config.online_store.token == values["COMPATFLOW_MILVUS_TOKEN"]
    # The loader rejects what it does not know, so the check above can fail.
    (tmp_path / "feature_store.yaml").write_text(text.replace("vector_enabled", "vector_enable"))
    with pytest.raises(Exception, match="vector_enable"):
        load_repo_config(tmp_path, tmp_path / "feature_store.yaml").online_store  # noqa: B018


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
