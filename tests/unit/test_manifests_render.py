"""The manifests render and validate: every file and every rendered overlay against the Kubernetes OpenAPI
schemas bundled with ``kubernetes-validate`` (strict) and the CRD schemas in ``manifests/schemas/``; each
kustomization renders from files that exist, and the overlays differ only in values."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from _manifests import (
    CUSTOM_SCHEMAS,
    K8S,
    K8S_VERSIONS,
    KUSTOMIZE_CONFIGS,
    NOT_APPLIED,
    OVERLAYS,
    SCHEMAS,
    KustomizeError,
    apply_json6902,
    kustomization_dirs,
    load_docs,
    referenced_files,
    rel,
    render,
    resource_files,
    resource_id,
)


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
