"""The run's worker zygote forked by the flow server, when the flow runs under one (issue 30 item 4).

Why: a relaunched flow's first step waited ~2 s for its zygote to start an interpreter and import
torch (bench/relaunch.py: ``flow`` → ``restored``).  Under ``convoy prefect-worker`` the flow was
itself forked by a server that has those modules imported (``flows/flow_server.py``); that server
forks the zygote too, in milliseconds.  The zygote is then the server's child, not the flow's, so
this module gives :class:`tasks.supervision.worker_zygote.WorkerZygote` the part of
``subprocess.Popen`` it uses (:class:`ServerChild`): the pid, and the exit status the server
reports on the connection when it reaps the zygote.

Everything else is as for a spawned zygote: the flow holds the other end of its control socket
(its end is the zygote's signal to leave) and the lifeline's write end; the zygote gets both at the
fd numbers the flow's workers are told (the server puts them there).  No server, or one that does
not answer: None, and the caller spawns the zygote.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

#: The flow server's socket, in the environment of every flow run it forks.
FLOW_SERVER_ENV = "CONVOY_FLOW_SERVER"


class ServerChild:
    """A process the flow server forked for this one: ``subprocess.Popen``'s ``pid``,
    ``returncode``, ``poll``, ``wait`` and ``kill``."""

    def __init__(self, pid: int, conn: socket.socket, pending: bytes = b"") -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buf = pending
        self._lock = threading.Lock()  # the zygote's reader thread and ``close`` both wait on it
        self._take()

    def _take(self) -> None:
        """The exit status, if the server's report is in the buffer."""
        if b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            self.returncode = int(json.loads(line)["returncode"])
            self._conn.close()

    def _read(self, timeout: float) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            data = self._conn.recv(4096)
            if not data:  # the server died: its child was reaped by init, its status is lost
                self.returncode = -signal.SIGKILL
                self._conn.close()
                return
            self._buf += data
            self._take()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout or 0)
            self._read(left)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def fork_zygote(run_dir: Path, env: dict[str, str], log_path: Path, keep: list[int]) -> ServerChild | None:
    """Ask the flow server named in ``env`` for ``python -m training.zygote --run-dir run_dir``
    with its output appended to ``log_path`` and the fds ``keep`` at the same numbers; None when
    there is no server or it refuses (the caller spawns the zygote)."""
    path = env.get(FLOW_SERVER_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = {"op": "zygote", "argv": ["--run-dir", str(run_dir)], "env": env, "cwd": os.getcwd()}
        request.update(client_pid=os.getpid(), keep_fds=keep)
        with open(os.devnull, "rb") as devnull, open(log_path, "ab") as out:
            socket.send_fds(conn, [json.dumps(request).encode()], [devnull.fileno(), out.fileno(), out.fileno(), *keep])
        buf = b""
        while b"\n" not in buf:
            ready, _, _ = select.select([conn], [], [], 10.0)
            data = conn.recv(4096) if ready else b""
            if not data:
                raise OSError("no answer")
            buf += data
    except OSError:
        conn.close()
        return None
    line, _, rest = buf.partition(b"\n")
    answer = json.loads(line)
    if "pid" not in answer:
        conn.close()
        return None
    return ServerChild(int(answer["pid"]), conn, rest)
