"""Shared test set-up: offline, telemetry-free environment, a per-test TMPDIR, and a session that runs
outside the checkout and fails when a test reads or changes the checkout's own workspace."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import _tiers
import pytest
from _milvus import SERVER_BACKENDS, milvus_binaries_cache, server_uri
from hypothesis import settings as hypothesis_settings

from compat.io import free_loopback_port

# Fixtures shared by the tiers' files live in helper modules (never in a test file).
pytest_plugins = ["_shards"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# the rollout tests name their known-geometry encoders in serving records (components.serving.record)
os.environ.setdefault("COMPATFLOW_TRUSTED_MODULES", "benchmarks.synthetic_upgrade")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share the cores: one math thread each (and in every process a test starts,
    # kfp tasks and servers included) instead of a thread per core each, which oversubscribes the cores.
    for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_threads, "1")


# Property-based tests: the same examples on every machine (derandomized), no example database written, no
# per-example deadline on shared cores; HYPOTHESIS_PROFILE=thorough tries ten times as many.
_CI = {"deadline": None, "derandomize": True, "database": None}
hypothesis_settings.register_profile("ci", max_examples=200, **_CI)
hypothesis_settings.register_profile("thorough", max_examples=2000, **_CI)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_NETNS_NOTE = "not tried"


def pytest_addoption(parser):
    parser.addoption(
        "--durations-file",
        default=None,
        help="write each test's wall time (set-up, call, tear-down) and each tier's total to this JSON file",
    )


def _is_worker(config) -> bool:
    """Whether this process is a pytest-xdist worker (``make test`` runs the session on two)."""
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier, the folder it lives in (tests/unit, tests/integration, tests/e2e);
    under pytest-xdist, hand out the slowest files first."""
    for item in items:
        tier = _tiers.tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)
        elif _tiers.inside_tests(item.path):
            raise pytest.UsageError(f"{item.nodeid} is outside the tiers: move it under tests/<tier>/")
    if _is_worker(config):
        _tiers.slowest_files_first(items, config.rootpath)


_DURATIONS: dict[str, float] = {}
_IMPORTED_AT_COLLECTION: dict[str, list[str]] = {}  # unit test file -> service libraries its import loaded


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Note the service libraries a unit test file's own import loads (before any test's guard is on)."""
    if not isinstance(collector, pytest.Module) or _tiers.tier_of(collector.path) != "unit":
        return (yield)
    before = _tiers.UnitGuard.loaded()
    report = yield
    loaded = sorted(_tiers.UnitGuard.loaded() - before, key=_tiers.UnitGuard.IMPORTS.index)
    if loaded:
        _IMPORTED_AT_COLLECTION[str(collector.path)] = loaded
    return report


_UNIT_GUARD: _tiers.UnitGuard | None = None


def pytest_runtest_logreport(report):
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Write the durations and fail a session with a test over the limit (in the process that saw every
    test: the only one, or pytest-xdist's controller, which receives its workers' reports)."""
    if _is_worker(session.config):
        return
    path = session.config.getoption("--durations-file")
    if path:
        _tiers.write_durations(Path(path), _DURATIONS)
    if _tiers.over_limit(_DURATIONS) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """Each tier's time beside the committed baseline's, and the tests over the five-minute limit."""
    totals, baseline = _tiers.tier_totals(_DURATIONS), _tiers.read_baseline()
    ran = [
        f"{tier} {seconds:.0f} s" + (f" (baseline {baseline[tier]:.0f} s)" if tier in baseline else "")
        for tier, seconds in totals.items()
        if seconds
    ]
    if ran:
        terminalreporter.write_line("tiers: " + ", ".join(ran))
    for node, seconds in _tiers.over_limit(_DURATIONS).items():
        terminalreporter.write_line(
            f"OVER {_tiers.LIMIT_S:.0f} s: {node} took {seconds:.0f} s (split it or use smaller settings)",
            red=True,
        )


@pytest.fixture
def unit_guard(request) -> _tiers.UnitGuard | None:
    """The guard watching this test (None outside tests/unit)."""
    return _UNIT_GUARD if request.node.get_closest_marker("unit") is not None else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A unit test runs in this process only, its fixtures of every scope included: no subprocess, fork,
    server socket, kfp or service library (:class:`_tiers.UnitGuard`), from its first fixture on."""
    global _UNIT_GUARD
    if item.get_closest_marker("unit") is None:
        return
    loaded = _IMPORTED_AT_COLLECTION.get(str(item.path))
    if loaded:
        pytest.fail(
            f"{item.path.name} imports {', '.join(loaded)} when collected: a unit test file imports "
            "no service library (import it inside the code that needs it, or move it to tests/integration)",
            False,
        )
    _UNIT_GUARD = _UNIT_GUARD or _tiers.UnitGuard()
    _UNIT_GUARD.start(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Fails the unit test (in its tear-down) that did what :class:`_tiers.UnitGuard` refuses."""
    result = yield
    if _UNIT_GUARD is not None and _UNIT_GUARD.test == item.nodeid:
        found = _UNIT_GUARD.stop()
        if found:
            pytest.fail(f"{item.nodeid} {'; '.join(found)} (a unit test runs in this process only)", False)
    return result


def _probe_cpus_before_the_guard() -> None:
    """joblib (under scikit-learn's k-means) counts physical cores once per process with ``lscpu``: done here,
    before any unit test's guard is on, the count is cached and no unit test starts that process."""
    from joblib.externals.loky.backend.context import _count_physical_cores

    _count_physical_cores()


def pytest_configure(config):
    """Run the whole session in a private network namespace with only loopback (root only): Milvus 2.3
    listens on every interface, and nothing a test starts may be reachable from beyond this machine."""
    global _NETNS_NOTE
    from components.adapters import milvus_server

    _probe_cpus_before_the_guard()
    if milvus_server.loopback_only():
        _NETNS_NOTE = "the session's network namespace has loopback only"
        return
    if os.geteuid() != 0:
        _NETNS_NOTE = "not root, so the test session cannot make a private network namespace"
        return
    try:
        milvus_server.enter_private_network()
        _NETNS_NOTE = "the session runs in a private network namespace (loopback only)"
    except (OSError, RuntimeError) as exc:
        _NETNS_NOTE = f"the private network namespace failed: {exc}"


def _frames(context: int = 1) -> list[tuple]:
    """``inspect.stack()``'s tuples without their source lookup (file, line, function name only)."""
    frame, frames = sys._getframe(1), []
    while frame is not None:
        frames.append((frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None, None))
        frame = frame.f_back
    return frames


@pytest.fixture(autouse=True)
def _kfp_names_its_callers_without_their_source() -> None:
    """kfp's task setters call ``inspect.stack()`` only to name their caller in an error message
    (``PipelineTask._ensure_container_spec_exists``): each call looks every frame's module up among
    ``sys.modules``, and a test process that has imported torch, MLflow and Feast holds 8,000 of them:
    a cluster compile took 25 s there, 2 s in a fresh ``compatflow pipeline compile``. The same pipelines
    are compiled with the frames named without their source."""
    import types

    task = sys.modules.get("kfp.dsl.pipeline_task")
    if task is not None and isinstance(task.inspect, types.ModuleType):
        task.inspect = types.SimpleNamespace(stack=_frames)


@pytest.fixture(autouse=True)
def _tmpdir_env(tmp_path, monkeypatch):
    """Point TMPDIR (and tempfile's cached default) inside the test's own tmp_path."""
    import tempfile

    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield


def _checkout_workspace() -> Path:
    """The default workspace of this checkout, where `make run` keeps its state (another folder when
    ``COMPATFLOW_TESTS_GUARDED_WORKSPACE`` names one: the test of this guard runs a session on its own)."""
    from components.state.workspace import DEFAULT_ROOT

    guarded = os.environ.get("COMPATFLOW_TESTS_GUARDED_WORKSPACE")
    return Path(guarded).resolve() if guarded else Path(__file__).resolve().parents[1] / DEFAULT_ROOT


class _WorkspaceGuard:
    """An audit hook (:func:`sys.addaudithook`) that records every open, sqlite connection, listing,
    removal or rename of a path inside ``root`` by this process while it is on, with the test running then.

    Subprocesses are outside its sight; the session's before/after comparison of the folder covers what they
    write."""

    EVENTS = frozenset(
        {
            "open",
            "sqlite3.connect",
            "os.listdir",
            "os.scandir",
            "os.remove",
            "os.rename",
            "os.mkdir",
            "shutil.rmtree",
            "shutil.copyfile",
            "shutil.copytree",
            "shutil.move",
        }
    )

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.on = False
        self.test = "(no test: session set-up)"
        self.touched: list[tuple[str, str, str]] = []  # (test, event, path)
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on or event not in self.EVENTS:
            return
        try:  # an exception here would break the operation audited
            for arg in args:
                path = self._inside(arg)
                if path is not None:
                    self.touched.append((self.test, event, path))
        except Exception:
            pass

    def _inside(self, arg: object) -> str | None:
        if not isinstance(arg, str | bytes | os.PathLike):
            return None
        text = os.fsdecode(os.fspath(arg))
        if text.startswith("file:"):  # an sqlite URI
            text = text.removeprefix("file:").split("?", 1)[0]
        path = os.path.abspath(text)
        return path if path == self.root or path.startswith(self.root + os.sep) else None


def _listing(root: Path) -> dict[str, tuple[int, int]] | None:
    """Every file and folder under ``root`` with its size and mtime (ns); None when ``root`` is absent."""
    if not root.exists():
        return None
    listing = {".": (0, root.stat().st_mtime_ns)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            st = path.lstat()
            listing[path.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    return listing


def _changes(before: dict | None, after: dict | None) -> list[str]:
    if before is None or after is None:
        return [] if before == after else ["the folder " + ("appeared" if before is None else "disappeared")]
    added, gone = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    return [
        f"{what}: {name}"
        for what, names in (("added", added), ("removed", gone), ("changed", changed))
        for name in names
    ]


_GUARD: _WorkspaceGuard | None = None


@pytest.fixture(scope="session", autouse=True)
def _session_outside_the_checkout(tmp_path_factory):
    """The session runs in a temporary current folder (a config's relative workspace, ``workspace``, lands
    there), and ends in an error when any test read or changed the checkout's workspace (`make run`'s):
    in this process, seen by an audit hook; by any process, by comparing the folder's files, sizes and
    modification times before and after.

    ``HOME`` stays the user's: the offline caches the tests read (Milvus binaries, ``~/.cache/clip``, Hugging
    Face's) live there."""
    global _GUARD
    root = _checkout_workspace()
    before = _listing(root)
    _GUARD = _GUARD or _WorkspaceGuard(root)
    _GUARD.touched.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        _GUARD.on = True
        yield _GUARD
        _GUARD.on = False
    problems = [f"{test} ({event}): {path}" for test, event, path in _GUARD.touched]
    problems += _changes(before, _listing(root))
    if problems:
        pytest.fail(
            f"the tests read or changed the checkout's workspace {root} (a test keeps to the folders it "
            "makes; a `compatflow run` of this checkout during the tests changes it too):\n  "
            + "\n  ".join(problems[:20]),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _test_keeps_out_of_the_checkouts_workspace(request, _session_outside_the_checkout):
    """Fails the test that read or changed the checkout's workspace (in this process), naming the path."""
    guard = _session_outside_the_checkout
    guard.test, seen = request.node.nodeid, len(guard.touched)
    yield
    mine = guard.touched[seen:]
    guard.test = "(no test: session tear-down)"
    if mine:
        pytest.fail(
            f"{request.node.nodeid} touched the checkout's workspace {guard.root}: "
            + "; ".join(f"{event} {path}" for _, event, path in mine[:10]),
            pytrace=False,
        )


@pytest.fixture(scope="session")
def milvus_lite_server(tmp_path_factory):
    """A real ``milvus-lite server`` on a free 127.0.0.1 port for the session; yields its URI."""
    import shutil
    import sys

    from components.adapters.loopback import start_server

    exe = Path(sys.executable).with_name("milvus-lite")
    exe = str(exe) if exe.is_file() else shutil.which("milvus-lite")
    if exe is None:
        pytest.fail("the milvus-lite executable is missing from the environment (pip package milvus-lite)")
    data = tmp_path_factory.mktemp("milvus-lite-server")
    port = free_loopback_port()
    argv = [exe, "server", "--data-dir", str(data / "data"), "--host", "127.0.0.1", "--port", str(port)]
    server = start_server(argv, data, port, name="milvus-lite server", wait_s=60)
    yield server.uri
    server.stop()


@pytest.fixture(scope="session")
def milvus_standalone(tmp_path_factory):
    """A real Milvus standalone server (PyPI ``milvus``) for the session, in this session's private
    network namespace; yields the :class:`~components.adapters.milvus_server.MilvusStandalone`."""
    import fcntl

    from components.adapters import milvus_server

    if not milvus_server.loopback_only():
        pytest.skip(f"Milvus standalone needs a loopback-only network namespace: {_NETNS_NOTE}")
    # One start at a time across pytest-xdist's workers (they share the network namespace): a server takes
    # the first free ports when it starts, and two starting at once could pick the same ones.
    lock = tmp_path_factory.getbasetemp().parent / "milvus-standalone-start.lock"
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        server = milvus_server.start(
            tmp_path_factory.mktemp("milvus-standalone"), bin_dir=milvus_binaries_cache(), graceful_stop_s=3
        )
    yield server
    server.stop()


@pytest.fixture(params=SERVER_BACKENDS)
def milvus_server(request):
    """The URI of a real Milvus server, once per backend: ``milvus-lite server`` and Milvus standalone
    (the collections the test creates are dropped after it)."""
    return server_uri(request, request.param)


@pytest.fixture
def mlflow_server(tmp_path):
    """An MLflow tracking server (sqlite store, served artifacts) on a free 127.0.0.1 port; yields its URI."""
    from components.adapters import mlflow_server

    with mlflow_server.start(tmp_path / "mlflow-server") as server:
        yield server.uri


@pytest.fixture(scope="session")
def _session_task_host(tmp_path_factory):
    """One warm task host for this test process, started when a test first asks for :func:`task_host`."""
    from pipelines.warm_tasks import warm_task_host

    folder = tmp_path_factory.mktemp("task-host")
    with warm_task_host(folder / "host", folder / "host.log") as host:
        yield host, folder / "host.log"


@pytest.fixture
def task_host(_session_task_host, monkeypatch) -> Path:
    """The runs this test makes hand their tasks to the session's warm host (``$COMPATFLOW_TASK_HOST``), which
    imports the steps' libraries once for them all; yields the host's log."""
    from pipelines.warm_tasks import SHARED_ENV

    host, log = _session_task_host
    monkeypatch.setenv(SHARED_ENV, str(host.socket))
    return log


@pytest.fixture(scope="session")
def stream_dir(tmp_path_factory):
    """A small synthetic stream of four phases (16 gallery items each), shared by the upgrade-chain tests."""
    from compat.data.synth import generate_stream

    out = tmp_path_factory.mktemp("chain-stream") / "stream"
    generate_stream(
        out, phases=4, samples_per_phase=96, seed=0, eval_per_domain=12, gallery_per_domain=16, image_size=64
    )
    return out


@pytest.fixture
def rendered():
    """The manifest overlays rendered once per session (``tests/_manifests.py``), copied for each test."""
    import copy

    from _manifests import rendered_overlays

    return copy.deepcopy(rendered_overlays())
