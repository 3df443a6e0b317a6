"""``convoy prefect-worker``: a Prefect process worker whose flow runs are forks of a pre-imported
flow server.

The worker is Prefect's own ``ProcessWorker`` run in this process, with one change: a flow run
whose deployment sets no command is started with ``<this interpreter> -m flows.flow_exec``
instead of ``<this interpreter> -m prefect.engine``; that client asks the server
(:mod:`flows.flow_server`) for a fork and stands in for it.  The command is chosen here, by the
worker, not in ``prefect.yaml``: a plain ``prefect worker start`` (any interpreter, any ``PATH``)
keeps Prefect's default, and this one names its own interpreter, so no ``python`` on ``PATH`` is
assumed anywhere.

The server lives and dies with this process: the kernel sends it SIGTERM when this process dies
however it dies (``PR_SET_PDEATHSIG``); SIGTERM or Ctrl-C here stops the worker, then the server.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.flow_server import READY
from tasks.supervision.process_group import child_setup
from tasks.supervision.zygote_from_server import FLOW_SERVER_ENV

#: What a flow run without a command of its own runs under this worker.
FORKED_COMMAND = [sys.executable, "-m", "flows.flow_exec"]


@dataclass
class WorkerOptions:
    """The options of ``prefect worker start`` that ``convoy prefect-worker`` takes."""

    pool: str
    name: str | None = None
    limit: int | None = None
    work_queues: list[str] = field(default_factory=list)


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


def forking_worker_class() -> type:
    """Prefect's ``ProcessWorker`` whose flow runs default to :data:`FORKED_COMMAND`."""
    from prefect.utilities.processutils import command_to_string
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    class ForkingJobConfiguration(ProcessJobConfiguration):
        def prepare_for_flow_run(self, *args: Any, **kwargs: Any) -> None:
            configured = self.command is not None
            super().prepare_for_flow_run(*args, **kwargs)
            if not configured:  # a deployment's own command still wins
                self.command = command_to_string(FORKED_COMMAND)
                self._command_configured = True

    with warnings.catch_warnings():  # a subclass re-registers type "process": in this process only, as meant
        warnings.simplefilter("ignore", UserWarning)

        class ForkingProcessWorker(ProcessWorker):
            job_configuration = ForkingJobConfiguration

    return ForkingProcessWorker


def serve(options: WorkerOptions) -> None:
    """Poll the pool until SIGTERM or Ctrl-C, then stop as ``prefect worker start`` does."""
    import anyio
    from prefect.utilities.processutils import setup_signal_handlers_worker

    worker_cls = forking_worker_class()
    # A crashed flow run's hooks run in this process (Prefect loads the flow here): its modules
    # now, not on the first relaunch's path.
    import flows.train  # noqa: F401

    async def run() -> None:
        worker = worker_cls(
            work_pool_name=options.pool,
            work_queues=options.work_queues or None,
            name=options.name,
            limit=options.limit,
        )
        async with worker:
            await worker.start(printer=print)

    # What ``prefect worker start`` does: SIGTERM becomes SIGINT, which ends the loop.
    setup_signal_handlers_worker(os.getpid(), "the process worker", print)
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(run)
    print(f"Worker {options.name or ''} stopped".replace("  ", " "), flush=True)


def run_worker(options: WorkerOptions, log: Callable[[str], None]) -> int:
    """Start the server, then serve the pool with its socket in the flow runs' environment."""
    home = Path(tempfile.mkdtemp(prefix="convoy-flow-server-"))
    socket_path = home / "flows.sock"
    server = start_server(socket_path, log)
    os.environ[FLOW_SERVER_ENV] = str(socket_path)  # the job's environment is this process's (ProcessWorker)
    try:
        serve(options)
        return 0
    finally:
        server.terminate()  # it stops accepting and leaves once the flow runs it forked have ended
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=2)
        if server.poll() is None:
            log("waiting for the flow runs started by this worker to end (Ctrl-C again stops them)")
            try:
                server.wait()
            except KeyboardInterrupt:
                server.kill()
                server.wait()
        socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            home.rmdir()
