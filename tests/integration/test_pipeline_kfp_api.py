"""``compatflow pipeline submit`` / ``schedule`` through the real ``kfp.Client``, against a loopback server.

The server here stands in for the Kubeflow Pipelines API server, which does not run here: it answers the
few v2beta1 REST endpoints the commands call (healthz, experiments, pipelines and their versions, the version
upload, runs, recurring runs) the way the API server does, keeps what it was given, and records every request.
The tests check what arrives: the package uploaded once as a pipeline version, runs of that version with their
parameters, the cron, max_concurrency, and that the requests are, in order, those ``--dry-run`` prints.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from _pipelines import pinned_package
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.submit import EXPERIMENT_ID, MAX_CONCURRENCY, PIPELINE_ID, SERVICE_ACCOUNT, VERSION_ID


class FakeKfpApi(ThreadingHTTPServer):
    """A stand-in for the KFP API server on 127.0.0.1: state (experiments, runs, recurring runs) and the
    requests received, each ``{"method", "path", "query", "body"}``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.experiments: list[dict[str, Any]] = []
        self.pipelines: list[dict[str, Any]] = []
        self.versions: list[dict[str, Any]] = []
        self.uploads: list[bytes] = []
        self.runs: list[dict[str, Any]] = []
        self.recurring_runs: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        name = _filtered_name(query)
        if (method, path) == ("GET", "/apis/v2beta1/healthz"):
            return 200, {"multi_user": False, "commit_sha": "stand-in"}
        if (method, path) == ("GET", "/apis/v2beta1/experiments"):
            found = [e for e in self.experiments if e["display_name"] == name]
            return 200, {"experiments": found, "total_size": len(found)} if found else {}
        if (method, path) == ("POST", "/apis/v2beta1/experiments"):
            created = {
                **body,
                "experiment_id": f"exp-{len(self.experiments) + 1}",
                "storage_state": "AVAILABLE",
            }
            self.experiments.append(created)
            return 200, created
        if (method, path) == ("GET", "/apis/v2beta1/pipelines"):
            found = [p for p in self.pipelines if p["display_name"] == name]
            return 200, {"pipelines": found, "total_size": len(found)} if found else {}
        if (method, path) == ("POST", "/apis/v2beta1/pipelines"):
            created = {**body, "pipeline_id": f"pl-{len(self.pipelines) + 1}"}
            self.pipelines.append(created)
            return 200, created
        if method == "GET" and path.startswith("/apis/v2beta1/pipelines/") and path.endswith("/versions"):
            parent = path.split("/")[-2]
            found = [v for v in self.versions if v["pipeline_id"] == parent and v["display_name"] == name]
            return 200, {"pipeline_versions": found, "total_size": len(found)} if found else {}
        if (method, path) == ("POST", "/apis/v2beta1/pipelines/upload_version"):
            self.uploads.append(body)
            created = {
                "pipeline_id": query["pipelineid"],
                "pipeline_version_id": f"v-{len(self.versions) + 1}",
                "name": query["name"],
                "display_name": query["display_name"],
                "description": query.get("description", ""),
            }
            self.versions.append(created)
            return 200, created
        if (method, path) == ("POST", "/apis/v2beta1/runs"):
            created = {**_without_spec(body), "run_id": f"run-{len(self.runs) + 1}", "state": "PENDING"}
            self.runs.append(created)
            return 200, created
        if (method, path) == ("GET", "/apis/v2beta1/recurringruns"):
            found = [
                r
                for r in self.recurring_runs
                if r["display_name"] == name and r["experiment_id"] == query.get("experiment_id")
            ]
            return 200, {"recurringRuns": found, "total_size": len(found)} if found else {}  # sic: KFP's name
        if (method, path) == ("POST", "/apis/v2beta1/recurringruns"):
            number = len(self.requests)
            created = {**_without_spec(body), "recurring_run_id": f"rr-{number}", "status": "ENABLED"}
            self.recurring_runs.append(created)
            return 200, created
        if method == "DELETE" and path.startswith("/apis/v2beta1/recurringruns/"):
            gone = path.rsplit("/", 1)[1]
            before = len(self.recurring_runs)
            self.recurring_runs = [r for r in self.recurring_runs if r["recurring_run_id"] != gone]
            return (200, {}) if len(self.recurring_runs) < before else (404, {"error": "not found"})
        return 404, {"error": f"the stand-in does not answer {method} {path}", "code": 5}


def _filtered_name(query: dict[str, str]) -> str | None:
    if "filter" not in query:
        return None
    (predicate,) = json.loads(query["filter"])["predicates"]
    assert predicate["key"] == "display_name" and predicate["operation"] in (1, "EQUALS")
    return predicate["stringValue"]


def _without_spec(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "pipeline_spec"}


def _uploaded(content_type: str, raw: bytes) -> bytes:
    """The ``uploadfile`` part of a multipart body (as kfp_server_api's upload service sends it)."""
    message = email.parser.BytesParser().parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + raw)
    (part,) = [
        p for p in message.get_payload() if p.get_param("name", header="content-disposition") == "uploadfile"
    ]
    return part.get_payload(decode=True)


class _Handler(BaseHTTPRequestHandler):
    server: FakeKfpApi

    def _handle(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        kind = self.headers.get("Content-Type", "")
        body = _uploaded(kind, raw) if kind.startswith("multipart/") else json.loads(raw) if raw else None
        with self.server.lock:
            record = {"method": self.command, "path": parts.path, "query": query, "body": body}
            self.server.requests.append(record)
            status, answer = self.server.answer(self.command, parts.path, query, body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:  # quiet
        pass


@pytest.fixture(autouse=True)
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default package (``--package`` not given): the committed one, its images pinned by digest."""
    import pipelines.compile

    path = pinned_package(tmp_path / "compiled")
    monkeypatch.setattr(pipelines.compile, "COMPILED_DIR", path.parent)
    return path


@pytest.fixture
def kfp_api() -> Iterator[FakeKfpApi]:
    server = FakeKfpApi()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["pipeline", *args])


def _dry_run(*args: str) -> dict[str, Any]:
    result = _invoke(*args, "--dry-run")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


IDS = {EXPERIMENT_ID: "exp-1", PIPELINE_ID: "pl-1", VERSION_ID: "v-1"}  # what the stand-in answers first


def _as_sent(planned: dict[str, Any], ids: dict[str, str] | None = None) -> dict[str, Any]:
    """A dry run's request as it goes on the wire: placeholders filled in, query values as strings, the
    package file's bytes as the upload's body."""
    text = json.dumps(planned)
    for placeholder, value in {**IDS, **(ids or {})}.items():
        text = text.replace(placeholder, value)
    request = json.loads(text)
    return {
        "method": request["method"],
        "path": request["path"],
        "query": {k: str(v) for k, v in request.get("query", {}).items()},
        "body": Path(request["file"]).read_bytes() if "file" in request else request.get("body"),
    }


def _as_kfp_model(body: dict[str, Any], model: str) -> dict[str, Any]:
    """``body`` as kfp_server_api serializes its ``model`` built from it: unknown keys raise."""
    import kfp_server_api

    return kfp_server_api.ApiClient().sanitize_for_serialization(getattr(kfp_server_api, model)(**body))


def _created(kfp_api: FakeKfpApi) -> list[tuple[str, str]]:
    return [(r["method"], r["path"]) for r in kfp_api.requests if r["method"] != "GET"]


UPLOADED = [
    ("POST", "/apis/v2beta1/experiments"),
    ("POST", "/apis/v2beta1/pipelines"),
    ("POST", "/apis/v2beta1/pipelines/upload_version"),
]


def test_submit_uploads_the_package_once_as_a_version_and_runs_it_with_its_parameters(
    kfp_api: FakeKfpApi, package: Path
) -> None:
    args = ("submit", "--host", kfp_api.url, "--phase", "3", "--run-id", "resume-me", "--name", "cycle 3")
    result = _invoke(*args, "--param", "training_steps=600")
    assert result.exit_code == 0, result.output
    assert "run-1" in result.stdout and "exp-1" in result.stdout
    plan = _dry_run(*args, "--param", "training_steps=600")["requests"]
    assert kfp_api.requests == [
        _as_sent(r) for r in plan
    ]  # nothing yet: experiment, pipeline, version created
    assert _created(kfp_api) == [*UPLOADED, ("POST", "/apis/v2beta1/runs")]
    assert kfp_api.uploads == [package.read_bytes()]  # the package file itself, as kfp.Client uploads it
    (version,) = kfp_api.versions
    digest = hashlib.sha256(package.read_bytes()).hexdigest()
    assert (
        version["name"] == f"compatflow-continual-upgrade-{digest[:12]}" and digest in version["description"]
    )
    assert _as_kfp_model(version, "V2beta1PipelineVersion") == version  # every key is one of the API's
    bodies = {(r["method"], r["path"]): r["body"] for r in kfp_api.requests}
    for request, model in ((UPLOADED[0], "V2beta1Experiment"), (UPLOADED[1], "V2beta1Pipeline")):
        assert _as_kfp_model(bodies[request], model) == bodies[request]
    run = kfp_api.requests[-1]["body"]
    assert run["pipeline_version_reference"] == {"pipeline_id": "pl-1", "pipeline_version_id": "v-1"}
    assert "pipeline_spec" not in run
    assert run["runtime_config"] == {"parameters": {"training_steps": 600, "phase": 3, "run_id": "resume-me"}}
    assert _as_kfp_model(run, "V2beta1Run") == run
    assert (run["display_name"], run["experiment_id"], run["service_account"]) == (
        "cycle 3",
        "exp-1",
        SERVICE_ACCOUNT,
    )

    kfp_api.requests.clear()  # experiment, pipeline and version exist now: looked up, not created again
    result = _invoke("submit", "--host", kfp_api.url, "--name", "cycle next")
    assert result.exit_code == 0, result.output
    assert _created(kfp_api) == [("POST", "/apis/v2beta1/runs")]
    assert kfp_api.requests[-1]["body"]["runtime_config"] == {"parameters": {}}  # the package's defaults
    assert kfp_api.requests[-1]["body"]["pipeline_version_reference"]["pipeline_version_id"] == "v-1"
    assert (len(kfp_api.experiments), len(kfp_api.versions), len(kfp_api.runs)) == (1, 1, 2)


def test_schedule_creates_one_weekly_recurring_run_of_the_version_and_replaces_it_only_when_asked(
    kfp_api: FakeKfpApi,
) -> None:
    args = ("schedule", "--host", kfp_api.url)
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    plan = _dry_run(*args)["requests"]
    assert kfp_api.requests == [_as_sent(r) for r in plan]
    body = kfp_api.requests[-1]["body"]
    assert body["pipeline_version_reference"] == {"pipeline_id": "pl-1", "pipeline_version_id": "v-1"}
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * 1"}}  # Mondays 03:00, seconds field first
    assert body["max_concurrency"] == MAX_CONCURRENCY == 1
    assert body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["runtime_config"] == {"parameters": {"phase": -1, "run_id": ""}}
    assert body["service_account"] == SERVICE_ACCOUNT
    assert _as_kfp_model(body, "V2beta1RecurringRun") == body
    (first,) = kfp_api.recurring_runs

    kfp_api.requests.clear()
    again = _invoke(*args, "--cron", "30 2 * * *")
    assert again.exit_code == 1
    assert "--replace" in again.output and first["recurring_run_id"] in again.output
    assert _created(kfp_api) == [] and kfp_api.recurring_runs == [first]  # nothing created

    kfp_api.requests.clear()
    replaced = _invoke(*args, "--cron", "@daily", "--replace")
    assert replaced.exit_code == 0, replaced.output
    plan = _dry_run(*args, "--cron", "@daily", "--replace")["requests"]
    ids = {"<id>": first["recurring_run_id"]}
    assert kfp_api.requests == [_as_sent(r, ids) for r in plan if (r["method"], r["path"]) not in UPLOADED]
    (now,) = kfp_api.recurring_runs
    assert now["recurring_run_id"] != first["recurring_run_id"]
    assert now["trigger"] == {"cron_schedule": {"cron": "@daily"}}

    kfp_api.requests.clear()
    refused = _invoke(*args, "--cron", "0 3 * * 7", "--replace")
    assert refused.exit_code == 2 and "day of week '7': 7 is out of range" in refused.output
    assert kfp_api.requests == []  # checked before anything is sent


def test_unreachable_api_and_refusals_say_what_to_do(kfp_api: FakeKfpApi, tmp_path) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _invoke("submit", "--host", f"http://127.0.0.1:{port}")
    assert result.exit_code == 1
    assert f"cannot reach the KFP API at http://127.0.0.1:{port}" in result.output
    assert "--host" in result.output and "port-forward" in result.output

    result = _invoke("submit", "--host", kfp_api.url + "/wrong-prefix")
    assert result.exit_code == 1
    assert "HTTP 404" in result.output and "not its UI" in result.output

    kfp_api.requests.clear()
    result = _invoke("schedule", "--host", kfp_api.url, "--package", str(tmp_path / "none.yaml"))
    assert result.exit_code == 2 and "compatflow compile" in result.output
    assert kfp_api.requests == []  # refused before anything is sent
