"""Prefect's temporary API server, started by convoy and stopped when convoy's process ends, however
it ends (issue 44, item 6).

Why: without ``PREFECT_API_URL`` Prefect starts a temporary server (uvicorn, ~200 MB) as a child of
the first process that needs an API and stops it from an ``atexit`` hook.  SIGKILL and SIGTERM
skip ``atexit``: after ``kill -9`` or ``kill`` of ``convoy train`` the server lived on with parent 1,
for as long as the machine ran (3 of 3 times); on a preemptible node they pile up daily.

How: :func:`start_tied_prefect_api` starts the server before Prefect would (Prefect's clients
reuse the one server of this process), then starts a *reaper* (:mod:`flows.reaper`): a small process that holds
the read end of a pipe whose write end only this process holds.  When this process ends the kernel
closes the write end; the reaper then stops the server (SIGTERM, SIGKILL after a grace) and exits.
A normal exit stops the server through Prefect's hook first; the reaper then finds nothing to do.

Invariants:
1. The write end is never inherited by another program (close-on-exec) and only this process's
   own forks could hold it: convoy's forks (flow server, zygote) are started before or without it.
2. The reaper stops only the process it was given, identified by pid *and* start time, so a pid
   reused after the server ended is never signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading

import psutil

#: Seconds the server is given to stop on SIGTERM before SIGKILL.
GRACE_S = 5.0


#: Attribute set on Prefect's server object once a reaper watches its process (its pid).
TIED = "_convoy_tied_pid"


def ephemeral_settings() -> None:
    """Prefect's settings for its temporary server, set before it starts (on this thread: Prefect's
    settings context is read by whoever starts it).  Its start-up on a fresh ``PREFECT_HOME`` runs
    migrations that outlast the default 20 s, hence the longer limit."""
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ:
        return
    import prefect.context

    os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
    # The embedded server's telemetry insert races its own start-up ("database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    prefect.context.refresh_global_settings_context()  # settings were read when prefect was imported


class EarlyStart:
    """:func:`start_tied_prefect_api` on a thread, beside the rest of a command's start-up (the
    config's check builds the task and fetches its first batches, ~2 s; the server's start-up is
    mostly another process's, ~6 s).  :meth:`join` before anything needs the API or before the
    process exits: a process that ended while the server started would leave it untied (rule 2 of
    what this module prevents).  A start that fails here is left to the caller's own call, which
    raises as it always did."""

    def __init__(self) -> None:
        ephemeral_settings()
        self._thread = threading.Thread(target=self._start, name="convoy-prefect-api-start", daemon=True)
        self._thread.start()

    @staticmethod
    def _start() -> None:
        with contextlib.suppress(Exception):
            start_tied_prefect_api()

    def join(self) -> None:
        self._thread.join()


def stop_quietly() -> None:
    """Stop this process's temporary server now, without Prefect's "Stopping temporary server" log
    line: a command refused after :class:`EarlyStart` started it says only its one-line error.
    Prefect's exit hook then finds nothing to stop; the reaper, nothing to reap."""
    from prefect.server.api.server import SubprocessASGIServer

    logger = logging.getLogger("prefect")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        SubprocessASGIServer().stop()
    finally:
        logger.setLevel(level)


def start_tied_prefect_api() -> int | None:
    """Prefect's temporary server for this process, tied to it (its pid; None when a server is
    configured with ``PREFECT_API_URL`` or the temporary one is turned off).  The server stays
    up until the process ends: Prefect's exit hook stops it on a normal exit, after its log and
    event workers have flushed (stopping it earlier lost their last batch: "Error logging to
    API"); the reaper stops it when the process is killed."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    server = SubprocessASGIServer()  # the one instance Prefect's clients use (port None)
    server.start()
    if server.server_process is None:
        return None
    pid = server.server_process.pid
    if getattr(server, TIED, None) != pid:  # one reaper per server process, however often called
        tie_to_this_process(pid)  # its write end stays open until this process ends
        setattr(server, TIED, pid)
    return pid


def tie_to_this_process(pid: int) -> int:
    """Start a reaper that stops ``pid`` (SIGTERM, then SIGKILL) once this process has ended (or
    closed the returned fd: the pipe's write end, never written)."""
    created = psutil.Process(pid).create_time()
    read_end, write_end = os.pipe()  # both close-on-exec (PEP 446): rule 1
    try:
        subprocess.Popen(
            [sys.executable, "-m", "flows.reaper", str(read_end), str(pid), repr(created), str(GRACE_S)],
            stdin=subprocess.DEVNULL,
            pass_fds=(read_end,),
            start_new_session=True,  # a Ctrl-C of the terminal's group must not stop the reaper first
        )
    finally:
        os.close(read_end)
    return write_end
