"""The ``python`` a local task starts with under a warm task host (:mod:`pipelines.warm_tasks`): it hands
its arguments, environment, folder and streams to the host and exits as the forked task exits.

Standard library only, run with ``-I -S`` to start in milliseconds; what the host cannot serve runs as the
plain interpreter. Signals are passed to the task, and a SIGKILL of this process kills the task too.
"""

import contextlib
import io
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _plain(argv: list[str]) -> None:
    """Become the plain interpreter (site on, isolation off) with the task's own arguments."""
    os.execv(sys.executable, [sys.executable, *argv])


def _read_line(replies: io.BufferedReader) -> dict | None:
    """The host's next JSON line (its socket read buffered: two may arrive at once), or None at its end."""
    line = replies.readline()
    return json.loads(line) if line.endswith(b"\n") else None


def main(path: str, argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        _plain(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [b"F"], [0, 1, 2])
        conn.sendall(struct.pack("!I", len(request)) + request)
        replies = conn.makefile("rb")
        started = _read_line(replies)
    except OSError:
        started = None
    if not started or "pid" not in started:  # no host, a host busy starting, or a refusal: run it here
        conn.close()
        _plain(argv)
    pid = int(started["pid"])
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: os.kill(pid, signum))
    ended = _read_line(replies)
    if ended is None:  # the host went away with the task running: it is ended rather than left alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        sys.stderr.write(f"compatflow: the warm task host ended while task {pid} ran; the task was killed\n")
        sys.exit(1)
    code = int(ended["exit"])
    if code < 0:  # ended by a signal: end the same way, as the task's own process would have
        sys.stdout.flush()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
