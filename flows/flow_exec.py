"""The command ``convoy prefect-worker`` gives each flow run (:mod:`flows.flow_worker`).

With the flow server's socket in the environment (``CONVOY_FLOW_SERVER``), the flow run is forked
by the pre-imported :mod:`flows.flow_server` and this process stands in for it: it passes on its
stdio, environment and signals, and exits as the flow run did (killed by a signal: by the same
signal), so the worker reports what it would have reported.  Without a server, or when it does
not answer, it becomes ``python -m prefect.engine`` (exec, the same pid).

Only the standard library, imported lazily: this runs on every relaunch's critical path.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

# = tasks.supervision.zygote_from_server.FLOW_SERVER_ENV (not imported: the tasks package is heavy)
SOCKET_ENV = "CONVOY_FLOW_SERVER"


def engine_in_place() -> None:
    """No server: what Prefect's own default command does."""
    os.execv(sys.executable, [sys.executable, "-m", "prefect.engine", *sys.argv[1:]])


def connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        print(f"convoy: flow server {path} not reachable ({exc}); starting the flow run in a new interpreter")
        sock.close()
        return None
    return sock


def main() -> None:
    path = os.environ.get(SOCKET_ENV)
    sock = connect(path) if path else None
    if sock is None:
        engine_in_place()
        return
    lifeline_r, lifeline_w = os.pipe()  # only this process holds the write end: the child dies with it
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "client_pid": os.getpid()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2, lifeline_r])
    os.close(lifeline_r)
    replies = sock.makefile("r")
    first = json.loads(replies.readline() or "{}")
    if "pid" not in first:
        print(f"convoy: flow server refused the fork ({first.get('error', 'no answer')}); starting it here")
        os.close(lifeline_w)
        engine_in_place()
        return
    child = int(first["pid"])

    def relay(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, relay)
    line = replies.readline()
    code = int(json.loads(line)["returncode"]) if line else 1
    if code < 0:  # killed by a signal: so is this process, as the worker must see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
