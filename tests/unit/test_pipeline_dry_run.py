"""``compatflow pipeline submit`` / ``schedule --dry-run``: the requests they would send, built from the
committed compiled pipeline without kfp (the unit guard fails a test importing it), and what they refuse."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from _pipelines import pinned_package
from typer.testing import CliRunner

from components.deployment import Deployment
from components.runs import RUN_PARAMETERS, run_parameters
from pipelines.cli import app
from pipelines.compile import COMPILED_DIR, COMPILED_NAME
from pipelines.submit import (
    EXPERIMENT_ID,
    PIPELINE_ID,
    VERSION_ID,
    SubmitError,
    check_parameters,
    kfp_cron,
    load_package,
)

COMMITTED = COMPILED_DIR / COMPILED_NAME  # images by tag: refused; the tests run a copy pinned by digest
CONFIGS = Path(__file__).resolve().parents[2] / "pipelines" / "configs"
HOST = "http://127.0.0.1:8888"


@pytest.fixture(autouse=True)
def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default package (``--package`` not given) is the committed one pinned by digest."""
    import pipelines.compile

    path = pinned_package(tmp_path / "compiled")
    monkeypatch.setattr(pipelines.compile, "COMPILED_DIR", path.parent)
    return path


def _dry_run(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["pipeline", *args, "--host", HOST, "--dry-run"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


UPLOAD = [
    ("GET", "/apis/v2beta1/healthz"),
    ("GET", "/apis/v2beta1/experiments"),
    ("POST", "/apis/v2beta1/experiments"),
    ("GET", "/apis/v2beta1/pipelines"),
    ("POST", "/apis/v2beta1/pipelines"),
    ("GET", f"/apis/v2beta1/pipelines/{PIPELINE_ID}/versions"),
    ("POST", "/apis/v2beta1/pipelines/upload_version"),
]
REFERENCE = {"pipeline_id": PIPELINE_ID, "pipeline_version_id": VERSION_ID}


def test_submit_dry_run_uploads_a_version_and_runs_it_with_per_run_parameters(pinned: Path) -> None:
    plan = _dry_run(
        "submit",
        *("--phase", "4", "--run-id", "r-4", "--name", "cycle 4", "--experiment", "exp"),
        *(
            "--param",
            "training_steps=600",
            "--param",
            "compat_method=bct",
            "--param",
            "rollout_fractions=[0.5, 1]",
        ),
    )
    assert plan["host"] == HOST and Path(plan["package"]) == pinned
    digest = hashlib.sha256(pinned.read_bytes()).hexdigest()
    version = f"compatflow-continual-upgrade-{digest[:12]}"
    assert [(r["method"], r["path"]) for r in plan["requests"]] == [*UPLOAD, ("POST", "/apis/v2beta1/runs")]
    lookup, create = plan["requests"][1:3]
    assert json.loads(lookup["query"]["filter"])["predicates"][0]["stringValue"] == "exp"
    assert create["body"] == {"display_name": "exp", "namespace": "compatflow"} and "when" in create
    versions, upload = plan["requests"][5:7]
    assert json.loads(versions["query"]["filter"])["predicates"][0]["stringValue"] == version
    assert upload["query"] == {
        "name": version,
        "display_name": version,
        "pipelineid": PIPELINE_ID,
        "description": f"continual_upgrade.yaml, sha256 {digest}",
    }
    assert Path(upload["file"]) == pinned and f"no pipeline version named {version!r}" in upload["when"]
    run = plan["requests"][-1]["body"]
    assert run == {
        "display_name": "cycle 4",
        "experiment_id": EXPERIMENT_ID,
        "pipeline_version_reference": REFERENCE,
        "runtime_config": {
            "parameters": {
                "training_steps": 600,
                "compat_method": "bct",
                "rollout_fractions": [0.5, 1],
                "phase": 4,
                "run_id": "r-4",
            }
        },
        "service_account": "compatflow-pipeline-runner",
    }
    assert {EXPERIMENT_ID, PIPELINE_ID, VERSION_ID} <= set(plan["placeholders"])
    default = _dry_run("submit")["requests"][-1]["body"]
    assert default["runtime_config"] == {"parameters": {}}  # the package's own defaults
    assert default["display_name"].startswith("compatflow-continual-upgrade ")


def test_schedule_dry_run_prints_a_weekly_recurring_run_of_the_version_with_one_run_at_a_time() -> None:
    plan = _dry_run("schedule", "--param", "compat_steps=1200")
    methods = [(r["method"], r["path"]) for r in plan["requests"]]
    assert methods == [
        *UPLOAD,
        ("GET", "/apis/v2beta1/recurringruns"),
        ("POST", "/apis/v2beta1/recurringruns"),
    ]
    assert "--replace" in plan["requests"][-2]["when"]
    body = plan["requests"][-1]["body"]
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * 1"}}
    assert (body["max_concurrency"], body["no_catchup"], body["mode"]) == (1, True, "ENABLE")
    assert body["runtime_config"] == {"parameters": {"phase": -1, "run_id": "", "compat_steps": 1200}}
    assert body["pipeline_version_reference"] == REFERENCE and "pipeline_spec" not in body
    assert body["display_name"] == "compatflow-weekly-upgrade"
    replace = _dry_run("schedule", "--replace", "--cron", "15 1 1 * *")
    assert replace["requests"][-1]["method"] == "DELETE" and "when" in replace["requests"][-1]
    assert replace["requests"][-2]["body"]["trigger"]["cron_schedule"]["cron"] == "0 15 1 1 * *"


@pytest.mark.parametrize(
    ("cron", "sent"),
    [
        ("0 3 * * 1", "0 0 3 * * 1"),  # five fields: seconds 0 added
        (" 0  3 * * 1 ", "0 0 3 * * 1"),
        ("0 0 3 * * 1", "0 0 3 * * 1"),  # KFP's own six fields (seconds first) pass as they are
        ("30 15 2 */2 JAN-MAR,DEC MON-FRI", "30 15 2 */2 JAN-MAR,DEC MON-FRI"),
        ("0 0 4 ? * sun", "0 0 4 ? * sun"),
        ("*/5 9-17 * * 1,3,5", "0 */5 9-17 * * 1,3,5"),
        ("@weekly", "@weekly"),
        ("@daily", "@daily"),
        ("@hourly", "@hourly"),
    ],
)
def test_cron_in_kfp_forms(cron: str, sent: str) -> None:
    assert kfp_cron(cron) == sent
    plan = _dry_run("schedule", "--cron", cron)
    assert plan["requests"][-1]["body"]["trigger"] == {"cron_schedule": {"cron": sent}}


@pytest.mark.parametrize(
    ("cron", "message"),
    [
        ("60 3 * * 1", "minute '60': 60 is out of range (minute: 0-59)"),
        ("0 3 * * 7", "day of week '7': 7 is out of range (day of week: 0-6)"),
        ("0 24 * * 1", "hour '24': 24 is out of range (hour: 0-23)"),
        ("0 3 0 * *", "day of month '0': 0 is out of range (day of month: 1-31)"),
        ("0 3 * 13 *", "month '13': 13 is out of range (month: 1-12)"),
        ("61 0 3 * * 1", "second '61': 61 is out of range (second: 0-59)"),
        ("0 3 * * 5-1", "day of week '5-1': range '5-1' runs backwards"),
        ("*/0 3 * * 1", "minute '*/0': step '0' is not a positive number"),
        ("0 ? * * 1", "hour '?': '?' is for the day fields only"),
        ("0 3 * FOO *", "month 'FOO': 'FOO' is not a number or a name (JAN"),
        ("3 * * 1", "give five fields"),
        ("@fortnightly", "give five fields"),
    ],
)
def test_cron_out_of_range_is_refused_naming_the_field(cron: str, message: str) -> None:
    with pytest.raises(SubmitError, match=re.escape(message)):
        kfp_cron(cron)
    result = CliRunner().invoke(app, ["pipeline", "schedule", "--cron", cron, "--host", HOST, "--dry-run"])
    assert result.exit_code == 2 and message.split(":")[0] in result.output, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("submit", "--package", "/nonexistent/pipeline.yaml"), "compatflow compile"),
        (("submit", "--package", str(COMMITTED)), "by tag only: pin the images by digest"),
        (("schedule", "--package", str(COMMITTED)), "--digest cpu=sha256:"),
        (("submit", "--host", "127.0.0.1:8888"), "with its scheme"),
        (("submit", "--param", "training_steps=many"), "is not a NUMBER_INTEGER"),
        (("submit", "--param", "training_steps"), "give NAME=VALUE"),
        (("schedule", "--param", "stage=1"), "takes no parameter 'stage'"),
    ],
)
def test_dry_run_refuses_what_it_cannot_send(args: tuple[str, ...], message: str) -> None:
    argv = ["pipeline", *args, "--dry-run"]
    if "--host" not in args:
        argv += ["--host", HOST]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and message in result.output, result.output


def test_packages_and_parameters_are_checked(tmp_path: Path, pinned: Path) -> None:
    package = load_package(pinned)
    assert set(package.parameters) == {"config", "phase", "run_id", *RUN_PARAMETERS}
    check_parameters(package, {"phase": 2, "run_id": "x", "training_method": "finetune", "compat_steps": 9})
    for wrong, message in (
        ({"phase": "2"}, "is not a NUMBER_INTEGER"),
        ({"phase": True}, "is not a NUMBER_INTEGER"),
        ({"stage": 1}, "takes no parameter 'stage'"),
    ):
        with pytest.raises(SubmitError, match=message):
            check_parameters(package, wrong)
    spec = next(yaml.safe_load_all(pinned.read_text()))
    del spec["root"]["inputDefinitions"]["parameters"]["config"]["defaultValue"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SubmitError, match=r"\['config'\] have no default"):
        check_parameters(load_package(tmp_path / "p.yaml"), {})
    (tmp_path / "q.yaml").write_text("a: 1\n")
    with pytest.raises(SubmitError, match="not a compiled KFP pipeline"):
        load_package(tmp_path / "q.yaml")
    defaults = {k: v["defaultValue"] for k, v in package.parameters.items() if k in RUN_PARAMETERS}
    cluster = Deployment.parse(yaml.safe_load((CONFIGS / "cluster.yaml").read_text()), source="cluster.yaml")
    assert defaults == run_parameters(cluster)  # the compiled config's values, each settable per run
