"""``compatflow pipeline submit`` / ``schedule``: the compiled pipeline started on Kubeflow Pipelines;
``compatflow pipeline rehearse``: the same package run here against local servers of the cluster's kinds."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import echo_json, exit_codes, fail, refusing
from pipelines.submit import EXPERIMENT, NAMESPACE, SCHEDULE_NAME, SERVICE_ACCOUNT, TOKEN_ENV, WEEKLY

pipeline_app = typer.Typer(
    help="Start the compiled pipeline (compatflow compile) on Kubeflow Pipelines: once, or on a schedule.",
    no_args_is_help=True,
)

API_FAILED = "the KFP API refused the request or could not be reached"
HostOpt = Annotated[
    str,
    typer.Option(
        "--host",
        envvar="KF_PIPELINES_ENDPOINT",
        help="URL of the KFP API, e.g. http://127.0.0.1:8888 after "
        '"kubectl -n kubeflow port-forward svc/ml-pipeline 8888:8888".',
    ),
]
PackageOpt = Annotated[
    Path | None, typer.Option(help="Compiled pipeline (default: pipelines/compiled/continual_upgrade.yaml).")
]
ExperimentOpt = Annotated[str, typer.Option("--experiment", help="KFP experiment (created when missing).")]
NamespaceOpt = Annotated[str, typer.Option("--namespace", help="KFP namespace (multi-user: the profile's).")]
AccountOpt = Annotated[
    str, typer.Option("--service-account", help="Kubernetes ServiceAccount every pod of the run runs as.")
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar=TOKEN_ENV, help="Bearer token for the KFP API, when it asks for one."),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print the requests as JSON, in order, and send nothing.")
]
ParamOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--param",
        help="A run parameter NAME=VALUE, repeatable (e.g. training_steps=600, compat_method=bct, "
        "rollout_fractions=[0.5,1.0]); the others keep the package's defaults (its config's values).",
    ),
]


def _package(path: Path | None, params: list[str] | None) -> tuple[Any, dict[str, Any]]:
    """The compiled pipeline at ``path`` and the run parameters ``--param`` gives it (else exit 2)."""
    from pipelines.compile import COMPILED_DIR, COMPILED_NAME
    from pipelines.submit import SubmitError, load_package, parse_parameters

    with refusing(SubmitError):
        compiled = load_package(path or COMPILED_DIR / COMPILED_NAME)
        return compiled, parse_parameters(compiled, params or [])


def _start(host: str, job: Any, token: str | None, dry_run: bool) -> dict[str, Any]:
    """Print the requests (dry run) and exit, or send them; exit 2 if one cannot be built, 1 if refused."""
    from pipelines.submit import KfpApi, SubmitError, plan, send_all

    with refusing(SubmitError):
        planned = plan(host, job)  # checks everything before the first request
    if dry_run:
        echo_json(planned)
        raise typer.Exit(0)
    with refusing(SubmitError, code=1):
        api = KfpApi(host, namespace=job.namespace, token=token)
        return {"host": planned["host"], **send_all(api.send, job)}


@pipeline_app.command("submit")
@exit_codes({0: "the run started (its ID printed), or --dry-run printed the request", 1: API_FAILED})
def submit(
    host: HostOpt,
    phase: Annotated[int | None, typer.Option(help="Run this phase (default: the next pending one).")] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            help="Run id (default: the KFP job name). A failed run's id resumes it: its finished cached "
            "steps are skipped."
        ),
    ] = None,
    params: ParamOpt = None,
    name: Annotated[str | None, typer.Option(help="Run name shown by KFP.")] = None,
    package: PackageOpt = None,
    experiment: ExperimentOpt = EXPERIMENT,
    namespace: NamespaceOpt = NAMESPACE,
    service_account: AccountOpt = SERVICE_ACCOUNT,
    token: TokenOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Upload the compiled pipeline as a pipeline version (once per package) and start one run of it with the
    run parameters given; prints the run's ID."""
    from pipelines.submit import Job

    compiled, parameters = _package(package, params)
    parameters |= {k: v for k, v in (("phase", phase), ("run_id", run_id)) if v is not None}
    name = name or f"{compiled.name} {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H-%M-%S}"
    job = Job(compiled, name, parameters, experiment, namespace, service_account)
    ids = _start(host, job, token, dry_run)
    typer.echo(
        f"run {ids['run_id']} of {compiled.version_name} started in experiment {experiment!r} "
        f"({ids['experiment_id']}): {ids['host']}/#/runs/details/{ids['run_id']}"
    )


@pipeline_app.command("schedule")
@exit_codes({0: "scheduled, or --dry-run printed the request", 1: API_FAILED})
def schedule(
    host: HostOpt,
    cron: Annotated[
        str,
        typer.Option(
            help="Cron in the KFP scheduler's time zone (UTC unless set otherwise): five fields (minute hour "
            "day-of-month month day-of-week), six with seconds first, or @hourly, @daily, @weekly, @monthly, "
            "@yearly; every field is checked against its range (day of week 0-6, 0 is Sunday)."
        ),
    ] = WEEKLY,
    name: Annotated[str, typer.Option(help="Recurring run name (one per experiment).")] = SCHEDULE_NAME,
    description: Annotated[
        str, typer.Option(help="Description shown by KFP.")
    ] = "Weekly continual upgrade on the newest data phase (validate to rollout).",
    replace: Annotated[
        bool,
        typer.Option(
            "--replace", help="Replace the recurring run of the same name (e.g. after a recompile)."
        ),
    ] = False,
    params: ParamOpt = None,
    package: PackageOpt = None,
    experiment: ExperimentOpt = EXPERIMENT,
    namespace: NamespaceOpt = NAMESPACE,
    service_account: AccountOpt = SERVICE_ACCOUNT,
    token: TokenOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Schedule the compiled pipeline: upload it as a pipeline version (once per package), then one run of
    that version per cron tick, at most one at a time, no catch-up.

    Each tick runs the next pending phase. The recurring run runs the version it was created with: after a
    recompile, schedule again with --replace."""
    from pipelines.submit import Job

    compiled, parameters = _package(package, params)
    job = Job(compiled, name, parameters, experiment, namespace, service_account, cron, description, replace)
    ids = _start(host, job, token, dry_run)
    if ids["replaced"]:
        typer.echo(f"replaced recurring run(s) {', '.join(ids['replaced'])}")
    typer.echo(
        f"recurring run {ids['recurring_run_id']} ({name!r}, cron {cron!r}) of {compiled.version_name} in "
        f"experiment {experiment!r} ({ids['experiment_id']}): {ids['host']}/#/recurringrun/details/"
        f"{ids['recurring_run_id']}"
    )


@pipeline_app.command("rehearse")
@exit_codes({1: "a step of the rehearsal failed"})
def rehearse(
    root: Annotated[
        Path, typer.Option(help="Rehearsal folder (kept: a second rehearsal ships the next phases).")
    ] = Path("rehearsal"),
    phases: Annotated[int, typer.Option(help="Phases to ship.", min=1)] = 2,
    milvus_binaries: Annotated[
        Path | None, typer.Option(help="Folder to unpack Milvus's binaries into (default: in --root).")
    ] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Delete the rehearsal folder first (only one a rehearsal made).")
    ] = False,
) -> None:
    """Rehearse the cluster here (as root): compile the pipeline from the cluster config pointed at a Milvus
    standalone and an MLflow server on loopback, run its tasks from the compiled YAML as the images' user
    (uid 10001) with the config and feature repo read-only, ship PHASES phases, then status, search and
    lineage --check. What a rehearsal cannot show: README, "Running on Kubeflow"."""
    from components.adapters import milvus_server
    from pipelines.rehearsal import RehearsalError, claim_root
    from pipelines.rehearsal import rehearse as run_rehearsal

    if os.geteuid() != 0:
        fail(
            "the rehearsal runs as root: it makes a private network namespace, root-owned read-only inputs "
            "and runs the tasks as the images' user, uid 10001 (e.g. `sudo make rehearse`)"
        )
    with refusing(RehearsalError):
        root = claim_root(root, fresh=fresh)
    if not milvus_server.loopback_only():
        milvus_server.enter_private_network()
    with refusing(RehearsalError, code=1):
        outcome = run_rehearsal(root, phases=phases, milvus_binaries=milvus_binaries, echo=typer.echo)
    verdict = "rehearsal passed" if outcome.ok else "REHEARSAL FAILED"
    typer.echo(f"\n{outcome.table()}\n\n{verdict}; logs and rehearsal.json in {root}")
    if not outcome.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(pipeline_app, name="pipeline")
