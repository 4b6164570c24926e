"""``compatflow pipeline submit`` / ``schedule --dry-run``: the requests they would send, built from the
committed compiled pipeline without kfp (the unit guard fails a test importing it), and what they refuse."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.compile import COMPILED_DIR, COMPILED_NAME
from pipelines.submit import EXPERIMENT_ID, SubmitError, check_parameters, kfp_cron, load_package

PACKAGE = COMPILED_DIR / COMPILED_NAME
HOST = "http://127.0.0.1:8888"


def _dry_run(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["pipeline", *args, "--host", HOST, "--dry-run"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _compiled_spec() -> dict[str, Any]:
    return copy.deepcopy(_COMPILED)


_COMPILED = load_package(PACKAGE).spec


def test_submit_dry_run_prints_the_run_request() -> None:
    plan = _dry_run("submit", "--phase", "4", "--run-id", "r-4", "--name", "cycle 4", "--experiment", "exp")
    assert plan["host"] == HOST and Path(plan["package"]) == PACKAGE
    assert [(r["method"], r["path"]) for r in plan["requests"]] == [
        ("GET", "/apis/v2beta1/healthz"),
        ("GET", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/runs"),
    ]
    lookup, create = plan["requests"][1:3]
    assert json.loads(lookup["query"]["filter"])["predicates"][0]["stringValue"] == "exp"
    assert create["body"] == {"display_name": "exp", "namespace": "compatflow"} and "when" in create
    run = plan["requests"][-1]["body"]
    assert run == {
        "display_name": "cycle 4",
        "experiment_id": EXPERIMENT_ID,
        "pipeline_spec": _compiled_spec(),
        "runtime_config": {"parameters": {"phase": 4, "run_id": "r-4"}},
        "service_account": "compatflow-pipeline-runner",
    }
    assert EXPERIMENT_ID in plan["placeholders"]
    default = _dry_run("submit")["requests"][-1]["body"]
    assert default["runtime_config"] == {"parameters": {}}  # the package's own defaults
    assert default["display_name"].startswith("compatflow-continual-upgrade ")


def test_schedule_dry_run_prints_a_weekly_recurring_run_with_one_run_at_a_time() -> None:
    plan = _dry_run("schedule")
    methods = [(r["method"], r["path"]) for r in plan["requests"]]
    assert methods[-2:] == [("GET", "/apis/v2beta1/recurringruns"), ("POST", "/apis/v2beta1/recurringruns")]
    assert "--replace" in plan["requests"][-2]["when"]
    body = plan["requests"][-1]["body"]
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * 1"}}
    assert (body["max_concurrency"], body["no_catchup"], body["mode"]) == (1, True, "ENABLE")
    assert body["runtime_config"] == {"parameters": {"phase": -1, "run_id": ""}}
    assert body["pipeline_spec"] == _compiled_spec()
    assert body["display_name"] == "compatflow-weekly-upgrade"
    replace = _dry_run("schedule", "--replace", "--cron", "15 1 1 * *")
    assert replace["requests"][-1]["method"] == "DELETE" and "when" in replace["requests"][-1]
    assert replace["requests"][-2]["body"]["trigger"]["cron_schedule"]["cron"] == "0 15 1 1 * *"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("schedule", "--cron", "0 0 3 * * 1"), "five fields"),  # KFP's own six fields: refused, not shifted
        (("schedule", "--cron", "3 * * 1"), "five fields"),
        (("submit", "--package", "/nonexistent/pipeline.yaml"), "compatflow compile"),
        (("submit", "--host", "127.0.0.1:8888"), "with its scheme"),
    ],
)
def test_dry_run_refuses_what_it_cannot_send(args: tuple[str, ...], message: str) -> None:
    argv = ["pipeline", *args, "--dry-run"]
    if "--host" not in args:
        argv += ["--host", HOST]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and message in result.output, result.output


def test_packages_and_parameters_are_checked(tmp_path: Path) -> None:
    package = load_package(PACKAGE)
    assert set(package.parameters) == {"config", "phase", "run_id"}
    check_parameters(package, {"phase": 2, "run_id": "x"})
    for wrong, message in (
        ({"phase": "2"}, "is not a NUMBER_INTEGER"),
        ({"phase": True}, "is not a NUMBER_INTEGER"),
        ({"stage": 1}, "takes no parameter 'stage'"),
    ):
        with pytest.raises(SubmitError, match=message):
            check_parameters(package, wrong)
    spec = _compiled_spec()["pipeline_spec"]
    del spec["root"]["inputDefinitions"]["parameters"]["config"]["defaultValue"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SubmitError, match=r"\['config'\] have no default"):
        check_parameters(load_package(tmp_path / "p.yaml"), {})
    (tmp_path / "q.yaml").write_text("a: 1\n")
    with pytest.raises(SubmitError, match="not a compiled KFP pipeline"):
        load_package(tmp_path / "q.yaml")
    assert kfp_cron(" 0  3 * * 1 ") == "0 0 3 * * 1"
