"""``convoy prefect-worker``: ``prefect worker start`` with a pre-imported flow server beside it.

The server (:mod:`flows.flow_server`) forks the flow runs the worker starts with the deployment's
command (``python -m flows.flow_exec``, ``prefect.yaml``); both live and die together: the server
gets SIGTERM from the kernel when this process dies however it dies (``PR_SET_PDEATHSIG``), and
stopping this process stops the worker first (Prefect's own shutdown), then the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from flows.flow_server import SOCKET_ENV
from tasks.supervision.process_group import child_setup

READY = "convoy flow server ready"


def start_server(socket_path: Path, log: Callable[[str], None], timeout_s: float = 120.0) -> subprocess.Popen:
    """The flow server, once it says it is ready (its imports take seconds)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "flows.flow_server", "--socket", str(socket_path)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=child_setup(os.getpid()),  # noqa: PLW1509 - the server must die with us
    )
    deadline = time.monotonic() + timeout_s
    assert server.stdout is not None
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the flow server exited ({server.wait()}) before it was ready")
        log(line.rstrip())
        if line.startswith(READY):
            server.stdout.close()
            return server
    server.kill()
    raise RuntimeError(f"the flow server was not ready in {timeout_s:g} s")


def run_worker(prefect_args: list[str], log: Callable[[str], None]) -> int:
    """Start the server, then ``prefect worker start <prefect_args>`` with its socket in the
    environment; return the worker's exit code."""
    home = Path(tempfile.mkdtemp(prefix="convoy-flow-server-"))
    socket_path = home / "flows.sock"
    server = start_server(socket_path, log)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, SOCKET_ENV: str(socket_path), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    worker = subprocess.Popen([str(Path(bin_dir) / "prefect"), "worker", "start", *prefect_args], env=env)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        return worker.wait()
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        server.kill()
        server.wait()
        socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            home.rmdir()
