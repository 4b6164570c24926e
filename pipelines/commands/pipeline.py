"""``compatflow pipeline submit`` / ``schedule``: the compiled pipeline started on Kubeflow Pipelines;
``compatflow pipeline rehearse``: the same package run here against local servers of the cluster's kinds."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines.commands._common import exit_codes
from pipelines.submit import (
    EXPERIMENT,
    NAMESPACE,
    SCHEDULE_NAME,
    SERVICE_ACCOUNT,
    TOKEN_ENV,
    WEEKLY,
)

pipeline_app = typer.Typer(
    help="Start the compiled pipeline (compatflow compile) on Kubeflow Pipelines: once, or on a schedule.",
    no_args_is_help=True,
)

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
    Path | None,
    typer.Option("--package", help="Compiled pipeline (default: pipelines/compiled/continual_upgrade.yaml)."),
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
    bool,
    typer.Option("--dry-run", help="Print the requests as JSON, in order, and send nothing."),
]


def _package(path: Path | None) -> Any:
    from pipelines.compile import COMPILED_DIR, COMPILED_NAME
    from pipelines.submit import load_package

    return load_package(path or COMPILED_DIR / COMPILED_NAME)


@pipeline_app.command("submit")
@exit_codes(
    {
        0: "the run started (its ID printed), or --dry-run printed the request",
        1: "the KFP API refused the request or could not be reached",
    }
)
def submit(
    host: HostOpt,
    phase: Annotated[
        int | None, typer.Option("--phase", help="Run this phase (default: the next pending one).")
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            help="Run id (default: the KFP job name). A failed run's id resumes it: its finished cached "
            "steps are skipped.",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Run name shown by KFP.")] = None,
    package: PackageOpt = None,
    experiment: ExperimentOpt = EXPERIMENT,
    namespace: NamespaceOpt = NAMESPACE,
    service_account: AccountOpt = SERVICE_ACCOUNT,
    token: TokenOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Start one run of the compiled pipeline; prints the run's ID."""
    from pipelines.commands._common import echo_json, fail
    from pipelines.submit import KfpApi, SubmitError, submit_plan

    parameters: dict[str, Any] = {}
    if phase is not None:
        parameters["phase"] = phase
    if run_id is not None:
        parameters["run_id"] = run_id
    try:
        compiled = _package(package)
        name = name or f"{compiled.name} {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H-%M-%S}"
        options = {"experiment": experiment, "service_account": service_account}
        plan = submit_plan(host, compiled, name=name, parameters=parameters, namespace=namespace, **options)
    except SubmitError as err:
        fail(str(err))
    if dry_run:
        echo_json(plan)
        return
    try:
        api = KfpApi(host, namespace=namespace, token=token)
        run, experiment_id = api.submit(compiled, name=name, parameters=parameters, **options)
    except SubmitError as err:
        fail(str(err), code=1)
    typer.echo(
        f"run {run} started in experiment {experiment!r} ({experiment_id}): {api.host}/#/runs/details/{run}"
    )


@pipeline_app.command("schedule")
@exit_codes(
    {
        0: "scheduled, or --dry-run printed the request",
        1: "the KFP API refused the request or could not be reached",
    }
)
def schedule(
    host: HostOpt,
    cron: Annotated[
        str,
        typer.Option(
            "--cron",
            help="Five-field cron: minute hour day-of-month month day-of-week, in the KFP scheduler's time "
            "zone (UTC unless set otherwise).",
        ),
    ] = WEEKLY,
    name: Annotated[
        str, typer.Option("--name", help="Recurring run name (one per experiment).")
    ] = SCHEDULE_NAME,
    description: Annotated[
        str, typer.Option("--description", help="Description shown by KFP.")
    ] = "Weekly continual upgrade on the newest data phase (validate to rollout).",
    replace: Annotated[
        bool,
        typer.Option(
            "--replace", help="Replace the recurring run of the same name (e.g. after a recompile)."
        ),
    ] = False,
    package: PackageOpt = None,
    experiment: ExperimentOpt = EXPERIMENT,
    namespace: NamespaceOpt = NAMESPACE,
    service_account: AccountOpt = SERVICE_ACCOUNT,
    token: TokenOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Schedule the compiled pipeline: one run per cron tick, at most one at a time, no catch-up.

    Each tick runs the next pending phase. The recurring run carries the package as it is now: after a
    recompile, schedule again with --replace.
    """
    from pipelines.commands._common import echo_json, fail
    from pipelines.submit import KfpApi, SubmitError, schedule_plan

    options = {"experiment": experiment, "service_account": service_account}
    try:
        compiled = _package(package)
        plan = schedule_plan(
            host,
            compiled,
            name=name,
            cron=cron,
            description=description,
            replace=replace,
            namespace=namespace,
            **options,
        )
    except SubmitError as err:
        fail(str(err))
    if dry_run:
        echo_json(plan)
        return
    try:
        api = KfpApi(host, namespace=namespace, token=token)
        created, experiment_id, replaced = api.schedule(
            compiled, name=name, cron=cron, description=description, replace=replace, **options
        )
    except SubmitError as err:
        fail(str(err), code=1)
    if replaced:
        typer.echo(f"replaced recurring run(s) {', '.join(replaced)}")
    typer.echo(
        f"recurring run {created} ({name!r}, cron {cron!r}) in experiment {experiment!r} ({experiment_id}): "
        f"{api.host}/#/recurringrun/details/{created}"
    )


@pipeline_app.command("rehearse")
@exit_codes({1: "a step of the rehearsal failed"})
def rehearse(
    root: Annotated[
        Path,
        typer.Option("--root", help="Rehearsal folder (kept: a second rehearsal ships the next phases)."),
    ] = Path("rehearsal"),
    phases: Annotated[int, typer.Option("--phases", help="Phases to ship.", min=1)] = 2,
    milvus_binaries: Annotated[
        Path | None,
        typer.Option(
            "--milvus-binaries", help="Folder to unpack Milvus's binaries into (default: in --root)."
        ),
    ] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Delete the rehearsal folder first (only one a rehearsal made).")
    ] = False,
) -> None:
    """Rehearse the cluster here (as root): compile the pipeline from the cluster config pointed at a Milvus
    standalone and an MLflow server on loopback, run its tasks from the compiled YAML as the images' user
    (uid 10001) with the config and feature repo read-only, ship PHASES phases, then status, search and
    lineage --check. What a rehearsal cannot show: README, "Running on Kubeflow"."""
    import os

    from components.adapters import milvus_server
    from pipelines.commands._common import fail
    from pipelines.rehearsal import RehearsalError, claim_root
    from pipelines.rehearsal import rehearse as run_rehearsal

    if os.geteuid() != 0:
        fail(
            "the rehearsal runs as root: it makes a private network namespace, root-owned read-only inputs "
            "and runs the tasks as the images' user, uid 10001 (e.g. `sudo make rehearse`)"
        )
    try:
        root = claim_root(root, fresh=fresh)
    except RehearsalError as err:
        fail(str(err))
    if not milvus_server.loopback_only():
        milvus_server.enter_private_network()
    try:
        outcome = run_rehearsal(root, phases=phases, milvus_binaries=milvus_binaries, echo=typer.echo)
    except RehearsalError as err:
        fail(str(err), code=1)
    typer.echo("")
    typer.echo(outcome.table())
    typer.echo(
        f"\n{'rehearsal passed' if outcome.ok else 'REHEARSAL FAILED'}; logs and rehearsal.json in {root}"
    )
    if not outcome.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(pipeline_app, name="pipeline")
