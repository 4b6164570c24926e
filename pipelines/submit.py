"""The Kubeflow Pipelines API requests that start the compiled pipeline: one run, or a recurring run.

``compatflow pipeline submit`` and ``compatflow pipeline schedule`` (:mod:`pipelines.commands.pipeline`) send
them through ``kfp.Client``. Every request body is built here as plain JSON from the compiled package
(:func:`load_package`) and handed as it is to the client's generated v2beta1 services (``client.runs``,
``client.recurring_runs``, ``client.experiments``, ``client.healthzs``), so a dry run (:func:`submit_plan`,
:func:`schedule_plan`) prints exactly the bodies a real call sends, without importing kfp. The client's
convenience methods are not used: they round-trip the package through protobuf (a body only kfp can predict),
print links on stdout, and ``create_recurring_run`` cannot see a schedule of the same name.

A recurring run carries the pipeline spec itself, not a reference to an uploaded pipeline version: each tick
runs exactly the package that was scheduled, and a recompiled package takes effect when it is scheduled again
with ``replace``. One schedule per name and experiment (a second one is refused unless it replaces the first),
so ``max_concurrency`` 1 means one cycle at a time on the workspace. KFP reads cron with a leading seconds
field (robfig/cron v1: five fields would be read as seconds to month); :func:`kfp_cron` takes the standard
five fields and adds it.

Importable without kfp (the dry run); :class:`KfpApi` imports it when a request is really sent. Cheap to
import (the command line reads its defaults at start-up): PyYAML too is imported where a package is read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

API = "/apis/v2beta1"
NAMESPACE = "compatflow"  # KFP's namespace for the runs (a profile namespace in multi-user Kubeflow)
EXPERIMENT = "compatflow"
SERVICE_ACCOUNT = "compatflow-pipeline-runner"  # manifests/k8s/base: serviceaccounts.yaml, rbac.yaml
SCHEDULE_NAME = "compatflow-weekly-upgrade"
WEEKLY = "0 3 * * 1"  # Mondays 03:00 in the scheduler's time zone (UTC unless KFP's controller sets another)
MAX_CONCURRENCY = 1  # never two cycles on one workspace at once
# Each tick: the next pending phase, the KFP job name as run id (a fixed one would reuse one run folder).
SCHEDULE_PARAMETERS: dict[str, Any] = {"phase": -1, "run_id": ""}
EXPERIMENT_ID = "<experiment id>"  # in a dry run: the experiment's ID, known once it is looked up or created
TIMEOUT_S = 30  # per request
TOKEN_ENV = "COMPATFLOW_KFP_TOKEN"

_EQUALS = 1  # KFP filter operation EQUALS (as kfp.Client sends it)
_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?-]+$")
_TYPES: dict[str, tuple[type, ...]] = {
    "STRING": (str,),
    "NUMBER_INTEGER": (int,),
    "NUMBER_DOUBLE": (int, float),
    "BOOLEAN": (bool,),
    "STRUCT": (dict,),
    "LIST": (list,),
}


class SubmitError(Exception):
    """A request that cannot be built, or that the KFP API did not take; the message says what to do."""


@dataclass(frozen=True)
class Package:
    """A compiled pipeline (``compatflow compile``): its name, the ``pipeline_spec`` value of a request (the
    pipeline spec, with its Kubernetes platform spec when it has one, as kfp.Client sends it) and the
    parameters its root takes."""

    path: Path
    name: str
    spec: dict[str, Any]
    parameters: dict[str, dict[str, Any]]


def load_package(path: Path) -> Package:
    """Read a compiled pipeline package (YAML); :class:`SubmitError` naming the file when it is missing or is
    not one."""
    import yaml  # here: the command line imports this module's defaults at start-up

    path = Path(path)
    redo = "run `compatflow compile --config cluster` (it writes pipelines/compiled/continual_upgrade.yaml)"
    if not path.is_file():
        raise SubmitError(f"no compiled pipeline at {path}: {redo}, or give --package")
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: a 180 KB package in 0.1 s, not 1 s
        docs = [doc for doc in yaml.load_all(path.read_text(), Loader=loader) if doc]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise SubmitError(f"{path} cannot be read as a compiled pipeline ({err}): {redo}") from err
    if not docs or not all(isinstance(d, dict) for d in docs) or not {"pipelineInfo", "root"} <= set(docs[0]):
        raise SubmitError(f"{path} is not a compiled KFP pipeline (no pipelineInfo and root): {redo}")
    pipeline, platform = docs[0], {}
    for doc in docs[1:]:
        platform.update(doc)
    spec = {"pipeline_spec": pipeline, "platform_spec": platform} if platform else pipeline
    parameters = pipeline["root"].get("inputDefinitions", {}).get("parameters", {})
    return Package(path, str(pipeline["pipelineInfo"].get("name", "")), spec, parameters)


def check_parameters(package: Package, parameters: dict[str, Any]) -> None:
    """Refuse parameters the package does not take or of the wrong type, and missing required ones."""
    errors = []
    for name, value in parameters.items():
        spec = package.parameters.get(name)
        if spec is None:
            errors.append(f"it takes no parameter {name!r} (it takes {sorted(package.parameters)})")
            continue
        kind = spec.get("parameterType", "")
        types = _TYPES.get(kind)
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            errors.append(f"parameter {name!r}: {value!r} is not a {kind}")
    missing = [
        name
        for name, spec in package.parameters.items()
        if name not in parameters and "defaultValue" not in spec and not spec.get("isOptional")
    ]
    if missing:
        errors.append(f"parameters {missing} have no default and are not given")
    if errors:
        raise SubmitError(
            f"{package.path}: " + "; ".join(errors) + " (a package older than this command: recompile it "
            "with `compatflow compile`)"
        )


def kfp_cron(cron: str) -> str:
    """KFP's six-field cron (a leading seconds field) for a standard five-field expression."""
    fields = cron.split()
    if len(fields) != 5 or not all(_CRON_FIELD.match(f) for f in fields):
        raise SubmitError(
            f"--cron {cron!r}: give five fields, minute hour day-of-month month day-of-week (e.g. "
            f"{WEEKLY!r}: Mondays 03:00); KFP receives them with a leading seconds field"
        )
    return "0 " + " ".join(fields)


def api_host(host: str) -> str:
    """The KFP API's base URL, checked: a scheme and a host, no trailing slash."""
    parts = urlsplit(host)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SubmitError(
            f"--host {host!r}: give the KFP API's URL with its scheme, e.g. http://127.0.0.1:8888 after "
            "`kubectl -n kubeflow port-forward svc/ml-pipeline 8888:8888`"
        )
    return host.rstrip("/")


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [{"operation": _EQUALS, "key": "display_name", "stringValue": name}]})


def experiment_query(name: str, namespace: str) -> dict[str, Any]:
    return {"filter": _name_filter(name), "namespace": namespace, "page_size": 2}


def experiment_body(name: str, namespace: str) -> dict[str, Any]:
    return {"display_name": name, "namespace": namespace}


def run_body(
    package: Package, *, name: str, experiment_id: str, parameters: dict[str, Any], service_account: str
) -> dict[str, Any]:
    check_parameters(package, parameters)
    return {
        "display_name": name,
        "experiment_id": experiment_id,
        "pipeline_spec": package.spec,
        "runtime_config": {"parameters": parameters},
        "service_account": service_account,
    }


def recurring_run_query(name: str, experiment_id: str) -> dict[str, Any]:
    return {"filter": _name_filter(name), "experiment_id": experiment_id, "page_size": 100}


def recurring_run_body(
    package: Package, *, name: str, description: str, experiment_id: str, cron: str, service_account: str
) -> dict[str, Any]:
    parameters = dict(SCHEDULE_PARAMETERS)
    check_parameters(package, parameters)
    return {
        "display_name": name,
        "description": description,
        "experiment_id": experiment_id,
        "mode": "ENABLE",
        "trigger": {"cron_schedule": {"cron": kfp_cron(cron)}},
        "max_concurrency": MAX_CONCURRENCY,
        "no_catchup": True,
        "pipeline_spec": package.spec,
        "runtime_config": {"parameters": parameters},
        "service_account": service_account,
    }


def _request(
    method: str, path: str, *, query: dict | None = None, body: dict | None = None, when: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"method": method, "path": API + path}
    if query is not None:
        out["query"] = query
    if body is not None:
        out["body"] = body
    if when is not None:
        out["when"] = when
    return out


def _experiment_requests(experiment: str, namespace: str) -> list[dict[str, Any]]:
    return [
        _request("GET", "/healthz"),
        _request("GET", "/experiments", query=experiment_query(experiment, namespace)),
        _request(
            "POST",
            "/experiments",
            body=experiment_body(experiment, namespace),
            when=f"no experiment named {experiment!r} exists",
        ),
    ]


def submit_plan(
    host: str,
    package: Package,
    *,
    name: str,
    parameters: dict[str, Any],
    experiment: str = EXPERIMENT,
    namespace: str = NAMESPACE,
    service_account: str = SERVICE_ACCOUNT,
) -> dict[str, Any]:
    """The requests :meth:`KfpApi.submit` sends, in order (``when``: only then)."""
    body = run_body(
        package,
        name=name,
        experiment_id=EXPERIMENT_ID,
        parameters=parameters,
        service_account=service_account,
    )
    return {
        "host": api_host(host),
        "package": str(package.path),
        "placeholders": {EXPERIMENT_ID: f"the ID of experiment {experiment!r}, looked up or created first"},
        "requests": [*_experiment_requests(experiment, namespace), _request("POST", "/runs", body=body)],
    }


def schedule_plan(
    host: str,
    package: Package,
    *,
    name: str = SCHEDULE_NAME,
    cron: str = WEEKLY,
    description: str = "",
    replace: bool = False,
    experiment: str = EXPERIMENT,
    namespace: str = NAMESPACE,
    service_account: str = SERVICE_ACCOUNT,
) -> dict[str, Any]:
    """The requests :meth:`KfpApi.schedule` sends, in order (``when``: only then)."""
    body = recurring_run_body(
        package,
        name=name,
        description=description,
        experiment_id=EXPERIMENT_ID,
        cron=cron,
        service_account=service_account,
    )
    found = f"recurring runs named {name!r} in the experiment"
    requests = [
        *_experiment_requests(experiment, namespace),
        _request(
            "GET",
            "/recurringruns",
            query=recurring_run_query(name, EXPERIMENT_ID),
            when=None if replace else f"always; any {found} stops here (give --replace to replace them)",
        ),
        _request("POST", "/recurringruns", body=body),
    ]
    if replace:
        requests.append(
            _request("DELETE", "/recurringruns/<id>", when=f"for each of the {found} listed above")
        )
    return {
        "host": api_host(host),
        "package": str(package.path),
        "placeholders": {
            EXPERIMENT_ID: f"the ID of experiment {experiment!r}, looked up or created first",
            "<id>": "the ID of a recurring run found by the listing",
        },
        "requests": requests,
    }


class KfpApi:
    """``kfp.Client`` on ``host``; each request's failure becomes a :class:`SubmitError` naming the host, what
    was asked and what to do."""

    def __init__(self, host: str, *, namespace: str = NAMESPACE, token: str | None = None) -> None:
        import warnings

        self.host = api_host(host)
        self.namespace = namespace
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "only works with KFP v2.0.0-beta.2 and later"
            import kfp

            self.client = self._call(
                "the client's start", kfp.Client, host=self.host, namespace=namespace, existing_token=token
            )

    def _call(self, what: str, function: Any, **kwargs: Any) -> Any:
        import urllib3
        from kfp_server_api import ApiException

        try:
            return function(**kwargs)
        except ApiException as err:
            hint = {
                401: f"; give a token the KFP API accepts with --token (or ${TOKEN_ENV})",
                403: f"; the token (--token, ${TOKEN_ENV}) may not do this in namespace {self.namespace!r}",
                404: "; is --host the KFP API (Service ml-pipeline, port 8888), not its UI?",
            }.get(err.status, "")
            detail = str(err.body or "").strip().replace("\n", " ")[:300]
            raise SubmitError(
                f"the KFP API at {self.host} refused {what}: HTTP {err.status} {err.reason}: {detail}{hint}"
            ) from err
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise SubmitError(
                f"cannot reach the KFP API at {self.host} ({what}): {err}; check --host (with kubectl: "
                "`kubectl -n kubeflow port-forward svc/ml-pipeline 8888:8888`, then --host http://127.0.0.1:8888)"
            ) from err

    def _send(self, what: str, function: Any, **kwargs: Any) -> Any:
        """One request through a generated v2beta1 service of the client."""
        return self._call(what, function, _request_timeout=TIMEOUT_S, **kwargs)

    def experiment_id(self, name: str) -> str:
        """Check the API answers, then the ID of experiment ``name``, created when there is none."""
        self._send("the health check", self.client.healthzs.healthz_service_get_healthz)
        listing = self._send(
            "the experiment lookup",
            self.client.experiments.experiment_service_list_experiments,
            **experiment_query(name, self.namespace),
        )
        if listing.experiments:
            return listing.experiments[0].experiment_id
        created = self._send(
            "creating the experiment",
            self.client.experiments.experiment_service_create_experiment,
            experiment=experiment_body(name, self.namespace),
        )
        return created.experiment_id

    def submit(
        self, package: Package, *, name: str, parameters: dict[str, Any], experiment: str, **options: Any
    ):
        """Start one run of ``package``; returns ``(run id, experiment id)``."""
        body = run_body(package, name=name, experiment_id=EXPERIMENT_ID, parameters=parameters, **options)
        experiment_id = self.experiment_id(experiment)
        run = self._send(
            "creating the run",
            self.client.runs.run_service_create_run,
            run={**body, "experiment_id": experiment_id},
        )
        return run.run_id, experiment_id

    def schedule(
        self,
        package: Package,
        *,
        name: str,
        cron: str,
        description: str,
        replace: bool,
        experiment: str,
        **options: Any,
    ):
        """Create the recurring run of ``package`` (replacing the ones of the same name when ``replace``);
        returns ``(recurring run id, experiment id, replaced ids)``."""
        body = recurring_run_body(
            package, name=name, description=description, experiment_id=EXPERIMENT_ID, cron=cron, **options
        )
        experiment_id = self.experiment_id(experiment)
        listing = self._send(
            "the recurring-run lookup",
            self.client.recurring_runs.recurring_run_service_list_recurring_runs,
            **recurring_run_query(name, experiment_id),
        )
        existing = [r.recurring_run_id for r in listing.recurring_runs or []]
        if existing and not replace:
            raise SubmitError(
                f"experiment {experiment!r} already has a recurring run named {name!r} "
                f"({', '.join(existing)}): give --replace to replace it (two schedules would run the cycle "
                "twice), or another --name"
            )
        created = self._send(
            "creating the recurring run",
            self.client.recurring_runs.recurring_run_service_create_recurring_run,
            recurring_run={**body, "experiment_id": experiment_id},
        )
        for old in existing:  # after the new one exists: never a moment without a schedule
            self._send(
                f"deleting the replaced recurring run {old}",
                self.client.recurring_runs.recurring_run_service_delete_recurring_run,
                recurring_run_id=old,
            )
        return created.recurring_run_id, experiment_id, existing
