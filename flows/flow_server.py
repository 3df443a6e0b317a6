"""A pre-imported start for flow runs: a process with Prefect, flow ``train`` and torch imported
forks each flow run the Prefect worker starts (issue 30, item 4).

Why: a flow run relaunched after its process died (the restart automation of
:mod:`flows.flow_liveness`) used to start a new interpreter that imported Prefect, the flow and
torch (1.1 s + 2.7 s measured on a relaunch, the crashed run's hook process competing for the same
cores) before its first line ran; every GPU of the job idles meanwhile.  ``convoy prefect-worker`` runs
this server beside Prefect's process worker, which starts each flow run as ``python -m
flows.flow_exec`` (:mod:`flows.flow_worker`); that asks the server for a fork, which begins in
milliseconds.

Protocol (one Unix stream connection per flow run, from :mod:`flows.flow_exec`):

1. the client sends its argv, environment, working directory and pid as JSON, with its stdin,
   stdout and stderr and the read end of a *lifeline* pipe whose write end only it holds
   (SCM_RIGHTS);
2. the server forks; the child becomes the flow-run process (those fds, that environment and
   directory, Prefect's settings read again) and runs ``prefect.engine`` as ``python -m`` would;
   the server answers ``{"pid": ...}``;
3. when the child ends the server answers ``{"returncode": ...}`` (negative: killed by that
   signal), which the client exits with, so the Prefect worker sees what it would have seen.

The child dies by SIGKILL when the client dies (its lifeline hangs up): to Prefect the flow-run
process *is* the client, and a flow that outlived it would train on unseen while the restart
automation starts another.

Fork safety (the rules of :mod:`training.zygote`): the server imports, then never starts a thread,
initialises CUDA or opens a connection; each fork is refused with a reason otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from training.zygote import fork_hazards, os_threads

#: The first words of the line the server prints once it can fork (what its starter waits for).
READY = "convoy flow server ready"
MAX_MESSAGE = 1 << 20
#: The first line of a zygote's log when this server forked it.
FORKED_ZYGOTE = "convoy worker zygote forked by flow server pid"


#: What every flow run of flow ``train`` imports before its first step: Prefect's engine, the flow
#: and its tasks, torch with the example task (the config's validation imports the task's module),
#: what the run's worker zygote imports (``torch._dynamo``, the worker: :func:`training.zygote.preload`)
#: and MLflow with its SQL store (the run's MLflow run is opened before the first chunk: 1.3 s of
#: imports measured there).  MLflow's imports leave a ``jemalloc_bg_thd`` OS thread (pyarrow's
#: allocator, which registers its own fork handlers); the hazard check counts threads from after
#: these imports.
PRELOAD = (
    "prefect.engine",
    "prefect.flow_engine",
    "torch",
    "torch._dynamo",
    "training.worker",
    "flows.train",
    "training.examples.char_gpt",
    "tasks.records.mlflow_runs",
    "mlflow.store.tracking.sqlalchemy_store",
)


def preload() -> list[str]:
    """Import :data:`PRELOAD`; returns the modules imported."""
    for module in PRELOAD:
        importlib.import_module(module)
    return list(PRELOAD)


@dataclass
class FlowRunRequest:
    """What a client sends: how ``python -m prefect.engine`` (``op: flow_run``, from
    :mod:`flows.flow_exec`) or ``python -m training.zygote`` (``op: zygote``, from a flow run's
    :mod:`tasks.supervision.zygote_from_server`) would have been started.  The fds that come with
    it: stdin, stdout, stderr, then the flow run's lifeline, or the zygote's ``keep_fds`` (put at
    those numbers in the child)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    client_pid: int
    op: str = "flow_run"
    keep_fds: list[int] = field(default_factory=list)

    def fd_count(self) -> int:
        return 3 + (len(self.keep_fds) if self.op == "zygote" else 1)


class FlowServer:
    """Accepts clients, forks one flow-run process each, reports each one's end to its client.

    SIGTERM (the worker stopping, or dying: ``PR_SET_PDEATHSIG``) stops the accepting, not the
    flow runs: the server stays until the last one has ended and been reported, as flow runs
    started by a stopped ``prefect worker start`` run on to their end."""

    def __init__(self, listener: socket.socket, baseline_os_threads: int) -> None:
        self.listener = listener
        self.baseline = baseline_os_threads
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client connection, pidfd)
        self.stopping = False

    def stop(self, *_args: object) -> None:
        if not self.stopping:
            self.stopping = True
            self.selector.unregister(self.listener)
            self.listener.close()

    def serve(self) -> None:
        while not (self.stopping and not self.children):
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self.accept()
                else:
                    self.reap(key.data)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 8)
            request = FlowRunRequest(**json.loads(data))
        except (OSError, ValueError, TypeError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"bad request: {exc}"}).encode() + b"\n")
            conn.close()
            return
        problem = "; ".join(fork_hazards(self.baseline))
        if not problem and (request.op not in ("flow_run", "zygote") or len(fds) != request.fd_count()):
            problem = f"op {request.op!r} with {len(fds)} fds"
        if problem:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": problem}).encode() + b"\n")
            conn.close()
        else:
            self.fork(conn, request, fds)
        for fd in fds:
            os.close(fd)

    def fork(self, conn: socket.socket, request: FlowRunRequest, fds: list[int]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the imports stay shared: a child's first collection would touch every page
        pid = os.fork()
        if pid == 0:
            code = 70
            conn.close()
            try:
                become = become_zygote if request.op == "zygote" else become_flow_run
                code = become(request, fds, self)
            finally:
                os._exit(code)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")

    def reap(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        conn.close()


def leave_server(request: FlowRunRequest, fds: list[int], server: FlowServer) -> list[int]:
    """In a forked child: none of the server's sockets or signal handlers, the client's stdio as
    0-2, its environment and directory; returns the fds after the stdio."""
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in a new interpreter
    server.selector.close()
    for fd in [server.listener.detach(), *(pidfd for _conn, pidfd in server.children.values())]:
        with contextlib.suppress(OSError):
            os.close(fd)
    for conn, _ in server.children.values():
        conn.close()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the client's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    return fds[3:]


def become_zygote(request: FlowRunRequest, fds: list[int], server: FlowServer) -> int:
    """In the forked child: the run's worker zygote (:mod:`training.zygote`), in its own session
    as a spawned one is, with the flow's fds at the numbers its workers are told."""
    kept = leave_server(request, fds, server)
    os.setsid()
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in kept]  # out of the way of the targets
    for fd in kept:
        os.close(fd)
    for fd, target in zip(high, request.keep_fds, strict=True):
        os.dup2(fd, target)  # inheritable, as pass_fds leaves them
        os.close(fd)
    from training.zygote import main

    print(f"{FORKED_ZYGOTE} {os.getppid()} (no interpreter start)", flush=True)
    return main(request.argv)


def become_flow_run(request: FlowRunRequest, fds: list[int], server: FlowServer) -> int:
    """In the forked child: die with the client; then what ``python -m prefect.engine`` does."""
    (lifeline,) = leave_server(request, fds, server)
    threading.Thread(target=_die_with_client, args=(lifeline,), name="convoy-flow-lifeline", daemon=True).start()
    import prefect.context

    prefect.context.refresh_global_settings_context()  # the flow run's settings, not the server's
    sys.argv = ["-m prefect.engine", *request.argv]
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does in a fresh process
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()  # Prefect drains its log and event workers at exit
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _die_with_client(lifeline: int) -> None:
    """The client (to Prefect, the flow-run process) is gone: so is this flow run, at once."""
    with contextlib.suppress(OSError):
        while os.read(lifeline, 1):
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.flow_server", description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    modules = preload()
    baseline = os_threads()
    args.socket.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(args.socket))
    listener.listen(16)
    hazards = fork_hazards(baseline)
    print(
        f"{READY} in {time.perf_counter() - t0:.2f} s on {args.socket} "
        f"(pid {os.getpid()}; imported {', '.join(modules)}){'; hazards: ' + '; '.join(hazards) if hazards else ''}",
        flush=True,
    )
    server = FlowServer(listener, baseline)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which stops us by SIGTERM
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
