"""A rehearsal of the cluster on this machine: ``make rehearse`` (``compatflow pipeline rehearse``).

The compiled cluster package (sizes scaled to a CPU, :data:`SCALED`) runs under ``kfp.local`` against real
services of the cluster's kinds on loopback, with the pods' environment, read-only root-owned inputs and tasks
as the images' non-root user in a loopback-only network namespace. Not rehearsed: Kubernetes itself, the KFP
API server, the Training Operator and the object store; the gate passes any candidate (:data:`GATE_POLICY`),
so what is rehearsed is the path a passed candidate takes. Running again ships the next phases.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

import compat
from compat.models.integrity import file_manifest, manifest_digest
from components.adapters import milvus_server, mlflow_server
from components.deployment import Deployment
from components.runs import RunPlan, read_state
from components.state.run_dir import RUN_FILE, TASK_HOST_LOG
from components.state.workspace import SYSTEM_FOLDERS, Workspace
from pipelines.compile import COMPILED_NAME, compile_pipeline
from pipelines.config import CONFIG_DIR, generate_stream_of, load_config
from pipelines.warm_tasks import SHARED_ENV, SOCKET_NAME, start_host

# The images' user (manifests/docker/Dockerfile.*: USER 10001:10001; the manifests' runAsUser/runAsGroup).
TASK_UID = TASK_GID = 10001
TASK_USER = "compatflow"
PHASES = 2
STREAM_PHASES = 4
MARKER = ".compatflow-rehearsal"  # written into a rehearsal folder when a rehearsal makes it
CHECKOUT = Path(__file__).resolve().parents[1]
SEARCH_QUERY = "a red circle"

# The cluster config's sizes scaled to a 2-core CPU; everything else stays the cluster's.
SCALED: dict[str, dict[str, Any]] = {
    "stream": {
        "generate_if_missing": False,
        "phases": STREAM_PHASES,
        "samples_per_phase": 96,
        "eval_per_domain": 12,
        "gallery_per_domain": 16,
        "image_size": 64,
    },
    "drift": {"sample_size": 24},
    "training": {
        "model_config": "cf-tiny",
        "pretrained": None,
        "steps": 3,
        "batch_size": 16,
        "replay_buffer_size": 16,
        "replay_rows": 4,
        "device": "cpu",
        "loader_workers": 0,
    },
    "compat": {"foundation_config": "cf-tiny", "steps": 3, "batch_size": 16},
    # one stage, batches of 8: the stage's 32 items split into two rank ranges, one ParallelFor task each (a
    # second stage would rehearse the same fan-out again, at a minute a stage)
    "rollout": {"batch_size": 8, "workers": 2, "fractions": [1.0], "probe_tolerance": 100.0},
}
GATE_POLICY = """\
# The rehearsal's gate: any candidate passes (a few CPU steps cannot meet the shipped criterion; what is
# rehearsed is the path of a passed candidate: registration, the fanned-out backfill, lineage, promotion).
min_margin: -100.0
require_ci_lower_above_zero: false
min_eval_images: 1
min_eval_captions: 1
retention: {floor: 0.0}
"""


class RehearsalError(RuntimeError):
    """The rehearsal cannot run here, or a step of it failed; the message says which and what to do."""


class Layout:
    """The rehearsal's folders under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config_dir = root / "config"  # the ConfigMap volume: the config and the gate policy
        self.config_file = self.config_dir / "cluster.yaml"
        self.feature_repo = root / "feature-repo"  # the ConfigMap compatflow-feast-repo's volume
        self.stream = root / "stream"  # stands in for the object store's stream
        self.compiled = root / "compiled"
        self.workspace = root / "workspace"  # the shared ReadWriteMany volume
        self.object_store = root / "object-store"  # Feast's registry
        self.home = root / "home"  # the task user's HOME, TMPDIR and working folder
        self.services = root / "servers"
        self.logs = root / "logs"
        self.views = root / "views"  # root-owned views of the folders the task user cannot search
        self.read_only = (self.config_dir, self.feature_repo, self.stream, self.compiled)


@dataclass
class Step:
    """One step of the rehearsal: what ran, how long, whether it did what it should."""

    name: str
    seconds: float
    ok: bool
    detail: str = ""
    log: str = ""
    run_id: str = ""


@dataclass
class Outcome:
    root: str
    steps: list[Step] = field(default_factory=list)
    isolation: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)

    def table(self) -> str:
        width = max(len(step.name) for step in self.steps)
        lines = [f"{'step':<{width}}  {'s':>6}  result"]
        for step in self.steps:
            result = ("ok" if step.ok else "FAILED") + (f": {step.detail}" if step.detail else "")
            lines.append(f"{step.name:<{width}}  {step.seconds:6.1f}  {result}")
        return "\n".join(lines)


def rehearsal_config(layout: Layout, *, index_uri: str, tracking_uri: str) -> Deployment:
    """The shipped ``cluster.yaml`` scaled (:data:`SCALED`), pointed at this rehearsal's folders, servers."""
    cluster = load_config("cluster", local_paths=False, training=False)
    return cluster.with_changes(
        **{**SCALED, "stream": {**SCALED["stream"], "uri": str(layout.stream)}},
        name="cluster-rehearsal",
        workspace=str(layout.workspace),
        registry={"tracking_uri": tracking_uri},
        index={"uri": index_uri},
        lineage={"repo": str(layout.feature_repo)},
        gate={"policy": str(layout.config_dir / "gate-policy.yaml")},
    )


def task_environment(layout: Layout, *, index_uri: str, tracking_uri: str) -> dict[str, str]:
    """A task pod's whole environment: the images' ``ENV``, the ConfigMap and the Milvus Secret."""
    from pipelines import resources

    values = {
        "COMPATFLOW_CONFIG": str(layout.config_file),
        "COMPATFLOW_WORKSPACE": str(layout.workspace),
        "COMPATFLOW_STREAM_URI": str(layout.stream),
        "COMPATFLOW_MILVUS_URI": index_uri,
        "COMPATFLOW_TRACKING_URI": tracking_uri,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "COMPATFLOW_FEAST_REPO": str(layout.feature_repo),
        "COMPATFLOW_FEAST_SERVER_URL": "",  # no feature server is rehearsed
        "COMPATFLOW_FEAST_REGISTRY_PATH": str(layout.object_store / "feast-registry.pb"),
        "AWS_DEFAULT_REGION": "us-east-1",
        resources.MILVUS_SECRET_ENV["token"]: "",  # the rehearsal's Milvus has no authentication
    }
    missing = [key for key in resources.CONFIG_MAP_ENV if key not in values]
    if missing:
        raise RehearsalError(f"the rehearsal sets no value for the ConfigMap keys {missing}: add them here")
    return {**image_environment(layout), **values}


def image_environment(layout: Layout) -> dict[str, str]:
    """The images' ``ENV`` (``manifests/docker/Dockerfile.cpu``; a test keeps the keys equal), plus the
    user's name (uid 10001 has no entry in this machine's passwd; the image's has one)."""
    home = layout.home
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "HOME": str(home),
        "TMPDIR": str(home / "tmp"),
        "HF_HOME": str(home / "tmp" / "huggingface"),
        "XDG_CACHE_HOME": str(home / "tmp" / "cache"),
        "MPLCONFIGDIR": str(home / "tmp" / "matplotlib"),
        "TORCH_HOME": str(home / "tmp" / "torch"),
        "COMPATFLOW_CONFIG_DIR": str(layout.config_dir),
        "LANG": "C.UTF-8",  # the python base image's
        "USER": TASK_USER,
        "LOGNAME": TASK_USER,
    }


def feature_store_yaml() -> str:
    """The cluster's ``feature_store.yaml``: the data of the ConfigMap ``compatflow-feast-repo``."""
    manifest = CONFIG_DIR.parents[1] / "manifests/k8s/feast/configmap.yaml"
    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc and doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == "compatflow-feast-repo":
            return doc["data"]["feature_store.yaml"]
    raise RehearsalError(f"{manifest} has no ConfigMap compatflow-feast-repo")


def tree_digest(folder: Path) -> str:
    """A digest of every file's path and bytes under ``folder`` (:mod:`compat.models.integrity`)."""
    return manifest_digest(file_manifest(folder))


class Rehearsal:
    """One rehearsal folder: services, then prepare, ship and check (:func:`rehearse` does all of it)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        milvus_binaries: str | os.PathLike[str] | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.layout = Layout(Path(root).resolve())
        self.milvus_binaries = Path(milvus_binaries) if milvus_binaries else None
        self.echo = echo
        self.index_uri = ""
        self.tracking_uri = ""
        self.digests: dict[str, str] = {}
        self.task_socket = ""  # the warm task host every ship hands its tasks to (started by the first)
        self._services: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def services(self) -> Iterator[Rehearsal]:
        """Milvus standalone and an MLflow server on loopback; their data stays for the next rehearsal."""
        if not milvus_server.loopback_only():
            raise RehearsalError(
                "the rehearsal runs in a network namespace with loopback alone (Milvus 2.3 listens on every "
                "interface): `compatflow pipeline rehearse` makes one when run as root"
            )
        data = self.layout.services
        with contextlib.ExitStack() as stack:
            try:
                milvus = stack.enter_context(
                    milvus_server.start(data / "milvus", bin_dir=self.milvus_binaries, graceful_stop_s=3)
                )
                mlflow = stack.enter_context(mlflow_server.start(data / "mlflow"))
            except (milvus_server.MilvusServerError, mlflow_server.MlflowServerError) as err:
                raise RehearsalError(f"a service did not start: {err}") from err
            self.index_uri, self.tracking_uri = milvus.uri, mlflow.uri
            self.echo(f"services: Milvus standalone {milvus.uri}, MLflow {mlflow.uri}")
            self._services = stack
            yield self

    def prepare(self) -> Step:
        """Write the read-only inputs, compile the package, give the tasks their volume and home."""
        if not self.index_uri:
            raise RehearsalError("prepare() needs the services running (inside `with rehearsal.services()`)")
        started = time.monotonic()
        layout = self.layout
        config = rehearsal_config(layout, index_uri=self.index_uri, tracking_uri=self.tracking_uri)
        for folder in (layout.config_dir, layout.feature_repo, layout.compiled):
            if folder.exists():
                shutil.rmtree(folder)  # root: read-only modes do not stop it
            folder.mkdir(parents=True)
        layout.config_file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        (layout.config_dir / "gate-policy.yaml").write_text(GATE_POLICY)
        (layout.feature_repo / "feature_store.yaml").write_text(feature_store_yaml())
        if not (layout.stream / "stream.json").is_file():
            generate_stream_of(config.stream)
        package = compile_pipeline(layout.compiled, config=layout.config_file)
        for folder in layout.read_only:
            _own_tree(folder, 0, 0, read_only=True)
            self.digests[folder.name] = tree_digest(folder)
        for folder in (layout.workspace, layout.object_store, layout.home / "tmp", layout.logs):
            folder.mkdir(parents=True, exist_ok=True)
        make_views(layout)
        for folder in (layout.workspace, layout.object_store, layout.home):
            _own_tree(folder, TASK_UID, TASK_GID)
        self._reachable()
        return Step("prepare", time.monotonic() - started, True, f"compiled {package.name}")

    def _reachable(self) -> None:
        """The task user reads the config and the environment's Python; else say which folder blocks it."""
        probe = self._as_task_user([sys.executable, "-c", f"open({str(self.layout.config_file)!r}).read()"])
        if probe.returncode != 0:
            raise RehearsalError(
                f"uid {TASK_UID} cannot read {self.layout.config_file} with {sys.executable}: "
                "every folder above the rehearsal folder and the environment must be searchable by others "
                f"(chmod o+rx), e.g. a rehearsal folder under /tmp:\n{probe.stderr[-1500:]}"
            )

    def ship(self, *, run_id: str = "", stop_at: str | None = None) -> Step:
        """Run the package once as the task user, or resubmit ``run_id``; ``stop_at``: a node loss there."""
        before = read_state(self.layout.workspace).phases
        number = sum(1 for p in self.layout.logs.glob("ship-*.log")) + 1
        log = self.layout.logs / f"ship-{number}.log"
        package = str(self.layout.compiled / COMPILED_NAME)
        argv = [sys.executable, "-m", "pipelines.rehearsal", "ship", package, run_id]
        started = time.monotonic()
        self._start_task_host()
        with open(log, "w") as out:
            process = subprocess.Popen(
                [*task_launcher(self.layout), *argv],
                cwd=self.layout.home,
                env=self._task_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a stop kills the tasks with it
            )
            stopped = _stop_when_started(process, log, stop_at)
        seconds = time.monotonic() - started
        phase, run = self._newest_run()
        record = read_state(self.layout.workspace).phases.get(str(phase))
        name = f"ship {number}"
        if stopped:
            return Step(name, seconds, True, f"phase {phase}: stopped at {stop_at}", str(log), run)
        if record is None or record == before.get(str(phase)) or record.run_id != run:
            detail = f"no outcome recorded (exit {process.returncode})"
            return Step(name, seconds, False, detail, str(log), run)
        status, code = record.status, process.returncode
        detail = f"phase {phase}: {status}" + ("" if code == 0 else f" (exit {code})")
        return Step(name, seconds, code == 0 and status in ("succeeded", "rejected"), detail, str(log), run)

    def _start_task_host(self) -> None:
        """Once, as the task user: the warm host the ships hand their tasks to, its imports made once for
        them all (its log in ``logs/``); it lives as long as the services (their end closes its stdin)."""
        if self.task_socket or self._services is None:
            return
        socket_path = self.layout.home / "tmp" / SOCKET_NAME
        with open(self.layout.logs / TASK_HOST_LOG, "ab") as log:
            launch = task_launcher(self.layout)
            host = start_host(socket_path, log, launch=launch, cwd=self.layout.home, env=self._task_env())
        self._services.enter_context(host)
        self.task_socket = str(socket_path)

    def _newest_run(self) -> tuple[int, str]:
        """The phase and id of the run folder planned last (``runs/<id>/run.json``)."""
        plans = sorted(Workspace(self.layout.workspace).runs_dir.glob(f"*/{RUN_FILE}"), key=os.path.getmtime)
        plan = RunPlan.read(plans[-1]) if plans else None
        return (plan.phase, plan.run_id) if plan else (-1, "")

    def check(self) -> list[Step]:
        """``status``, ``search`` and ``lineage --check`` as the task user; the read-only inputs unchanged."""
        compatflow = str(Path(sys.executable).with_name("compatflow"))
        config = ["--config", str(self.layout.config_file)]
        commands = {
            "status": [compatflow, "status", *config],
            "search": [compatflow, "search", SEARCH_QUERY, "-k", "3", "--json", *config],
            "lineage --check": [compatflow, "lineage", "--check", *config],
        }
        steps = []
        for name, argv in commands.items():
            started = time.monotonic()
            done = self._as_task_user(argv)  # stdout alone is the answer (--json)
            log = self.layout.logs / f"{name.split()[0]}.log"
            log.write_text(done.stdout + done.stderr)
            last = (done.stdout.strip().splitlines() or [""])[-1].strip()[:120]
            detail = last if done.returncode == 0 else f"exit {done.returncode}"
            if name == "search" and done.returncode == 0:
                detail = f"{len(json.loads(done.stdout))} hits for {SEARCH_QUERY!r}"
            steps.append(Step(name, time.monotonic() - started, done.returncode == 0, detail, str(log)))
        started = time.monotonic()
        changed = [f.name for f in self.layout.read_only if tree_digest(f) != self.digests.get(f.name)]
        detail = (
            f"changed: {', '.join(changed)}" if changed else "config, feature repo, stream, package unchanged"
        )
        steps.append(Step("read-only inputs", time.monotonic() - started, not changed, detail))
        return steps

    def _task_env(self) -> dict[str, str]:
        env = task_environment(self.layout, index_uri=self.index_uri, tracking_uri=self.tracking_uri)
        return {**env, SHARED_ENV: self.task_socket} if self.task_socket else env

    def _as_task_user(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*task_launcher(self.layout), *argv],
            cwd=self.layout.home,
            env=self._task_env(),
            capture_output=True,
            text=True,
            check=False,
        )


@functools.cache
def unsearchable_folders(root: Path) -> dict[Path, tuple[str, ...]]:
    """Folders above Python, its packages or ``root`` that others cannot search (e.g. ``/root`` of a pyenv
    interpreter), deepest first, each with the names in it that lead there."""
    targets = [Path(path).resolve() for path in (sys.executable, sys.prefix, compat.__file__, root)]
    blocked: dict[Path, set[str]] = {}
    for target in targets:
        for folder in target.parents:
            if not folder.stat().st_mode & 0o001:
                blocked.setdefault(folder, set()).add(target.relative_to(folder).parts[0])
    deepest_first = sorted(blocked, key=lambda folder: (-len(folder.parts), str(folder)))
    return {folder: tuple(sorted(blocked[folder])) for folder in deepest_first}


def make_views(layout: Layout) -> None:
    """``views/N``: a searchable stand-in for the N-th unsearchable folder, with a mount point per name."""
    for n, (folder, names) in enumerate(unsearchable_folders(layout.root).items()):
        view = layout.views / str(n)
        view.mkdir(parents=True, exist_ok=True)
        for name in names:
            if (folder / name).is_dir():
                (view / name).mkdir(exist_ok=True)
            else:
                (view / name).touch()
        for path in (layout.views, view):
            path.chmod(0o755)


def task_launcher(layout: Layout) -> list[str]:
    """``setpriv`` to the images' uid and gid with no groups and no capability; where Python lies in an
    unsearchable folder, in a mount namespace where that folder is its view with only the names leading to
    Python bound in (a pod's image needs none of this)."""
    setpriv = [shutil.which("setpriv") or "setpriv", f"--reuid={TASK_UID}", f"--regid={TASK_GID}"]
    setpriv += ["--clear-groups", "--"]
    mounts = []
    for n, (folder, names) in enumerate(unsearchable_folders(layout.root).items()):
        view = layout.views / str(n)
        mounts += [
            f"mount --rbind {shlex.quote(str(folder / name))} {shlex.quote(str(view / name))}"
            for name in names
        ]
        mounts.append(f"mount --rbind {shlex.quote(str(view))} {shlex.quote(str(folder))}")
    if not mounts:
        return setpriv
    script = " && ".join([*mounts, 'exec "$@"'])
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh", *setpriv]


def rehearse(
    root: str | os.PathLike[str],
    *,
    phases: int = PHASES,
    milvus_binaries: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] = print,
) -> Outcome:
    """Services, prepare, ship ``phases`` phases (to the first failure), checks; also ``rehearsal.json``."""
    rehearsal = Rehearsal(claim_root(root), milvus_binaries=milvus_binaries, echo=echo)
    outcome = Outcome(str(rehearsal.layout.root))
    started = time.monotonic()
    with rehearsal.services():
        outcome.steps.append(Step("servers", time.monotonic() - started, True, "Milvus standalone, MLflow"))
        outcome.steps.append(_echoed(echo, rehearsal.prepare()))
        for _ in range(phases):
            step = _echoed(echo, rehearsal.ship())
            outcome.steps.append(step)
            if not step.ok:
                break
        outcome.steps.extend(_echoed(echo, step) for step in rehearsal.check())
    outcome.isolation = {
        "network_interfaces": milvus_server.interfaces(),
        "task_user": f"uid {TASK_UID}, gid {TASK_GID} (the images' user), no supplementary groups",
        "task_capabilities": "none",
        "task_views": {str(f): list(n) for f, n in unsearchable_folders(rehearsal.layout.root).items()},
        "read_only": [str(f) for f in rehearsal.layout.read_only],
    }
    (rehearsal.layout.root / "rehearsal.json").write_text(
        json.dumps({**asdict(outcome), "ok": outcome.ok}, indent=2) + "\n"
    )
    return outcome


def _echoed(echo: Callable[[str], None], step: Step) -> Step:
    detail = f" ({step.detail})" if step.detail else ""
    echo(f"{step.name}: {'ok' if step.ok else 'FAILED'} in {step.seconds:.1f} s{detail}")
    return step


def _stop_when_started(process: subprocess.Popen, log: Path, task: str | None) -> bool:
    """Wait for ``process``, or SIGKILL its process group once the log shows ``task`` starting (True)."""
    if task is None:
        process.wait()
        return False
    started = re.compile(rf"Executing task (\x1b\[[0-9;]*m)?'{re.escape(task)}'")
    with open(log, errors="replace") as reading:
        pending = ""
        while process.poll() is None:
            lines = (pending + reading.read()).split("\n")
            pending = lines.pop()  # a line still being written
            if any(started.search(line) for line in lines):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return True
            time.sleep(0.5)
    return False


def claim_root(root: str | os.PathLike[str], *, fresh: bool = False) -> Path:
    """The rehearsal folder ``root``, made with :data:`MARKER` (``fresh``: deleted first). Refuses a system or
    home folder, the checkout and a folder of files no rehearsal made (it is given to uid 10001)."""
    path = Path(root).expanduser().resolve()
    homes = {Path(user.pw_dir).resolve() for user in pwd.getpwall() if user.pw_dir not in ("", "/")}
    homes |= {Path.home().resolve(), *(p for p in Path("/home").glob("*") if p.is_dir())}
    if path in SYSTEM_FOLDERS or path in homes or path == CHECKOUT or path in CHECKOUT.parents:
        raise RehearsalError(
            f"--root {path} is refused: a rehearsal gives its folder to uid {TASK_UID} and --fresh deletes "
            "it, so it must be a folder of its own (e.g. ./rehearsal), not the root, a system or home folder "
            "or the checkout"
        )
    made = (path / MARKER).is_file() or (path / "rehearsal.json").is_file()  # the latter: older rehearsals
    if path.exists() and not made and (not path.is_dir() or any(path.iterdir())):
        raise RehearsalError(
            f"--root {path} holds files no rehearsal made (no {MARKER} in it): give a new or empty folder"
        )
    if fresh and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("made by `compatflow pipeline rehearse`; --fresh deletes this folder\n")
    return path


def _own_tree(folder: Path, uid: int, gid: int, *, read_only: bool = False) -> None:
    """Give ``folder`` and everything under it to ``uid``:``gid``; ``read_only``: no write bit for anyone.
    A link (a task may leave one in its volume) is given itself, never followed."""
    if folder.is_symlink():
        raise RehearsalError(f"{folder} is a symbolic link: the rehearsal makes it itself; remove it")
    paths = [folder]
    for here, folders, files in os.walk(folder):  # never into a linked folder
        paths += [Path(here, name) for name in folders + files]
    for path in paths:
        os.chown(path, uid, gid, follow_symlinks=False)
        if read_only and not path.is_symlink():
            path.chmod(0o555 if path.is_dir() else 0o444)


def _ship_package(package: str, run_id: str = "") -> int:
    """Run the package with ``kfp.local`` in this (the task user's) process; 0 when it succeeded."""
    from kfp import components, local

    from pipelines.warm_tasks import on_host, warm_task_host

    workspace = Workspace()  # $COMPATFLOW_WORKSPACE, as in a pod
    warnings.filterwarnings("ignore", message=".*non-Python base image.*")
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(workspace.kfp_dir),
        raise_on_error=True,
        enable_caching=True,  # KFP's: the cacheable steps of a resubmitted run (same run id) are skipped
    )
    pipeline = components.load_component_from_file(package)
    try:
        with warm_task_host(workspace.tmp_dir / "task-host") as host:
            on_host(pipeline, host)(**({"run_id": run_id} if run_id else {}))
    except RuntimeError as err:
        print(f"pipeline failed: {err}", flush=True)
        return 1
    return 0


if __name__ == "__main__":  # the task user's process of :meth:`Rehearsal.ship`
    if len(sys.argv) != 4 or sys.argv[1] != "ship":
        sys.exit("usage: python -m pipelines.rehearsal ship PACKAGE RUN_ID  (RUN_ID '': the job name)")
    sys.exit(_ship_package(sys.argv[2], sys.argv[3]))
