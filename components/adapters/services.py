"""The running search services of a workspace: one small file per service process, found by the rollout.

``compatflow serve`` writes ``<workspace>/services/<hostname>-<port>.json`` once it listens and removes it
when it stops (named by host too: a Deployment's replicas share the workspace volume and the port); a
rollout's pace reads the query latency of every live one (:class:`components.rollout.pacing.ServiceLatency`).
A file left by a process no longer running on this host (kill -9) is ignored; one from another host is kept
(the reader skips a service that does not answer). ``compatflow search`` asks a live one (:func:`ask`)
before it loads a model itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from compat.io import utc_now, write_json_atomic


@contextlib.contextmanager
def announced(directory: Path, host: str, port: int) -> Iterator[Path]:
    """Announce the service listening on ``host:port`` for the duration of the block."""
    hostname = socket.gethostname()
    path = Path(directory) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', hostname)}-{port}.json"
    doc = {"url": f"http://{host}:{port}", "pid": os.getpid(), "hostname": hostname, "started_at": utc_now()}
    write_json_atomic(path, doc)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _alive(doc: dict) -> bool:
    if doc.get("hostname") != socket.gethostname():
        return True  # another host's process: the reader finds out by asking it
    try:
        os.kill(int(doc["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        pass  # another user's process, or no pid to check: the reader finds out by asking it
    return True


def live_services(directory: Path) -> list[str]:
    """Base URLs of the services announced in ``directory`` whose process may still run, sorted."""
    urls = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written or removed right now
        if isinstance(doc, dict) and isinstance(doc.get("url"), str) and _alive(doc):
            urls.append(doc["url"])
    return urls


def ask(url: str, texts: Sequence[str], k: int, timeout: float = 10.0) -> list[list[dict[str, Any]]]:
    """Hits per text (``item_id``, ``score``, ``model_version``, ``caption``) from the service at ``url``
    (``POST /search``); :class:`ValueError` with its detail when it refuses the query (422), OSError when
    it does not answer or cannot search (a client falls back to searching itself)."""
    body = json.dumps({"queries": list(texts), "k": k}).encode()
    request = urllib.request.Request(f"{url}/search", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            doc = json.loads(response.read())
    except urllib.error.HTTPError as err:
        if err.code != 422:
            raise
        raise ValueError(json.loads(err.read() or b"{}").get("detail", f"{url} refused the query")) from err
    keys = ("score", "model_version", "caption")
    return [
        [{"item_id": h["id"], **{key: h.get(key) for key in keys}} for h in row] for row in doc["results"]
    ]
