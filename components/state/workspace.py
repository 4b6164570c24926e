"""Where a compatflow deployment keeps its state: one directory per workspace, laid out by :class:`Workspace`.

The layout is README.md's ``workspace/`` tree; the pipeline and every command ask :class:`Workspace` for a
path, no other module spells one. The root defaults to ``$COMPATFLOW_WORKSPACE`` or ``./workspace``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from components.state.run_dir import ROLLOUT_STATE_FILE, RunDir

DEFAULT_ROOT = "workspace"
DEFAULT_ALIAS_PREFIX = "gallery"  # a deployment's default serving alias: gallery_<8 hex of its seed>
_SEED = re.compile(r"^[0-9a-f]{32}$")
DEFAULT_MODEL_NAME = "compatflow-clip"
ENV_ROOT = "COMPATFLOW_WORKSPACE"
# Folders a workspace may never be (a run writes, archives and deletes below its workspace): the root, the
# system folders and the folder that holds every user's home.
SYSTEM_FOLDERS = frozenset(
    map(
        Path,
        "/ /bin /boot /dev /etc /home /lib /lib32 /lib64 /opt /proc /root /run /sbin /srv /sys /tmp /usr "
        "/usr/bin /usr/lib /usr/local /var /var/lib /var/log /var/tmp".split(),
    )
)


class WorkspaceError(ValueError):
    """The workspace folder is one that must not be written under (the root or a system folder), or its
    deployment file is damaged."""


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
ENV_INDEX_URI = "COMPATFLOW_MILVUS_URI"
ENV_LINEAGE_REPO = "COMPATFLOW_FEAST_REPO"


def _at(*parts: str) -> property:
    """A :class:`Workspace` path: ``parts`` under its root."""
    return property(lambda workspace: workspace.root.joinpath(*parts))


class Workspace:
    """Every path of a workspace and every service URI a deployment uses; creates nothing until asked.
    Built from a deployment (:meth:`of`); a service URI left unset resolves here, once: the configured value,
    else the environment variable a pod receives (``COMPATFLOW_*``), else the embedded default inside it."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        tracking_uri: str | None = None,
        lineage_repo: str | Path | None = None,
        index_uri: str | None = None,
        index_alias: str | None = None,
        weights_dir: str | Path | None = None,
    ) -> None:
        chosen = root if root is not None else os.environ.get(ENV_ROOT) or DEFAULT_ROOT
        self.root = check_root(chosen)
        self._tracking_uri = tracking_uri or os.environ.get(ENV_TRACKING_URI) or None
        self._lineage_repo = Path(lineage_repo or os.environ.get(ENV_LINEAGE_REPO) or self.root / "feast")
        self._index_uri = index_uri or os.environ.get(ENV_INDEX_URI) or None
        self._index_alias = index_alias or None
        self._weights_dir = Path(weights_dir).expanduser() if weights_dir else None

    @classmethod
    def of(cls, deployment: Any) -> Workspace:
        """The workspace and services of a :class:`~components.deployment.Deployment`."""
        return cls(
            deployment.workspace,
            tracking_uri=deployment.registry.tracking_uri,
            lineage_repo=deployment.lineage.repo,
            index_uri=deployment.index.uri,
            index_alias=deployment.index.alias,
            weights_dir=deployment.training.weights_dir,
        )

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def with_index_uri(self, uri: str) -> Workspace:
        """The same workspace with its gallery index at ``uri`` (a command's ``--uri``)."""
        moved = copy.copy(self)
        moved._index_uri = uri or os.environ.get(ENV_INDEX_URI) or None
        return moved

    @classmethod
    def coerce(cls, value: Workspace | str | Path | None) -> Workspace:
        """A :class:`Workspace` from a workspace, a path, or ``None`` (the default root)."""
        return value if isinstance(value, Workspace) else cls(value)

    # ---------------------------------------------------------------------------------------- services
    mlflow_store = _at("mlflow.db")
    artifacts_dir = _at("mlartifacts")
    milvus_dir = _at("milvus")
    # the Feast repo lineage is written to and read from (made from feast_dir when that is elsewhere); its
    # relative paths (offline parts, a file registry, an online store) lie inside it
    lineage_dir = _at("feast")

    @property
    def mlflow_uri(self) -> str:
        """The tracking (and registry) URI: the explicit one, else ``sqlite:///<root>/mlflow.db``."""
        return self._tracking_uri or f"sqlite:///{self.mlflow_store}"

    @property
    def feast_dir(self) -> Path:
        """The Feast repo definition (``feature_store.yaml``, optionally ``items.py``): the configured one,
        else ``<root>/feast``. Read, never written: on a cluster it is a read-only ConfigMap volume."""
        return self._lineage_repo

    @property
    def lineage_definition(self) -> Path | None:
        """:attr:`feast_dir` when it is a repo definition apart from :attr:`lineage_dir`, else None."""
        definition = self._lineage_repo.expanduser().resolve()
        return None if definition == self.lineage_dir else definition

    @property
    def weights_dir(self) -> Path:
        """open_clip start weights by tag, laid out ``<ARCH>/<TAG>/<file>`` (``compatflow models fetch
        --to``): ``training.weights_dir``, else ``<root>/weights``."""
        return self._weights_dir or self.root / "weights"

    @property
    def configured_index_uri(self) -> str | None:
        """The index URI the config or ``$COMPATFLOW_MILVUS_URI`` names; None when neither does."""
        return self._index_uri

    @property
    def index_uri(self) -> str:
        """The Milvus URI: the configured one, else milvus-lite at ``<root>/milvus/gallery.db``."""
        return self._index_uri or str(self.milvus_dir / "gallery.db")

    @property
    def index_alias(self) -> str:
        """The serving alias a first indexing creates: ``index.alias``, else ``gallery_<8 hex of the
        deployment's seed>``, unique to this deployment (makes the deployment file)."""
        return self._index_alias or f"{DEFAULT_ALIAS_PREFIX}_{self.deployment_seed()[:8]}"

    # ------------------------------------------------------------------------------------------ identity
    deployment_path = _at("deployment.json")  # the deployment's seed, made once by deployment_seed()

    def deployment_seed(self) -> str:
        """The deployment's random seed: read from :attr:`deployment_path`, else made there once (created
        whole and never replaced: processes that start at once agree on the first one written)."""
        path = self.deployment_path
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"schema_version": 1, "seed": secrets.token_hex(16)}) + "\n"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            try:
                tmp.write_text(text)
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                os.link(tmp, path)  # fails when another process made it first: that one is kept
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        seed, why = _read_seed(path)
        if seed is None:
            raise WorkspaceError(
                f"{path} is not a deployment file ({why}): restore it from a backup of this workspace (a new "
                "one makes this workspace another deployment, refused by the collections it made in a shared "
                "index)"
            )
        return seed

    def deployment_id(self) -> str:
        """The deployment's identity (16 hex of its seed and the root's absolute path), marked on every
        collection it creates in an index; a write into one marked by another identity is refused, so a copy
        of the workspace elsewhere cannot write into the original's (a moved one can: :meth:`moved_from`)."""
        return _identity(self.deployment_seed(), str(self.root))

    def moved_from(self, mark: str, folder: str) -> bool:
        """True when ``mark`` is this deployment's identity in ``folder`` and ``folder`` no longer holds this
        deployment (gone, or another seed there): the workspace was moved here from it, and what it marked
        there is its own. A copy leaves the seed in the original folder, so this stays False for a copy."""
        seed = self.deployment_seed()
        if not folder or _identity(seed, folder) != mark:
            return False
        return _read_seed(Path(folder) / self.deployment_path.name)[0] != seed

    # ------------------------------------------------------------------------------------------- state
    state_path = _at("state.json")
    serving_path = _at("serving.json")
    rollout_state_path = _at(ROLLOUT_STATE_FILE)
    rollout_dir = _at("rollout")
    probe_path = _at("rollout", "probe.json")
    services_dir = _at("services")
    lock_path = _at(".compatflow.lock")
    steps_lock_path = _at(".compatflow.steps.lock")
    # ---------------------------------------------------------------------------------------- folders
    models_dir = _at("models")
    validated_root = _at("validated")
    tmp_dir = _at("tmp")
    kfp_dir = _at("kfp")
    runs_dir = _at("runs")

    def model_dir(self, version: str | int) -> Path:
        return self.models_dir / f"v{version}"

    def validated_dir(self, phase: int) -> Path:
        return self.validated_root / f"phase-{phase:03d}"

    def run_dir(self, run_id: str) -> Path:
        """``<root>/runs/<run_id>``; refuses ids that would escape the runs directory."""
        if not run_id or "/" in run_id or "\\" in run_id or run_id in {".", ".."}:
            raise ValueError(f"invalid run id {run_id!r}: use a plain name without path separators")
        return self.runs_dir / run_id

    def run(self, run_id: str) -> RunDir:
        return RunDir(self.run_dir(run_id))

    def run_ids(self) -> list[str]:
        """Run ids present in the workspace, oldest first (by directory modification time)."""
        if not self.runs_dir.is_dir():
            return []
        runs = [p for p in self.runs_dir.iterdir() if p.is_dir()]
        return [p.name for p in sorted(runs, key=lambda p: (p.stat().st_mtime, p.name))]


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
    out = copy.deepcopy(doc)
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str):
            node[leaf] = convert(node[leaf])
    return out


def _read_seed(path: Path) -> tuple[str | None, str]:
    """The seed of the deployment file at ``path``, or None and why it has none."""
    try:
        seed = json.loads(path.read_text(encoding="utf-8")).get("seed")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(seed, str) or not _SEED.match(seed):
        return None, "its seed is not 32 hex digits"
    return seed, ""


def _identity(seed: str, folder: str) -> str:
    """A deployment's identity: 16 hex of the hash of its seed and its workspace folder."""
    return hashlib.sha256(f"{seed}\0{folder}".encode()).hexdigest()[:16]
