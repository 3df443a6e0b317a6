"""The pre-imported flow start (issue 30 item 4): a real ``flows.flow_server`` forks what real
``flows.flow_exec`` clients ask for, and each client stands in for its fork as Prefect's worker
needs: the exit code comes back, a signal sent to the client reaches the flow run, and a client
that dies takes its flow run with it.  (The whole path under a Prefect worker, with a crash and
the relaunch, is tests/test_deploy.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flows.flow_server import READY
from tasks.supervision.zygote_from_server import FLOW_SERVER_ENV as SOCKET_ENV
from tests.flow_util import REPO


def start_server(sock: Path) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "flows.flow_server", "--socket", str(sock)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    ready = server.stdout.readline()
    assert ready.startswith(READY) and "hazards" not in ready, ready
    return server


@pytest.fixture(scope="module")
def flow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    sock = tmp_path_factory.mktemp("flow-server") / "flows.sock"
    server = start_server(sock)
    yield sock
    server.terminate()
    server.wait(timeout=10)


def client(sock: Path | None, *args: str, api: str = "http://127.0.0.1:9/api") -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api}
    env.pop(SOCKET_ENV, None)
    if sock is not None:
        env[SOCKET_ENV] = str(sock)
    cmd = [sys.executable, "-m", "flows.flow_exec", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def forked_child(server_sock: Path, timeout: float = 20) -> psutil.Process:
    """The flow run the server forked for the one client now connected."""
    server = next(p for p in psutil.process_iter(["cmdline"]) if str(server_sock) in " ".join(p.info["cmdline"] or []))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = server.children()
        if kids:
            return kids[0]
        time.sleep(0.02)
    raise AssertionError("the server forked nothing")


def test_exit_codes_and_signals_pass_through_the_fork(flow_server: Path) -> None:
    # A bad flow run id: prefect.engine logs it and exits 1, in the fork as in a new interpreter.
    bad = client(flow_server, "not-a-uuid")
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 1 and "Invalid flow run id" in out, out
    # A flow run whose API is unreachable keeps retrying: SIGTERM to the client reaches the fork,
    # whose end the client reports as its own (killed by SIGTERM, as Prefect's worker would see).
    waiting = client(flow_server, str(uuid.uuid4()))
    child = forked_child(flow_server)
    time.sleep(0.5)
    waiting.send_signal(signal.SIGTERM)
    waiting.communicate(timeout=30)
    assert waiting.returncode in (-signal.SIGTERM, 1, 143), waiting.returncode
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_a_client_killed_takes_its_flow_run_with_it(flow_server: Path) -> None:
    """SIGKILL of the process Prefect sees as the flow run: the fork dies at once (its lifeline
    hangs up), as a flow whose process died; nothing trains on unseen."""
    doomed = client(flow_server, str(uuid.uuid4()))
    child = forked_child(flow_server)
    doomed.kill()
    doomed.wait(timeout=10)
    gone, _alive = psutil.wait_procs([child], timeout=5)
    assert gone, f"the forked flow run {child.pid} outlived its client"


def test_without_a_server_the_client_is_prefects_engine(tmp_path: Path) -> None:
    """No server (a plain ``prefect worker start``) or an unreachable one: the same pid becomes
    ``python -m prefect.engine``."""
    alone = client(None, "not-a-uuid")
    out, _ = alone.communicate(timeout=60)
    assert alone.returncode == 1 and "Invalid flow run id" in out, out
    missing = client(tmp_path / "no.sock", "not-a-uuid")
    out, _ = missing.communicate(timeout=60)
    assert missing.returncode == 1 and "not reachable" in out and "Invalid flow run id" in out, out


def test_a_stopped_server_lets_its_flow_runs_end_first(tmp_path: Path) -> None:
    """SIGTERM to the server (the worker stopping) stops new forks, not the flow runs it forked:
    it reports the last one's end to its client, then leaves."""
    sock = tmp_path / "flows.sock"
    server = start_server(sock)
    try:
        running = client(sock, str(uuid.uuid4()))
        child = forked_child(sock)
        server.terminate()
        time.sleep(1.0)
        assert server.poll() is None and child.is_running() and running.poll() is None
        assert client(sock, "not-a-uuid").wait(timeout=60) == 1  # refused (no socket): run in place
        with contextlib.suppress(psutil.NoSuchProcess):  # it may have given up on the API by now
            child.terminate()
        running.communicate(timeout=30)
        assert running.returncode in (-signal.SIGTERM, 1, 143), running.returncode
        assert server.wait(timeout=10) == 0
    finally:
        server.kill()
        server.wait()
