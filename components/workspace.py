"""Where a compatflow deployment keeps its state: one directory per workspace.

Layout (the pipeline and every command use it)::

    <root>/mlflow.db          MLflow tracking + registry (sqlite) unless a tracking URI is given
    <root>/mlartifacts/       MLflow artifacts (reports, checkpoints)
    <root>/feast/             Feast feature repo: lineage of every gallery item (unless configured)
    <root>/milvus/            milvus-lite data
    <root>/models/            local model checkpoints
    <root>/validated/phase-NNN/  accepted training shards of each validated phase (replay, drift reference)
    <root>/runs/<run_id>/<step>/...    per-run step outputs
    <root>/serving.json       the serving record: which collection and query model answer queries
    <root>/rollout_state.json progress of the rollout in flight (written by the rollout engine)
    <root>/rollout/           the probe set and each rollout's work files (restore rows, archived states)
    <root>/services/          one file per running search service (`compatflow serve`), read by rollouts

The root defaults to ``$COMPATFLOW_WORKSPACE`` or ``./workspace``; the tracking URI to
``$COMPATFLOW_TRACKING_URI`` or the sqlite file above.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_ROOT = "workspace"
DEFAULT_MODEL_NAME = "compatflow-clip"
ENV_ROOT = "COMPATFLOW_WORKSPACE"
# Folders a workspace may never be (a run writes, archives and deletes below its workspace): the root, the
# system folders and the folder that holds every user's home.
SYSTEM_FOLDERS = frozenset(
    Path(p)
    for p in (
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib32",
        "/lib64",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/usr/bin",
        "/usr/lib",
        "/usr/local",
        "/var",
        "/var/lib",
        "/var/log",
        "/var/tmp",
    )
)


class WorkspaceError(ValueError):
    """The workspace folder is one that must not be written under (the root or a system folder)."""


def check_root(root: str | Path) -> Path:
    """``root`` resolved; raises :class:`WorkspaceError` for the filesystem root, a system folder or the
    user's home folder itself (a workspace is a folder of its own, e.g. ``~/compatflow-ws``)."""
    path = Path(root).expanduser().resolve()
    if path in SYSTEM_FOLDERS or path == Path.home().resolve():
        raise WorkspaceError(
            f"workspace {path} is refused: a run writes and deletes files under its workspace, so it must "
            "be a folder of its own (e.g. ./workspace or ~/compatflow-ws), not the root, a system folder "
            "or a home folder"
        )
    return path


ENV_TRACKING_URI = "COMPATFLOW_TRACKING_URI"


class Workspace:
    """Every path of a workspace and every service URI a deployment uses; creates nothing until asked
    (:meth:`ensure`). Built from the resolved config (:meth:`from_config`) by the pipeline and by every
    operator command, so a command run with the cluster config reaches the cluster's services."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        tracking_uri: str | None = None,
        lineage_repo: str | Path | None = None,
        index_uri: str | None = None,
        index_alias: str = "gallery",
    ) -> None:
        chosen = root if root is not None else os.environ.get(ENV_ROOT) or DEFAULT_ROOT
        self.root = check_root(chosen)
        self._tracking_uri = tracking_uri or os.environ.get(ENV_TRACKING_URI) or None
        self._lineage_repo = Path(lineage_repo) if lineage_repo else None
        self._index_uri = index_uri or None
        self.index_alias = index_alias

    @classmethod
    def from_config(cls, config: dict) -> Workspace:
        """The workspace and services of a resolved pipeline config (:func:`pipelines.config.resolve`)."""
        return cls(
            config["workspace"],
            tracking_uri=config["registry"]["tracking_uri"],
            lineage_repo=config["lineage"]["repo"],
            index_uri=config["index"]["uri"],
            index_alias=config["index"]["alias"],
        )

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    @classmethod
    def coerce(cls, value: Workspace | str | Path | None) -> Workspace:
        """A :class:`Workspace` from a workspace, a path, or ``None`` (the default root)."""
        return value if isinstance(value, Workspace) else cls(value)

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_uri(self) -> str:
        """The tracking (and registry) URI: the explicit one, else ``sqlite:///<root>/mlflow.db``."""
        return self._tracking_uri or f"sqlite:///{self.mlflow_db}"

    @property
    def artifacts_dir(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def feast_dir(self) -> Path:
        """The Feast lineage repo: the configured one, else ``<root>/feast``."""
        return self._lineage_repo or self.root / "feast"

    @property
    def index_uri(self) -> str:
        """The Milvus URI: the configured one, else milvus-lite at ``<root>/milvus/gallery.db``."""
        return self._index_uri or str(self.milvus_dir / "gallery.db")

    @property
    def milvus_dir(self) -> Path:
        return self.root / "milvus"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def serving_path(self) -> Path:
        return self.root / "serving.json"

    @property
    def rollout_state_path(self) -> Path:
        return self.root / "rollout_state.json"

    def run_dir(self, run_id: str) -> Path:
        """``<root>/runs/<run_id>``; refuses ids that would escape the runs directory."""
        if not run_id or "/" in run_id or "\\" in run_id or run_id in {".", ".."}:
            raise ValueError(f"invalid run id {run_id!r}: use a plain name without path separators")
        return self.runs_dir / run_id

    def run_ids(self) -> list[str]:
        """Run ids present in the workspace, oldest first (by directory modification time)."""
        if not self.runs_dir.is_dir():
            return []
        runs = [p for p in self.runs_dir.iterdir() if p.is_dir()]
        return [p.name for p in sorted(runs, key=lambda p: (p.stat().st_mtime, p.name))]

    def ensure(self) -> Workspace:
        """Create the workspace directories that are missing; returns ``self``."""
        for path in (
            self.root,
            self.artifacts_dir,
            self.feast_dir,
            self.milvus_dir,
            self.models_dir,
            self.runs_dir,
        ):
            path.mkdir(parents=True, exist_ok=True)
        return self


# ------------------------------------------------------------------------------------- stored paths
# Files inside a workspace name other files of it relative to its root, so a workspace copied or
# restored elsewhere works there and never touches the original.
def stored_path(root: Path, value: str) -> str:
    """``value`` as written into a workspace file: relative to ``root`` when it is a path inside it."""
    if not value or "://" in value or not os.path.isabs(value):
        return value
    try:
        return Path(value).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return value  # outside the workspace (a shared stream, a server): kept as it is


def resolved_path(root: Path, value: str) -> str:
    """A path read from a workspace file: relative ones are inside ``root``."""
    if not value or "://" in value or os.path.isabs(value):
        return value
    return str(Path(root) / value)


def map_paths(doc: dict, keys: tuple[str, ...], convert) -> dict:  # noqa: ANN001 - (root-bound) str -> str
    """A copy of ``doc`` with ``convert`` applied to each dotted ``key`` present (``"a.b"``: doc[a][b])."""
    import copy

    out = copy.deepcopy(doc)
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str):
            node[leaf] = convert(node[leaf])
    return out
