"""``compatflow pipeline submit`` / ``schedule`` through the real ``kfp.Client``, against a loopback server.

The server here stands in for the Kubeflow Pipelines API server, which does not run here: it answers the
few v2beta1 REST endpoints the commands call (healthz, experiments, runs, recurring runs) the way the API
server does, keeps the experiments and recurring runs it was given, and records every request. The tests
check what arrives: the compiled pipeline spec, the parameters, the cron, max_concurrency, and that the
requests are, in order, those the command's ``--dry-run`` prints.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.compile import COMPILED_DIR, COMPILED_NAME
from pipelines.submit import EXPERIMENT_ID, MAX_CONCURRENCY, SERVICE_ACCOUNT

PACKAGE = COMPILED_DIR / COMPILED_NAME


class FakeKfpApi(ThreadingHTTPServer):
    """A stand-in for the KFP API server on 127.0.0.1: state (experiments, runs, recurring runs) and the
    requests received, each ``{"method", "path", "query", "body"}``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.experiments: list[dict[str, Any]] = []
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


class _Handler(BaseHTTPRequestHandler):
    server: FakeKfpApi

    def _handle(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
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


def _as_sent(
    planned: dict[str, Any], experiment_id: str, ids: dict[str, str] | None = None
) -> dict[str, Any]:
    """A dry run's request as it goes on the wire: placeholders filled in, query values as strings."""
    text = json.dumps(planned).replace(json.dumps(EXPERIMENT_ID), json.dumps(experiment_id))
    for placeholder, value in (ids or {}).items():
        text = text.replace(placeholder, value)
    request = json.loads(text)
    request.pop("when", None)
    return {
        "method": request["method"],
        "path": request["path"],
        "query": {k: str(v) for k, v in request.get("query", {}).items()},
        "body": request.get("body"),
    }


def _as_kfp_models_send(body: dict[str, Any], model: str) -> dict[str, Any]:
    """``body`` as kfp_server_api serializes its ``model`` built from it: unknown keys raise."""
    import kfp_server_api

    return kfp_server_api.ApiClient().sanitize_for_serialization(getattr(kfp_server_api, model)(**body))


def _compiled() -> tuple[dict[str, Any], dict[str, Any]]:
    pipeline, platform = list(yaml.safe_load_all(PACKAGE.read_text()))
    return pipeline, platform


def test_submit_sends_the_compiled_pipeline_and_its_parameters(kfp_api: FakeKfpApi) -> None:
    args = ("submit", "--host", kfp_api.url, "--phase", "3", "--run-id", "resume-me", "--name", "cycle 3")
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    assert "run-1" in result.stdout and "exp-1" in result.stdout
    plan = _dry_run(*args)["requests"]
    assert kfp_api.requests == [_as_sent(r, "exp-1") for r in plan]  # no experiment yet: created first
    run = kfp_api.requests[-1]["body"]
    pipeline, platform = _compiled()
    assert run["pipeline_spec"] == {"pipeline_spec": pipeline, "platform_spec": platform}
    assert run["runtime_config"] == {"parameters": {"phase": 3, "run_id": "resume-me"}}
    assert _as_kfp_models_send(run, "V2beta1Run") == run  # every key is one of the API's
    assert (run["display_name"], run["experiment_id"], run["service_account"]) == (
        "cycle 3",
        "exp-1",
        SERVICE_ACCOUNT,
    )

    kfp_api.requests.clear()  # the experiment exists now: looked up, not created again
    result = _invoke("submit", "--host", kfp_api.url, "--name", "cycle next")
    assert result.exit_code == 0, result.output
    assert [(r["method"], r["path"]) for r in kfp_api.requests] == [
        ("GET", "/apis/v2beta1/healthz"),
        ("GET", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/runs"),
    ]
    assert kfp_api.requests[-1]["body"]["runtime_config"] == {"parameters": {}}  # the package's defaults
    assert len(kfp_api.experiments) == 1 and len(kfp_api.runs) == 2


def test_schedule_creates_one_weekly_recurring_run_and_replaces_it_only_when_asked(
    kfp_api: FakeKfpApi,
) -> None:
    args = ("schedule", "--host", kfp_api.url)
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    plan = _dry_run(*args)["requests"]
    assert kfp_api.requests == [_as_sent(r, "exp-1") for r in plan]
    body = kfp_api.requests[-1]["body"]
    pipeline, platform = _compiled()
    assert body["pipeline_spec"] == {"pipeline_spec": pipeline, "platform_spec": platform}
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * 1"}}  # Mondays 03:00, seconds field first
    assert body["max_concurrency"] == MAX_CONCURRENCY == 1
    assert body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["runtime_config"] == {"parameters": {"phase": -1, "run_id": ""}}
    assert body["service_account"] == SERVICE_ACCOUNT
    assert _as_kfp_models_send(body, "V2beta1RecurringRun") == body
    (first,) = kfp_api.recurring_runs

    kfp_api.requests.clear()
    again = _invoke(*args, "--cron", "30 2 * * *")
    assert again.exit_code == 1
    assert "--replace" in again.output and first["recurring_run_id"] in again.output
    assert [r["method"] for r in kfp_api.requests] == ["GET", "GET", "GET"]  # nothing created
    assert kfp_api.recurring_runs == [first]

    kfp_api.requests.clear()
    replaced = _invoke(*args, "--cron", "30 2 * * *", "--replace")
    assert replaced.exit_code == 0, replaced.output
    plan = _dry_run(*args, "--cron", "30 2 * * *", "--replace")["requests"]
    ids = {"<id>": first["recurring_run_id"]}
    experiment_created = ("POST", "/apis/v2beta1/experiments")  # not again: it exists
    assert kfp_api.requests == [
        _as_sent(r, "exp-1", ids) for r in plan if (r["method"], r["path"]) != experiment_created
    ]
    (now,) = kfp_api.recurring_runs
    assert now["recurring_run_id"] != first["recurring_run_id"]
    assert now["trigger"] == {"cron_schedule": {"cron": "0 30 2 * * *"}}


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
