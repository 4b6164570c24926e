"""The Kubeflow Pipelines API requests that start the compiled pipeline: one run, or a recurring run.

The package is uploaded as a pipeline version named by its sha256, then a run or recurring run of it starts.
:func:`send_all` lays the requests out once: ``--dry-run`` (:func:`plan`) records them, :class:`KfpApi` sends
them through kfp.Client's generated v2beta1 services (its convenience methods print links on stdout and
``create_recurring_run`` cannot see a schedule of the same name). kfp and PyYAML are imported where used:
the command line reads this module's defaults at start-up.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
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
# In a dry run: the IDs the server answers, known once looked up or created.
EXPERIMENT_ID, PIPELINE_ID, VERSION_ID, OLD_ID = "<experiment id>", "<pipeline id>", "<version id>", "<id>"
TIMEOUT_S = 30  # per request
TOKEN_ENV = "COMPATFLOW_KFP_TOKEN"

_EQUALS = 1  # KFP filter operation EQUALS (as kfp.Client sends it)
_TYPES: dict[str, tuple[type, ...]] = {
    "STRING": (str,),
    "NUMBER_INTEGER": (int,),
    "NUMBER_DOUBLE": (int, float),
    "BOOLEAN": (bool,),
    "STRUCT": (dict,),
    "LIST": (list,),
}
# KFP's cron (robfig/cron): seconds first; names and ranges per field; 0 is Sunday and 7 is out of range.
_CRON_FIELDS = (
    ("second", 0, 59, ()),
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    ("day of week", 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)
CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


class SubmitError(Exception):
    """A request that cannot be built, or that the KFP API did not take; the message says what to do."""


@dataclass(frozen=True)
class Package:
    """A compiled pipeline (``compatflow compile``): file, name, sha256 and the parameters its root takes."""

    path: Path
    name: str
    sha256: str
    parameters: dict[str, dict[str, Any]]
    images: tuple[str, ...] = ()  # what its tasks run

    @property
    def version_name(self) -> str:
        """The pipeline version this package is uploaded as: one per distinct package."""
        return f"{self.name}-{self.sha256[:12]}"


def load_package(path: Path) -> Package:
    """Read a compiled pipeline package (YAML); :class:`SubmitError` naming the file when it is not one."""
    import yaml  # here: the command line imports this module's defaults at start-up

    path = Path(path)
    redo = "run `compatflow compile --config cluster` (it writes pipelines/compiled/continual_upgrade.yaml)"
    if not path.is_file():
        raise SubmitError(f"no compiled pipeline at {path}: {redo}, or give --package")
    try:
        raw = path.read_bytes()
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: a 180 KB package in 0.1 s, not 1 s
        docs = [doc for doc in yaml.load_all(raw.decode(), Loader=loader) if doc]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise SubmitError(f"{path} cannot be read as a compiled pipeline ({err}): {redo}") from err
    if not docs or not all(isinstance(d, dict) for d in docs) or not {"pipelineInfo", "root"} <= set(docs[0]):
        raise SubmitError(f"{path} is not a compiled KFP pipeline (no pipelineInfo and root): {redo}")
    parameters = docs[0]["root"].get("inputDefinitions", {}).get("parameters", {})
    name = str(docs[0]["pipelineInfo"].get("name", ""))
    executors = docs[0].get("deploymentSpec", {}).get("executors", {}).values()
    images = tuple(sorted({str(e.get("container", {}).get("image")) for e in executors if "container" in e}))
    return Package(path, name, hashlib.sha256(raw).hexdigest(), parameters, images)


def check_images(package: Package) -> None:
    """Refuse a package whose tasks name an image by tag alone: a tag can move before a task starts."""
    loose = [image for image in package.images if "@sha256:" not in image]
    if loose:
        raise SubmitError(
            f"{package.path} runs {', '.join(loose)} by tag only: pin the images by digest when compiling, "
            "with the digests the image push printed: `compatflow compile --config cluster --digest "
            "cpu=sha256:<64 hex> --digest gpu=sha256:<64 hex>` (or name them REGISTRY/NAME:TAG@sha256:DIGEST "
            "in the config's resources.cpu.image and resources.gpu.image)"
        )


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


def parse_parameters(package: Package, assignments: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs as run parameters: VALUE as it is for a STRING parameter, else read as JSON."""
    parameters: dict[str, Any] = {}
    for assignment in assignments:
        name, equals, text = assignment.partition("=")
        if not equals or not name:
            raise SubmitError(
                f"--param {assignment!r}: give NAME=VALUE (parameters: {sorted(package.parameters)})"
            )
        kind = package.parameters.get(name, {}).get("parameterType")
        try:
            parameters[name] = text if kind == "STRING" else json.loads(text)
        except json.JSONDecodeError:
            raise SubmitError(f"--param {assignment!r}: {text!r} is not a {kind} (JSON)") from None
    check_parameters(package, parameters)
    return parameters


def kfp_cron(cron: str) -> str:
    """``cron`` as KFP reads it (six fields, seconds first; five get ``0`` seconds), each field checked."""
    text = " ".join(cron.split())
    if text in CRON_DESCRIPTORS:
        return text
    fields = text.split(" ")
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise SubmitError(
            f"--cron {cron!r}: give five fields (minute hour day-of-month month day-of-week, e.g. "
            f"{WEEKLY!r}: Mondays 03:00), six with seconds first as KFP takes them, or one of "
            f"{', '.join(CRON_DESCRIPTORS)}"
        )
    for value, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        if problem := _cron_field_problem(value.upper(), low, high, names, name.startswith("day of")):
            raise SubmitError(f"--cron {cron!r}: {name} {value!r}: {problem} ({name}: {low}-{high})")
    return " ".join(fields)


def _cron_field_problem(
    value: str, low: int, high: int, names: tuple[str, ...], may_skip: bool
) -> str | None:
    """Why one cron field is wrong, or None: ``*``, ``?`` (day fields), lists, names, ``A-B``, ``/step``."""
    for part in value.split(","):
        span, _, step = part.partition("/")
        if step and not (step.isdigit() and int(step) >= 1):
            return f"step {step!r} is not a positive number"
        if span in ("*", "?"):
            if span == "?" and not may_skip:
                return "'?' is for the day fields only"
            continue
        ends = span.split("-")
        if len(ends) > 2 or not all(ends):
            return f"{part!r} is not N, A-B, * or a step"
        numbers = [names.index(e) + low if e in names else int(e) if e.isdigit() else None for e in ends]
        if None in numbers:
            return f"{span!r} is not a number" + (f" or a name ({', '.join(names)})" if names else "")
        out = [n for n in numbers if not low <= n <= high]
        if out:
            return f"{out[0]} is out of range"
        if len(numbers) == 2 and numbers[0] > numbers[1]:
            return f"range {span!r} runs backwards"
    return None


def api_host(host: str) -> str:
    """The KFP API's base URL, checked: a scheme and a host, no trailing slash."""
    parts = urlsplit(host)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SubmitError(
            f"--host {host!r}: give the KFP API's URL with its scheme, e.g. http://127.0.0.1:8888 after "
            "`kubectl -n kubeflow port-forward svc/ml-pipeline 8888:8888`"
        )
    return host.rstrip("/")


@dataclass
class Job:
    """What to start: a run (``cron`` None) or a recurring run of ``package``, and where."""

    package: Package
    name: str
    parameters: dict[str, Any]
    experiment: str = EXPERIMENT
    namespace: str = NAMESPACE
    service_account: str = SERVICE_ACCOUNT
    cron: str | None = None
    description: str = ""
    replace: bool = False


@dataclass
class Request:
    """One API request as printed and the kfp.Client call (``service.method``) that sends it."""

    method: str
    path: str
    call: str
    query: dict[str, Any] | None = None
    body: dict[str, Any] | None = None
    file: str | None = None
    when: str | None = None
    body_arg: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    dry_answer: dict[str, Any] = field(default_factory=dict)  # what a dry run takes the server to answer

    def printed(self) -> dict[str, Any]:
        keys = ("method", "path", "query", "body", "file", "when")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


Send = Callable[[Request], dict[str, Any]]


def send_all(send: Send, job: Job) -> dict[str, Any]:
    """Send ``job``'s requests through ``send``, each built from the answers before it; returns the IDs."""
    package = job.package
    check_images(package)
    check_parameters(package, job.parameters)
    cron = kfp_cron(job.cron) if job.cron is not None else None
    send(Request("GET", "/healthz", "healthzs.healthz_service_get_healthz"))
    experiment_id = _ensure(
        send,
        "experiments",
        job.experiment,
        Request(
            "POST",
            "/experiments",
            "experiments.experiment_service_create_experiment",
            body={"display_name": job.experiment, "namespace": job.namespace},
            body_arg="experiment",
            dry_answer={"experiment_id": EXPERIMENT_ID},
        ),
        namespace=job.namespace,
    )
    pipeline_id = _ensure(
        send,
        "pipelines",
        package.name,
        Request(
            "POST",
            "/pipelines",
            "pipelines.pipeline_service_create_pipeline",
            body={"name": package.name, "display_name": package.name, "namespace": job.namespace},
            body_arg="pipeline",
            dry_answer={"pipeline_id": PIPELINE_ID},
        ),
        namespace=job.namespace,
    )
    version = package.version_name
    version_id = _ensure(
        send,
        "pipeline_versions",
        version,
        Request(
            "POST",
            "/pipelines/upload_version",
            "pipeline_uploads.upload_pipeline_version",
            query={
                "name": version,
                "display_name": version,
                "pipelineid": pipeline_id,
                "description": f"{package.path.name}, sha256 {package.sha256}",
            },
            file=str(package.path),
            dry_answer={"pipeline_version_id": VERSION_ID},
        ),
        pipeline_id=pipeline_id,
    )
    common = {
        "display_name": job.name,
        "experiment_id": experiment_id,
        "pipeline_version_reference": {"pipeline_id": pipeline_id, "pipeline_version_id": version_id},
        "service_account": job.service_account,
    }
    ids = {"experiment_id": experiment_id, "pipeline_id": pipeline_id, "pipeline_version_id": version_id}
    if cron is None:
        body = {**common, "runtime_config": {"parameters": job.parameters}}
        run = send(Request("POST", "/runs", "runs.run_service_create_run", body=body, body_arg="run"))
        return {**ids, "run_id": run.get("run_id", "<run id>")}
    return {**ids, **_schedule(send, job, common, cron, experiment_id)}


def _schedule(send: Send, job: Job, common: dict[str, Any], cron: str, experiment_id: str) -> dict[str, Any]:
    """The recurring run: listed first (one per name), created, then the ones it replaces deleted."""
    found = f"recurring runs named {job.name!r} in the experiment"
    listing = send(
        Request(
            "GET",
            "/recurringruns",
            "recurring_runs.recurring_run_service_list_recurring_runs",
            query={"filter": _name_filter(job.name), "experiment_id": experiment_id, "page_size": 100},
            when=None if job.replace else f"always; any {found} stops here (give --replace to replace them)",
            dry_answer={"recurring_runs": [{"recurring_run_id": OLD_ID}]} if job.replace else {},
        )
    )
    existing = [r["recurring_run_id"] for r in listing.get("recurring_runs") or []]
    if existing and not job.replace:
        raise SubmitError(
            f"experiment {job.experiment!r} already has a recurring run named {job.name!r} "
            f"({', '.join(existing)}): give --replace to replace it (two schedules would run the cycle "
            "twice), or another --name"
        )
    body = {
        **common,
        "description": job.description,
        "mode": "ENABLE",
        "trigger": {"cron_schedule": {"cron": cron}},
        "max_concurrency": MAX_CONCURRENCY,
        "no_catchup": True,
        "runtime_config": {"parameters": {**SCHEDULE_PARAMETERS, **job.parameters}},
    }
    created = send(
        Request(
            "POST",
            "/recurringruns",
            "recurring_runs.recurring_run_service_create_recurring_run",
            body=body,
            body_arg="recurring_run",
        )
    )
    for old in existing:  # after the new one exists: never a moment without a schedule
        send(
            Request(
                "DELETE",
                f"/recurringruns/{old}",
                "recurring_runs.recurring_run_service_delete_recurring_run",
                args={"recurring_run_id": old},
                when=f"for each of the {found} listed above",
            )
        )
    return {"recurring_run_id": created.get("recurring_run_id", "<recurring run id>"), "replaced": existing}


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [{"operation": _EQUALS, "key": "display_name", "stringValue": name}]})


_LISTS = {  # what a lookup lists: path, kfp.Client call, the ID's key in an item
    "experiments": ("/experiments", "experiments.experiment_service_list_experiments", "experiment_id"),
    "pipelines": ("/pipelines", "pipelines.pipeline_service_list_pipelines", "pipeline_id"),
    "pipeline_versions": (
        "/pipelines/{pipeline_id}/versions",
        "pipelines.pipeline_service_list_pipeline_versions",
        "pipeline_version_id",
    ),
}


def _ensure(send: Send, kind: str, name: str, create: Request, **scope: str) -> str:
    """The ID of the ``kind`` named ``name`` in ``scope``: looked up, else made by ``create``."""
    path, call, key = _LISTS[kind]
    args = {k: v for k, v in scope.items() if "{" + k + "}" in path}
    query = {"filter": _name_filter(name), **{k: scope[k] for k in scope if k not in args}, "page_size": 2}
    items = send(Request("GET", path.format(**args), call, query=query, args=args)).get(kind) or []
    if items:
        return str(items[0][key])
    create.when = f"no {kind[:-1].replace('_', ' ')} named {name!r} exists"
    return str(send(create)[key])


def plan(host: str, job: Job) -> dict[str, Any]:
    """What :func:`send_all` sends, without sending it (the server's IDs as placeholders)."""
    requests: list[Request] = []

    def record(request: Request) -> dict[str, Any]:
        requests.append(request)
        return request.dry_answer

    send_all(record, job)
    return {
        "host": api_host(host),
        "package": str(job.package.path),
        "placeholders": {
            EXPERIMENT_ID: f"the ID of experiment {job.experiment!r}, looked up or created first",
            PIPELINE_ID: f"the ID of pipeline {job.package.name!r}, looked up or created",
            VERSION_ID: f"the ID of version {job.package.version_name!r}, looked up or uploaded",
            **({OLD_ID: "the ID of a recurring run found by the listing"} if job.replace else {}),
        },
        "requests": [{**r.printed(), "path": API + r.path} for r in requests],
    }


class KfpApi:
    """``kfp.Client`` on ``host``; a failed request becomes a :class:`SubmitError` saying what to do."""

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

    def send(self, request: Request) -> dict[str, Any]:
        """One request through the client's generated v2beta1 service; the answer as a plain mapping."""
        service, method = request.call.split(".")
        kwargs = {**request.args, **(request.query or {})}
        if request.body is not None:
            kwargs[request.body_arg] = request.body
        if request.file is not None:
            kwargs["uploadfile"] = request.file
        what = f"{request.method} {API}{request.path}"
        answer = self._call(
            what, getattr(getattr(self.client, service), method), _request_timeout=TIMEOUT_S, **kwargs
        )
        return answer.to_dict() if hasattr(answer, "to_dict") else {}
