"""What the manifest tests share: the tree's paths and rules, YAML loading, and a minimal kustomize renderer
that supports exactly the features the tree uses (``resources``, ``images``, inline JSON6902 ``patches``)
and refuses any other, so the rendered overlays are what ``kubectl apply -k`` would apply."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


MANIFESTS = ROOT / "manifests"


K8S = MANIFESTS / "k8s"


DOCKER = MANIFESTS / "docker"


SCHEMAS = MANIFESTS / "schemas"


OVERLAYS = ("local-kind", "cluster")


K8S_VERSIONS = ("1.31", "1.37")  # oldest supported, newest bundled with kubernetes-validate


NAMESPACE = "compatflow"


UID = 10001


PIPELINE_RUNNER = "compatflow-pipeline-runner"


PIPELINE_POD_LABEL = ("pipelines.kubeflow.org/v2_component", "true")


SEARCH_CLIENT_LABEL = ("compatflow.dev/search-client", "true")  # the pods the search service admits


GPU = "nvidia.com/gpu"


# Reviewed files under manifests/k8s that no kustomization may apply.
NOT_APPLIED = {"base/secrets.example.yaml"}


HELM_VALUES = {"milvus/values-standalone.yaml", "milvus/values-cluster.yaml"}


KUSTOMIZE_CONFIGS = {"training/kustomizeconfig.yaml"}


CUSTOM_SCHEMAS = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.schema.json",
}


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


ALLOWED_VERBS = {"get", "list", "watch", "create", "patch", "delete"}


SECRET_WORDS = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|API_?KEY|ACCESS_?KEY|CREDENTIAL", re.I)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def rel(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(K8S).as_posix() if path.is_relative_to(K8S) else str(path)


def k8s_yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml"))


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


class KustomizeError(ValueError):
    pass


SUPPORTED_KUSTOMIZE_FIELDS = {"apiVersion", "kind", "resources", "images", "patches", "configurations"}


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _walk_to_parent(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError) as err:
            raise KustomizeError(f"patch path {path} does not exist (at {part!r})") from err
    return node


def apply_json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Apply RFC 6902 replace/add/remove operations in place (the subset kustomize users need)."""
    for op in ops:
        kind, path = op["op"], op["path"]
        if kind not in ("replace", "add", "remove"):
            raise KustomizeError(f"unsupported JSON6902 op {kind!r} at {path}")
        parts = _pointer(path)
        parent, last = _walk_to_parent(doc, parts, path), parts[-1]
        if isinstance(parent, list):
            key: Any = len(parent) if kind == "add" and last == "-" else int(last)
            present = 0 <= key < len(parent)
        else:
            key, present = last, last in parent
        if kind != "add" and not present:
            raise KustomizeError(f"{kind} of missing path {path}")
        if kind == "remove":
            del parent[key]
        elif kind == "add" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(op["value"]))
        else:
            parent[key] = copy.deepcopy(op["value"])


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    tag = None
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest or None


def iter_containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every container (and init container) anywhere in a resource, CRDs included."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from iter_containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from iter_containers(item)


def set_images(docs: list[dict[str, Any]], rule: dict[str, Any]) -> None:
    for doc in docs:
        for container in iter_containers(doc):
            name, tag, digest = _split_image(container["image"])
            if name != rule["name"]:
                continue
            name = rule.get("newName", name)
            tag = rule.get("newTag", tag)
            digest = rule.get("digest", digest)
            container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def resource_id(doc: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = doc.get("metadata", {})
    return doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta.get("name", "")


def render(directory: Path) -> list[dict[str, Any]]:
    """Build a kustomization directory the way ``kubectl kustomize`` does, for the supported subset."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text())
    unknown = set(spec) - SUPPORTED_KUSTOMIZE_FIELDS
    if unknown:
        raise KustomizeError(f"{rel(kfile)}: fields {sorted(unknown)} are not rendered by this test")
    for config in spec.get("configurations", []):
        if not (directory / config).is_file():
            raise KustomizeError(f"{rel(kfile)}: configuration {config} does not exist")
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            docs += render(target)
        elif target.is_file():
            docs += load_docs(target)
        else:
            raise KustomizeError(f"{rel(kfile)}: resource {entry} does not exist")
    ids = [resource_id(d) for d in docs]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise KustomizeError(f"{rel(kfile)}: duplicate resources {sorted(duplicates)}")
    for patch in spec.get("patches", []):
        ops = yaml.safe_load(patch["patch"]) if "patch" in patch else load_docs(directory / patch["path"])[0]
        target = patch.get("target", {})
        if set(target) - {"kind", "name"}:
            raise KustomizeError(f"{rel(kfile)}: patch target {target} uses selectors not rendered here")
        matched = [
            d
            for d in docs
            if d["kind"] == target.get("kind", d["kind"])
            and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])
        ]
        if not matched:
            raise KustomizeError(f"{rel(kfile)}: patch target {target} matches no resource")
        for doc in matched:
            apply_json6902(doc, ops)
    for rule in spec.get("images", []):
        set_images(docs, rule)
    return docs


def referenced_files(directory: Path) -> set[str]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = {rel(directory / c) for c in spec.get("configurations", [])}
    files |= {rel(directory / p["path"]) for p in spec.get("patches", []) if "path" in p}
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        files |= referenced_files(target) if target.is_dir() else {rel(target)}
    return files


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def the(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = find(docs, kind, name)
    return doc


def resource_files() -> list[Path]:
    skip = HELM_VALUES | KUSTOMIZE_CONFIGS
    return [p for p in k8s_yaml_files() if p.name != "kustomization.yaml" and rel(p) not in skip]


def container_env(container: dict[str, Any], configmaps: dict[str, dict[str, str]]) -> dict[str, str | None]:
    """The container's environment: literal values, ConfigMap values, None for Secret/field refs."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps.get(source.get("configMapRef", {}).get("name"), {}))
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        env[var["name"]] = (
            var.get("value") if ref is None else configmaps.get(ref["name"], {}).get(ref["key"])
        )
    return env


def expand(arg: str, env: dict[str, str | None]) -> str:
    """Kubernetes' $(VAR) expansion of command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1)) or m.group(0), arg)


def secret_example_keys() -> dict[str, set[str]]:
    docs = load_docs(K8S / "base" / "secrets.example.yaml")
    return {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {})) for d in docs}


def mutated(docs: list[dict[str, Any]], kind: str, name: str, change) -> list[dict[str, Any]]:
    docs = copy.deepcopy(docs)
    change(the(docs, kind, name))
    return docs


def the_container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


@cache
def rendered_overlays() -> dict[str, list[dict[str, Any]]]:
    """Every overlay rendered once per test session (the `rendered` fixture hands each test its own copy)."""
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def _cluster_config() -> dict:
    """cluster.yaml with every setting it leaves out at its default, as a run reads it."""
    from pipelines.config import load_config

    return load_config("cluster", local_paths=False).to_dict()


def configmap_data(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in find(docs, "ConfigMap")}


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
