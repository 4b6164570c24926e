"""The test tiers, set by folder, and what holds each to its promise.

- ``tests/unit``: the math, the policies, the config, the documents, the plan, in this process only. A unit
  test starts no process (no server, no subprocess, no fork), binds no socket and imports neither kfp nor a
  service's library (Milvus, MLflow, Great Expectations, Evidently, Feast):
  :class:`UnitGuard` refuses each at the call, naming the test, so ``make test-fast`` answers in minutes
  after any change with nothing started.
- ``tests/integration``: one real service, process or service library each (Milvus lite or standalone,
  MLflow, Great Expectations, Evidently, Feast, a CLI subprocess, kfp's compiler).
- ``tests/e2e``: pipelines run through kfp's local runner, kill -9 and resume, upgrade chains.

A test's wall time (set-up, call and tear-down) is recorded per node id; :func:`over_limit` names those past
:data:`LIMIT_S`, which fails the session, and ``--durations-file`` writes them (``tests/durations.json`` is
the committed baseline, written by ``make durations``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIERS = ("unit", "integration", "e2e")
LIMIT_S = 300.0  # no single test over five minutes on a quiet 2-core machine

_TESTS = Path(__file__).resolve().parent


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder under ``tests/`` it lives in (None outside the tiers)."""
    try:
        parts = Path(path).resolve().relative_to(_TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


class UnitGuard:
    """An audit hook (:func:`sys.addaudithook`: it cannot be removed, so it is switched on per test) that
    refuses, while on, anything that starts a process or a server, and notes the libraries of :data:`IMPORTS`
    the test imported first."""

    EVENTS = {
        "subprocess.Popen": "starts a subprocess",
        "os.system": "starts a shell",
        "os.fork": "forks",
        "os.forkpty": "forks",
        "os.posix_spawn": "spawns a process",
        "os.spawn": "spawns a process",
        "os.exec": "execs a program",
        "pty.spawn": "spawns a process",
        "socket.bind": "binds a socket (a server)",
    }
    # kfp, and the libraries of the services a unit test has no business starting (each also costs seconds)
    IMPORTS = ("kfp", "great_expectations", "evidently", "feast", "mlflow", "pymilvus", "milvus_lite")

    def __init__(self) -> None:
        self.test: str | None = None  # the unit test running, None while off
        self.refused: list[str] = []
        self._modules_before: set[str] = set()
        sys.addaudithook(self._hook)

    @classmethod
    def loaded(cls) -> set[str]:
        """The libraries of :data:`IMPORTS` this process has imported."""
        return {m for m in cls.IMPORTS if m in sys.modules}

    def start(self, test: str) -> None:
        self.test, self.refused = test, []
        self._modules_before = self.loaded()

    def stop(self) -> list[str]:
        """Switch off; returns what the test did that a unit test may not."""
        imported = sorted(self.loaded() - self._modules_before, key=self.IMPORTS.index)
        found = self.refused + [f"imports {m}" for m in imported]
        self.test = None
        return found

    def _hook(self, event: str, args: tuple) -> None:
        if self.test is None or event not in self.EVENTS:
            return
        what = f"{self.EVENTS[event]} ({event} {_short(args)})"
        self.refused.append(what)
        raise RuntimeError(
            f"{self.test} {what}: a unit test runs in this process only; "
            "move it to tests/integration (one real service or process) or tests/e2e"
        )


def _short(args: tuple) -> str:
    text = " ".join(str(a) for a in args[:2])
    return text if len(text) <= 120 else text[:117] + "..."


def inside_tests(path: Path) -> bool:
    """Whether ``path`` lies under this ``tests/`` folder (planted tests run elsewhere have no tier)."""
    return Path(path).resolve().is_relative_to(_TESTS)


def over_limit(durations: dict[str, float], limit_s: float = LIMIT_S) -> dict[str, float]:
    """The tests whose wall time passed ``limit_s``, slowest first."""
    slow = {node: s for node, s in durations.items() if s > limit_s}
    return dict(sorted(slow.items(), key=lambda kv: -kv[1]))


def tier_totals(durations: dict[str, float]) -> dict[str, float]:
    """Seconds per tier (by each node id's folder)."""
    totals = dict.fromkeys(TIERS, 0.0)
    for node, seconds in durations.items():
        tier = tier_of(_TESTS.parent / node.split("::", 1)[0])
        if tier is not None:
            totals[tier] += seconds
    return totals


def write_durations(path: Path, durations: dict[str, float]) -> None:
    """Write ``{"tiers": {tier: s}, "tests": {node id: s}}``, slowest test first, seconds to 0.1."""
    tests = {node: round(s, 1) for node, s in sorted(durations.items(), key=lambda kv: -kv[1])}
    tiers = {tier: round(s, 1) for tier, s in tier_totals(durations).items()}
    Path(path).write_text(json.dumps({"tiers": tiers, "tests": tests}, indent=1) + "\n")


def baseline_by_file(path: Path = _TESTS / "durations.json") -> dict[str, float]:
    """The committed baseline's seconds per test file (node id before ``::``; {} when it is absent)."""
    try:
        tests = json.loads(Path(path).read_text())["tests"]
    except (OSError, ValueError, KeyError):
        return {}
    files: dict[str, float] = {}
    for node, seconds in tests.items():
        file = node.split("::", 1)[0]
        files[file] = files.get(file, 0.0) + float(seconds)
    return files


def slowest_files_first(items: list, rootdir: Path) -> None:
    """Reorder ``items`` in place, whole files at a time, slowest file (by the baseline) first: the order in
    which pytest-xdist's ``loadfile`` hands files to its workers, so the longest ones do not start last.
    A file missing from the baseline counts as slow (it is new: better started early)."""
    files = baseline_by_file()
    unknown = max(files.values(), default=0.0)

    def seconds(item) -> float:
        return files.get(Path(item.path).relative_to(rootdir).as_posix(), unknown)

    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda item: (-seconds(item), first_seen[item.path]))


def read_baseline(path: Path = _TESTS / "durations.json") -> dict[str, float]:
    """The committed baseline's seconds per tier ({} when it is absent)."""
    try:
        return {k: float(v) for k, v in json.loads(Path(path).read_text())["tiers"].items()}
    except (OSError, ValueError, KeyError):
        return {}
