"""A pre-imported start for flow runs: a process with Prefect, flow ``train`` and torch imported
forks each flow run the Prefect worker starts (issue 30, item 4).

Why: a flow run relaunched after its process died (the restart automation of
:mod:`flows.flow_liveness`) used to start a new interpreter that imported Prefect, the flow and
torch (1.1 s + 2.7 s measured on a relaunch, the crashed run's hook process competing for the same
cores) before its first line ran; every GPU of the job idles meanwhile.  ``convoy prefect-worker`` starts
this server beside ``prefect worker start`` and the deployment's command (``prefect.yaml``,
``python -m flows.flow_exec``) asks it for a fork, which begins in milliseconds.

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
from dataclasses import dataclass
from pathlib import Path

from training.zygote import fork_hazards, os_threads

#: The server's socket, in the environment of ``prefect worker start`` and so of the client.
SOCKET_ENV = "CONVOY_FLOW_SERVER"
MAX_MESSAGE = 1 << 20


#: What every flow run of flow ``train`` imports before its first step: Prefect's engine, the flow
#: and its tasks, torch with the example task (the config's validation imports the task's module)
#: and MLflow with its SQL store (the run's MLflow run is opened before the first chunk: 1.3 s of
#: imports measured there).  MLflow's imports leave a ``jemalloc_bg_thd`` OS thread (pyarrow's
#: allocator, which registers its own fork handlers); the hazard check counts threads from after
#: these imports.
PRELOAD = (
    "prefect.engine",
    "prefect.flow_engine",
    "torch",
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
    """What the client sends: how ``python -m prefect.engine`` would have been started."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    client_pid: int


class FlowServer:
    """Accepts clients, forks one flow-run process each, reports each one's end to its client."""

    def __init__(self, listener: socket.socket, baseline_os_threads: int) -> None:
        self.listener = listener
        self.baseline = baseline_os_threads
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client connection, pidfd)

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self.accept()
                else:
                    self.reap(key.data)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 4)
            request = FlowRunRequest(**json.loads(data))
        except (OSError, ValueError, TypeError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"bad request: {exc}"}).encode() + b"\n")
            conn.close()
            return
        hazards = fork_hazards(self.baseline)
        if hazards or len(fds) != 4:
            conn.sendall(json.dumps({"error": "; ".join(hazards) or "expected 4 fds"}).encode() + b"\n")
        else:
            self.fork(conn, request, fds)
        for fd in fds:
            os.close(fd)
        if hazards or len(fds) != 4:
            conn.close()

    def fork(self, conn: socket.socket, request: FlowRunRequest, fds: list[int]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the imports stay shared: a child's first collection would touch every page
        pid = os.fork()
        if pid == 0:
            code = 70
            conn.close()
            try:
                code = become_flow_run(request, fds, self)
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


def become_flow_run(request: FlowRunRequest, fds: list[int], server: FlowServer) -> int:
    """In the forked child: the client's stdio, environment and directory; die with the client;
    then what ``python -m prefect.engine`` does."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    server.selector.close()
    for fd in [server.listener.detach(), *(pidfd for _conn, pidfd in server.children.values())]:
        with contextlib.suppress(OSError):
            os.close(fd)
    for conn, _ in server.children.values():
        conn.close()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    lifeline = fds[3]
    for fd in fds[:3]:
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the client's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
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
        f"convoy flow server ready in {time.perf_counter() - t0:.2f} s on {args.socket} "
        f"(pid {os.getpid()}; imported {', '.join(modules)}){'; hazards: ' + '; '.join(hazards) if hazards else ''}",
        flush=True,
    )
    FlowServer(listener, baseline).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
