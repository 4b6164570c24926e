"""Small helpers shared across the project: atomic, durable file writes, JSON reads and UTC timestamps."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def atomic_write(path: Path | str, write: Callable[[Path], Any]) -> Path:
    """Create ``path`` whole or not at all, durably: ``write`` creates and fills a temporary file beside it
    (with the process's umask, like any new file), which is then flushed to disk and renamed over ``path``
    (:func:`replace_durably`): a kill or a power cut leaves the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def replace_durably(tmp: Path | str, path: Path | str) -> None:
    """Rename the finished file ``tmp`` over ``path`` after its bytes reach the disk (``fsync``), then
    ``fsync`` the folder so the rename itself survives a power cut. The one rename of every atomic write."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # folders that cannot be opened or synced: the rename is atomic still
        folder = os.open(Path(path).parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def write_json_atomic(path: Path | str, document: Any) -> Path:
    """Write ``document`` as indented strict JSON (no NaN), atomically (see :func:`atomic_write`)."""
    text = json.dumps(document, indent=2, allow_nan=False) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def read_json(path: Path | str, damaged: Callable[[str], Exception]) -> Any | None:
    """The JSON document at ``path``, or None when there is no file; a file that cannot be read, is not
    UTF-8 text or is not JSON raises ``damaged(reason)`` (the caller's error, whose message names the file
    and what to do)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise damaged(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at {exc.start})") from exc
    except OSError as exc:
        raise damaged(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise damaged(f"{path}: not valid JSON ({exc})") from exc


def read_json_object_or_none(path: Path | str) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None when it is missing, unreadable or not an object: for files whose
    absence or damage the caller treats as "not there" (a run's own bookkeeping, a reusable result)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (the timestamp of every state file)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; released before it is returned)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LinkedFolderError(ValueError):
    """A folder the project makes for itself is a symbolic link or not a folder; the message names it."""


def own_folder(base: Path | str, *names: str, mode: int = 0o700) -> int:
    """``base/names...`` made (``mode``) or found, each of ``names`` without following a symbolic link: an
    open descriptor of the last folder (the caller closes it), on which files are made with ``dir_fd``.
    Raises :class:`LinkedFolderError` naming a link or a file where a folder should be."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n, name in enumerate(names):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=fd)
            try:
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise LinkedFolderError(
                    f"{Path(base, *names[: n + 1])} is a symbolic link or not a folder: compatflow makes "
                    "this folder for itself and never follows a link there; remove it and run again"
                ) from exc
            os.close(fd)
            fd = inner
        os.fchmod(fd, mode)
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_in(folder_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``name`` in the folder open as ``folder_fd`` (:func:`own_folder`), replacing what is there (a
    link itself, never its target)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder_fd)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=folder_fd)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode)
        f.write(data)
