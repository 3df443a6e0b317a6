"""The run's worker zygote, seen from the flow: start it, fork workers from it, replace it.

Why: every worker of a run used to be a new interpreter that imports torch (~2.5 s on the demo),
at the first start and at every recovery.  :mod:`training.zygote` pays for that once per run and
forks a ready worker in milliseconds; this module is its other end.  :class:`WorkerZygote` is held
by the run's resources (:class:`tasks.run_resources.RunResources`), started when the flow opens
the run (its imports overlap the flow's own start-up) and asked by the worker source
(:mod:`tasks.supervision.worker_source`) for each worker and each standby.

A forked worker is not this process's child, so what ``subprocess.Popen`` gives for a spawned one
comes another way (:class:`ForkedProcess`): its death from a pidfd (at once, like any worker,
:class:`tasks.supervision.worker_handle.DeathWatch`), its exit status from the zygote that reaps it
(:class:`training.zygote.Exited`), or — when that zygote died in the meantime — from the status file
the worker writes as it exits; a worker that left neither was killed (reported as SIGKILL).

The zygote's own death (end of the control socket) is seen by the reader thread, which starts a
replacement at once, off the critical path: workers it forked train on (their tie to the flow is
the lifeline pipe, :mod:`training.loop.lifeline`, not the zygote), and a worker needed before the new
zygote is ready is spawned the old way.  Local mode and one rank only: a multi-rank worker is a
torchrun group, and a pool node runs one chunk per process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tasks.supervision.worker_handle import WorkerHandle
from tasks.supervision.zygote_from_server import fork_zygote
from training.events import LIFELINE_FD_ENV, Event, append_event
from training.paths import RunPaths
from training.zygote import FD_ENV, MAX_MESSAGE, ForkRequest, Ready

log = logging.getLogger("convoy.zygote")

#: How long a fork waits for a zygote that is still importing.
_READY_S = 60.0
#: How long a request waits for the zygote's answer (a fork takes milliseconds).
_ANSWER_S = 10.0
#: How long :meth:`ForkedProcess.poll` waits for the zygote's report once the pidfd said "gone".
_STATUS_S = 2.0


def worker_args(cmd: Sequence[str]) -> list[str] | None:
    """The arguments of ``python -m training.worker ...`` (what a forked worker's ``main`` takes);
    None for any other command (torchrun, a remote launch): those are spawned."""
    cmd = list(cmd)
    if len(cmd) >= 3 and cmd[1:3] == ["-m", "training.worker"]:
        return cmd[3:]
    return None


class ForkedProcess:
    """A worker forked by the zygote, with the part of ``subprocess.Popen``'s interface the
    supervisor uses (``pid``, ``poll``, ``wait``, ``returncode``, ``stdin``)."""

    def __init__(self, pid: int, zygote: WorkerZygote, status_path: Path, stdin: IO[bytes] | None) -> None:
        self.pid, self.zygote, self.status_path, self.stdin = pid, zygote, status_path, stdin
        self.returncode: int | None = None
        self.args = ["forked", str(pid)]

    def _gone(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        with contextlib.suppress(OSError, ValueError, IndexError):  # a zombie: exited, not reaped yet
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        return False

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid)
        if self.returncode is None and self._gone():
            self.returncode = self.zygote.wait_exit_status(self.pid, _STATUS_S)
            if self.returncode is None:  # its zygote died before reporting: the worker's own word
                said = self._status_file()
                self.returncode = said if said is not None else -signal.SIGKILL
        if self.returncode is not None:
            self.status_path.unlink(missing_ok=True)
        return self.returncode

    def _status_file(self) -> int | None:
        try:
            return int(json.loads(self.status_path.read_text())["returncode"])
        except (OSError, ValueError, KeyError):
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


@dataclass
class _Link:
    """One zygote process and the flow's end of its control socket."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    ready: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    info: Ready | None = None

    def wait_ready(self, timeout_s: float) -> bool:
        """Ready now, or once its imports are done (False: it ended first, or the wait ran out)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.05):
            if self.ended.is_set() or time.monotonic() >= deadline:
                return False
        return True


class WorkerZygote:
    """The run's zygote (see the module docstring).  Thread-safe: chunk tasks are threads."""

    def __init__(self, run_dir: str | Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.env = dict(env if env is not None else os.environ)
        # The lifeline: only this process holds the write end (os.pipe fds are not inherited).
        self.lifeline_r, self.lifeline_w = os.pipe()
        os.set_inheritable(self.lifeline_r, True)
        self._lock = threading.Lock()  # one request and its answer at a time
        self._state = threading.Condition()
        self._exits: dict[int, int] = {}
        self._answers: list[dict[str, Any]] = []
        self._link: _Link | None = None
        self.closed = False
        #: The zygote could not start (its imports failed): every worker is spawned.
        self.failed = False
        self.starts = 0
        self._start()

    # ------------------------------------------------------------------ life of the zygote
    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self.env, FD_ENV: str(theirs.fileno()), LIFELINE_FD_ENV: str(self.lifeline_r)}
        self.starts += 1
        log_path = RunPaths(self.run_dir).zygote_log(self.starts)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Under a flow server (``convoy prefect-worker``) the zygote is its fork: no interpreter to
        # start, no torch to import (tasks/supervision/zygote_from_server.py); else spawned.
        forked = fork_zygote(self.run_dir, env, log_path, [theirs.fileno(), self.lifeline_r])
        proc = forked if forked is not None else self._spawn(env, log_path, theirs)
        theirs.close()
        link = _Link(proc, ours)  # type: ignore[arg-type]
        self._link = link
        threading.Thread(target=self._read, args=(link,), name="convoy-zygote-reader", daemon=True).start()

    def _spawn(self, env: dict[str, str], log_path: Path, theirs: socket.socket) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "training.zygote", "--run-dir", str(self.run_dir)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(theirs.fileno(), self.lifeline_r),
                # No parent-death signal: it would fire when the *thread* that started it ends (a
                # replacement is started by the reader thread of the one it replaces).  The end of
                # its control socket, which only this process holds, tells it the flow is gone.
                start_new_session=True,
            )

    def _read(self, link: _Link) -> None:
        """Dispatch the zygote's messages until its socket ends; then replace it (unless closing)."""
        while True:
            try:
                data = link.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._state:
                if "exited" in message:
                    self._exits[int(message["exited"])] = int(message["returncode"])
                elif message.get("ready"):
                    link.info = Ready.from_dict(message)
                    link.ready.set()
                else:
                    self._answers.append(message)
                self._state.notify_all()
        was_ready = link.ready.is_set()
        link.ready.clear()
        link.ended.set()
        with self._state:
            self._state.notify_all()
        with contextlib.suppress(OSError):
            link.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            link.proc.wait(timeout=5)
        if self.closed or self._link is not link:
            return
        rc = link.proc.returncode
        if not was_ready:  # it could not even import the task: another would fail the same way
            self.failed = True
            log.warning("worker zygote pid %d ended before it was ready (%s): workers are spawned", link.proc.pid, rc)
            return
        append_event(self.run_dir, Event.ZYGOTE_REPLACED, pid=link.proc.pid, returncode=rc)
        log.warning("worker zygote pid %d ended (%s); starting another", link.proc.pid, rc)
        self._start()

    @property
    def pid(self) -> int | None:
        link = self._link
        return link.proc.pid if link is not None else None

    def wait_ready(self, timeout_s: float) -> Ready | None:
        """The zygote's :class:`~training.zygote.Ready` once its imports are done; None if it
        ended first or ``timeout_s`` passed."""
        link = self._link
        if link is None or not link.wait_ready(timeout_s):
            return None
        return link.info

    # ------------------------------------------------------------------ forking
    def fork(
        self,
        cmd: Sequence[str],
        log_path: Path,
        header: str,
        *,
        cwd: str | Path | None,
        env: dict[str, str],
        stdin: bool = False,
    ) -> WorkerHandle | None:
        """A worker forked for ``cmd`` (``python -m training.worker ...``), its output appended to
        ``log_path`` after a ``# convoy`` header line; None when the zygote cannot (not ready, gone,
        refused a fork, another command): the caller spawns one."""
        args = worker_args(cmd)
        link = self._link
        # A zygote still importing is waited for: a spawned worker would import the same in parallel.
        if args is None or self.closed or self.failed or link is None or not link.wait_ready(_READY_S):
            return None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        status_path = RunPaths(self.run_dir).exit_status(time.time_ns())
        request = ForkRequest(
            args,
            {**env, "PYTHONUNBUFFERED": "1", LIFELINE_FD_ENV: str(self.lifeline_r)},
            str(Path(cwd or os.getcwd()).resolve()),
            str(status_path),
            with_stdin=stdin,
        )
        stdin_r = stdin_w = None
        with open(log_path, "ab") as log_file:
            log_file.write(f"# convoy {header} forked by zygote {link.info.pid if link.info else '?'}\n".encode())
            log_file.flush()
            offset = log_file.tell()
            fds = [log_file.fileno()]
            if stdin:
                stdin_r, stdin_w = os.pipe()
                fds.append(stdin_r)
            try:
                answer = self._ask(link, request, fds)
            finally:
                if stdin_r is not None:
                    os.close(stdin_r)
        if "pid" not in answer:
            if stdin_w is not None:
                os.close(stdin_w)
            log.warning("worker zygote could not fork: %s", answer.get("error", answer))
            return None
        pid = int(answer["pid"])
        proc = ForkedProcess(pid, self, status_path, os.fdopen(stdin_w, "wb") if stdin_w is not None else None)
        return WorkerHandle(proc, log_path, offset)  # type: ignore[arg-type]

    def _ask(self, link: _Link, request: ForkRequest, fds: list[int]) -> dict[str, Any]:
        with self._lock:
            try:
                socket.send_fds(link.sock, [json.dumps(request.as_dict()).encode()], fds)
            except OSError as exc:
                return {"error": f"zygote unreachable: {exc}"}
            deadline = time.monotonic() + _ANSWER_S
            with self._state:
                while not self._answers:
                    left = deadline - time.monotonic()
                    if left <= 0 or not link.ready.is_set():
                        return {"error": "no answer from the zygote"}
                    self._state.wait(left)
                return self._answers.pop(0)

    def exit_status(self, pid: int) -> int | None:
        with self._state:
            return self._exits.get(pid)

    def wait_exit_status(self, pid: int, timeout_s: float) -> int | None:
        """The status the zygote reports for ``pid``, waiting up to ``timeout_s`` while a zygote
        that can report it is alive."""
        deadline = time.monotonic() + timeout_s
        with self._state:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                link = self._link
                if left <= 0 or link is None or link.proc.poll() is not None:
                    break
                self._state.wait(min(left, 0.05))
            return self._exits.get(pid)

    # ------------------------------------------------------------------ end
    def close(self, grace_s: float = 5.0) -> None:
        """Stop the zygote (the flow ends).  Workers it forked are the supervisor's to stop."""
        if self.closed:
            return
        self.closed = True
        link = self._link
        if link is not None:
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)
            try:
                link.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                link.proc.kill()
                link.proc.wait(timeout=5)
        for fd in (self.lifeline_r, self.lifeline_w):
            with contextlib.suppress(OSError):
                os.close(fd)
