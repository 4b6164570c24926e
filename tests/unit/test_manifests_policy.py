"""Workload policy of the rendered overlays: security contexts, resources, RBAC, NetworkPolicies, Secrets and
GPU scheduling; each check is also run on a broken copy to show that it bites."""

from __future__ import annotations

import re
from typing import Any

import pytest
from _manifests import (
    ALLOWED_VERBS,
    CLUSTER_SCOPED,
    GPU,
    K8S,
    NAMESPACE,
    OVERLAYS,
    PIPELINE_POD_LABEL,
    PIPELINE_RUNNER,
    SEARCH_CLIENT_LABEL,
    SECRET_WORDS,
    UID,
    _split_image,
    container_env,
    find,
    load_docs,
    mutated,
    resource_files,
    secret_example_keys,
    the,
    the_container,
)


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
                if "/" not in _split_image(container["image"])[0]:
                    out.append(f"{cwhere}: image {container['image']} not registry-qualified (REGISTRY/NAME)")
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


def _peers_select(peers: list[dict[str, Any]] | None, labels: dict[str, str]) -> bool:
    """Whether a rule's ``from``/``to`` takes a pod of this namespace with ``labels`` (no peers: any)."""
    if not peers:
        return True
    return any(set(peer) == {"podSelector"} and selects(peer["podSelector"], labels) for peer in peers)


def _opens(
    policies: list[dict[str, Any]], pod: dict[str, str], peer: dict[str, str], port: int, way: str
) -> bool:
    field = "to" if way == "egress" else "from"
    return any(
        selects(policy["spec"]["podSelector"], pod)
        and _peers_select(rule.get(field), peer)
        and (not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
        for policy in policies
        for rule in policy["spec"].get(way, [])
    )


def reachable(
    policies: list[dict[str, Any]], source: dict[str, str], target: dict[str, str], port: int
) -> bool:
    """Whether pods labelled ``source`` may connect to pods labelled ``target`` on ``port``, both in this
    namespace: the source's egress and the target's ingress allow it."""
    return _opens(policies, source, target, port, "egress") and _opens(
        policies, target, source, port, "ingress"
    )


def search_violations(docs: list[dict[str, Any]], policies: list[dict[str, Any]]) -> list[str]:
    """The search service: its clients, the pipeline's pods (a rollout's pace reads its /metrics) and no one
    else reach it; it reaches Milvus and MLflow."""
    out: list[str] = []
    search = the(docs, "Deployment", "search")["spec"]["template"]["metadata"]["labels"]
    port = the_container(the(docs, "Deployment", "search"))["ports"][0]["containerPort"]
    for who, labels in (
        ("labelled clients", dict([SEARCH_CLIENT_LABEL])),
        ("pipeline pods", dict([PIPELINE_POD_LABEL])),
    ):
        if not reachable(policies, labels, search, port):
            out.append(f"{who} cannot reach the search service on {port}")
    if _opens(policies, search, {"app.kubernetes.io/name": "someone-else"}, port, "ingress"):
        out.append("the search service admits pods that are not its clients")
    mlflow = the(docs, "Deployment", "mlflow")["spec"]["template"]["metadata"]["labels"]
    if not reachable(policies, search, mlflow, 5000):
        out.append("the search service cannot reach MLflow (each query model's registered digest)")
    if 19530 not in allowed_ports(policies, search, "egress"):
        out.append("the search service cannot reach Milvus (19530)")
    return out


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
    out += search_violations(docs, policies)
    mlflow_egress = allowed_ports(policies, {"app.kubernetes.io/name": "mlflow"}, "egress")
    for port, what in ((5432, "Postgres"), (443, "the object store")):
        if port not in mlflow_egress:
            out.append(f"mlflow may not reach {what} ({port})")
    return out


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


BROKEN = {
    "privileged": (
        "workloads",
        "Deployment",
        "mlflow",
        lambda d: the_container(d)["securityContext"].update(privileged=True),
    ),
    "no-limits": ("workloads", "Deployment", "feast", lambda d: the_container(d)["resources"].pop("limits")),
    "host-network": (
        "workloads",
        "Deployment",
        "feast",
        lambda d: d["spec"]["template"]["spec"].update(hostNetwork=True),
    ),
    "latest-image": (
        "workloads",
        "Deployment",
        "mlflow",
        lambda d: the_container(d).update(image="x:latest"),
    ),
    "bare-image": (
        "workloads",
        "Deployment",
        "mlflow",
        lambda d: the_container(d).update(image="compatflow-cpu:0.1.0"),
    ),
    "inline-password": (
        "workloads",
        "Deployment",
        "mlflow",
        lambda d: the_container(d)["env"].append({"name": "DB_PASSWORD", "value": "x"}),
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
    "search-open-to-all": (
        "network",
        "NetworkPolicy",
        "search",
        lambda d: d["spec"]["ingress"][0].pop("from"),
    ),
    "search-clients-cut-off": (
        "network",
        "NetworkPolicy",
        "search-clients",
        lambda d: d["spec"]["egress"][0]["ports"][0].update(port=80),
    ),
    "search-as-root": (
        "workloads",
        "Deployment",
        "search",
        lambda d: d["spec"]["template"]["spec"]["securityContext"].update(runAsUser=0),
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
        lambda d: the_container(d)["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_policy_checks_catch_a_broken_copy(rendered, case: str) -> None:
    policy, kind, name, change = BROKEN[case]
    assert POLICIES[policy](mutated(rendered["cluster"], kind, name, change)), case


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
