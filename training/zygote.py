"""The worker zygote: a process that has paid for ``import torch`` and forks ready workers.

Why: a worker started as a new process pays for an interpreter, ``import torch``, the task's
modules and the first ``Optimizer()`` (which imports ``torch._dynamo``): ~2.5 s on the demo
before it restores a few milliseconds of checkpoint, and it pays it again at every failure.  The
zygote pays it once per run, while nothing waits for it, then ``fork()``s a worker whenever one is
needed (first start, every retry, a standby): a few milliseconds, after which the child runs
:func:`training.worker.main` exactly as ``python -m training.worker`` would.  NVIDIA
resiliency-ext's in-process restart exists for the same reason.

``python -m training.zygote --run-dir D`` is started by the flow (:mod:`tasks.supervision.worker_zygote`)
with one end of a ``SOCK_SEQPACKET`` socket pair on the fd named by ``CONVOY_ZYGOTE_FD``.  Messages
are JSON, one per packet: the zygote says :class:`Ready` once its imports are done; each
:class:`ForkRequest` (with the fds of the worker's log and, for a standby, its stdin) is answered
with the child's pid, or why it could not fork; each child's exit is reported as an :class:`Exited`
(the zygote is its parent, so only it can read the status).  End of input: the flow is gone, and
the zygote leaves.

Fork-safety rules this relies on (checked before every fork, :func:`fork_hazards`):

1. **No CUDA in the zygote.**  A CUDA context does not survive ``fork()``; the zygote only imports,
   and each child initialises its own device (``torch.cuda.is_initialized()`` is false here).
2. **No Python thread but the main one.**  A lock held by another thread at the fork stays locked
   forever in the child.  The zygote starts none; a library that did would be refused.
3. **No parallel torch op before the fork.**  GNU OpenMP's thread pool is not fork-safe: a child
   of a process that used it may hang in its first parallel region.  The zygote computes nothing,
   so the pool is created in each child.  The one OS thread numpy's OpenBLAS starts at import is
   fork-safe (OpenBLAS stops and restarts its pool around ``fork()`` with ``pthread_atfork``); any
   OS thread beyond those present when the imports finished is refused.
4. **What a fresh process reads from its environment is set again in the child**: the environment
   itself, the working directory, the intra-op thread count (OpenMP reads ``OMP_NUM_THREADS`` when
   it is loaded, i.e. in the zygote), and ``CONVOY_FAULTS`` (read once and cached).

A child's results are bitwise those of a spawned worker (tests/test_zygote.py).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.events import FORKED_BY_ENV

#: The fd number of the zygote's end of the control socket (set by the flow when it starts it).
FD_ENV = "CONVOY_ZYGOTE_FD"
#: Largest control message (a request carries the environment).
MAX_MESSAGE = 1 << 20


@dataclass(frozen=True)
class ForkRequest:
    """Fork one worker: ``argv`` for :func:`training.worker.main`, its whole environment and
    working directory.  ``status_path``: where the child writes its exit code, read when the zygote
    that could report it is gone.  The log (and a standby's stdin) travel as fds."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    status_path: str
    with_stdin: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"op": "fork", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ForkRequest:
        return cls(list(d["argv"]), dict(d["env"]), str(d["cwd"]), str(d["status_path"]), bool(d.get("with_stdin")))


@dataclass(frozen=True)
class Ready:
    """The zygote's first message: its pid, how long its imports took, and what the fork-safety
    rules check (empty ``hazards``: none is broken)."""

    pid: int
    import_s: float
    modules: list[str] = field(default_factory=list)
    cuda_initialized: bool = False
    hazards: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ready:
        return cls(
            int(d["pid"]),
            float(d["import_s"]),
            list(d.get("modules", [])),
            bool(d.get("cuda_initialized")),
            list(d.get("hazards", [])),
        )

    def as_dict(self) -> dict[str, Any]:
        return {"ready": True, **asdict(self)}


@dataclass(frozen=True)
class Exited:
    """A child ended: its pid and its status as ``subprocess`` reports one (negative: a signal)."""

    pid: int
    returncode: int

    def as_dict(self) -> dict[str, Any]:
        return {"exited": self.pid, "returncode": self.returncode}


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


# ---------------------------------------------------------------------------------- the zygote
def preload(run_dir: Path) -> list[str]:
    """Import what every worker of this run imports (invariant: nothing is computed): torch, the
    worker's modules, ``torch._dynamo`` (the first ``Optimizer()`` imports it) and the task's
    module.  Returns the modules imported."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    import training.worker  # noqa: F401
    from training.rundir import load_run_config

    task_module = load_run_config(run_dir).task.partition(":")[0]
    importlib.import_module(task_module)
    return ["torch", "torch._dynamo", "training.worker", task_module]


def os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def fork_hazards(baseline_os_threads: int) -> list[str]:
    """What would make a fork unsafe now (rules 1-3 of the module docstring); empty when none."""
    hazards = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        hazards.append("CUDA is initialised in the zygote")
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        hazards.append(f"Python threads besides the main one: {', '.join(others)}")
    if os_threads() > baseline_os_threads:
        hazards.append(f"{os_threads()} OS threads, {baseline_os_threads} after the imports")
    return hazards


class Zygote:
    """The serving loop: fork on request, reap children and report their exits."""

    def __init__(self, sock: socket.socket, baseline_os_threads: int) -> None:
        self.sock = sock
        self.baseline = baseline_os_threads
        self.children: set[int] = set()
        # SIGCHLD wakes the select below through this pipe (set_wakeup_fd), so an exit is
        # reported the moment it happens rather than at the next poll.
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def serve(self) -> None:
        import select

        while True:
            readable, _, _ = select.select([self.sock, self.wake_r], [], [])
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 512)
            self.reap()
            if self.sock in readable and not self.handle():
                return

    def reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                self.children.discard(pid)
                continue
            if done:
                self.children.discard(pid)
                with contextlib.suppress(OSError):
                    send(self.sock, Exited(pid, os.waitstatus_to_exitcode(status)).as_dict())

    def handle(self) -> bool:
        """Serve one message; False at end of input (the flow is gone)."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
        except OSError:
            return False
        if not data:
            return False
        message = json.loads(data)
        if message.get("op") == "fork":
            self.fork(ForkRequest.from_dict(message), fds)
        for fd in fds:
            os.close(fd)
        return True

    def fork(self, request: ForkRequest, fds: list[int]) -> None:
        hazards = fork_hazards(self.baseline)
        if hazards:
            send(self.sock, {"error": "; ".join(hazards)})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # Everything imported so far into the garbage collector's permanent generation: a child's
        # first full collection would otherwise walk (and, through reference counts, copy page by
        # page) every object of torch's modules, ~0.7 s measured on the first step of a fork.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            code = 70  # EX_SOFTWARE: the child never returns into this loop
            try:
                code = become_worker(request, fds, self)
            finally:
                os._exit(code)
        self.children.add(pid)
        send(self.sock, {"pid": pid})


# ---------------------------------------------------------------------------------- the child
def become_worker(request: ForkRequest, fds: list[int], zygote: Zygote) -> int:
    """In the forked child: leave the zygote's world (rule 4), run the worker, exit as it says."""
    zygote_pid = os.getppid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    for fd in (zygote.sock.detach(), zygote.wake_r, zygote.wake_w):
        with contextlib.suppress(OSError):
            os.close(fd)
    os.setsid()  # its own process group: the supervisor stops the worker and its loader workers together
    log_fd = fds[0]
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    stdin_fd = fds[1] if request.with_stdin and len(fds) > 1 else os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin_fd, 0)
    for fd in {log_fd, stdin_fd}:
        os.close(fd)
    os.chdir(request.cwd)
    threads_before = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(request.env)
    os.environ[FORKED_BY_ENV] = str(zygote_pid)
    reset_process_state(threads_before)
    sys.argv = ["-m training.worker", *request.argv]
    from training.loop.lifeline import watch_lifeline
    from training.worker import main

    watch_lifeline()
    try:
        code = main(request.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - what an uncaught exception does in a fresh process
        import traceback

        traceback.print_exc()
        code = 1
    finish(code, Path(request.status_path))
    return code


def reset_process_state(omp_threads_at_load: str | None) -> None:
    """What a fresh interpreter would have read from the environment the zygote did not have."""
    import torch

    from training import faults

    faults.reset()
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    wanted = os.environ.get("OMP_NUM_THREADS")
    if wanted != omp_threads_at_load:
        count = int(wanted) if wanted else len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, count))


def finish(code: int, status_path: Path) -> None:
    """Leave as a fresh process would (its exit handlers run), and leave the exit code where the
    flow finds it if the zygote that would report it is gone."""
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        status_path.write_text(json.dumps({"pid": os.getpid(), "returncode": code, "time": time.time()}))
    atexit._run_exitfuncs()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.zygote", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    args = ap.parse_args(argv)
    sock = socket.socket(fileno=int(os.environ[FD_ENV]))
    t0 = time.perf_counter()
    modules = preload(args.run_dir)
    baseline = os_threads()
    import torch

    ready = Ready(
        os.getpid(), round(time.perf_counter() - t0, 3), modules, torch.cuda.is_initialized(), fork_hazards(baseline)
    )
    send(sock, ready.as_dict())
    Zygote(sock, baseline).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
