"""Shared fixtures: ONE real Prefect API server for the whole test session (per xdist worker:
`make test` runs two, each a session of its own with its own servers).

Why not Prefect's ephemeral mode: every process that runs a flow would start its own uvicorn
server (12–28 s each, migrations may outlast the default start-up timeout, and a killed flow
process orphans it).  Against one running ``prefect server`` a flow starts in about 2 s.

The server runs in its own process group with a throw-away ``PREFECT_HOME``; the session ends by
killing that group.  It starts only when a selected test asks for ``prefect_api``, at the end of
collection, and the tests that need no server run first, while it comes up (the same for the
MLflow server of ``mlflow_server``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

# One intra-op thread for every training process the tests start, unless the caller chose a count.
# Why: the suite runs two test workers on CI's 2 cores, each starting workers (sometimes 2 ranks)
# beside servers; torch's default (one thread per core) oversubscribes the cores and OpenMP's
# spin-waits burn what is left: a 200-step run of the tiny model took 20.9 s of CPU with the default
# and 14.3 s with one thread, on this 2-core machine.  The tests compare runs with runs started
# the same way, never with a thread count; tests/test_resume.py keeps its kills at several
# threads (where MKL's dynamic threading could break a bitwise resume).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The memory tier of every run the tests start lives in one temporary directory, not in /dev/shm
# (a test that kills a worker leaves its tier behind, as a user's abandoned run would).
if "CONVOY_MEMORY_DIR" not in os.environ:
    os.environ["CONVOY_MEMORY_DIR"] = tempfile.mkdtemp(prefix="convoy-memory-tier-")
    atexit.register(shutil.rmtree, os.environ["CONVOY_MEMORY_DIR"], ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _start_server(
    cmd: list[str], home: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """Start a server in its own process group (stopped whole), its output in ``home/server.log``."""
    log = open(home / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    return proc, log


def _wait_healthy(proc: subprocess.Popen[bytes], home: Path, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{Path(proc.args[0]).name} server did not start: {(home / 'server.log').read_text()[-2000:]}"
            )
        time.sleep(0.5)


@dataclass
class _Server:
    """A server process started in its own process group, its home and health URL."""

    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    home: Path
    url: str


#: Servers started while the quick tests run (pytest_collection_finish), taken by their fixtures.
_EARLY: dict[str, _Server] = {}
_SERVER_FIXTURES = ("prefect_api", "mlflow_server", "mlflow_outage")


def _launch_prefect(home: Path) -> _Server:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_API_URL": url,
    }
    prefect_bin = Path(sys.executable).parent / "prefect"
    cmd = [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return _Server(*_start_server(cmd, home, env=env), home, url)


def _launch_mlflow(home: Path, port: int | None = None) -> _Server:
    """An ``mlflow server`` without MLflow's job execution (GenAI scorers, prompt optimisation:
    nothing convoy uses), which runs a huey consumer of 8 processes (0.77 s of CPU a minute idle
    against 0.12 s without, measured side by side) and leaves its store in a /dev/shm folder each
    time a test kills the server."""
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return _Server(*_start_server(cmd, home, env=env, cwd=home), home, url)


_LAUNCHERS = {"prefect_api": _launch_prefect, "mlflow_server": _launch_mlflow, "mlflow_outage": _launch_mlflow}


#: Seconds a module took on the idle 2-vCPU VM (``pytest --durations=0 -n 2``, 2026-12-06, setup +
#: call + teardown; modules of 30 s or more): the order the xdist workers take modules in.
_MODULE_SECONDS = {
    "test_any_node": 190, "test_run_identity": 235, "test_flow": 164, "test_resume": 160,
    "test_hermetic": 85, "test_hostile_inputs": 155, "test_distributed": 153, "test_stream_adapters": 144,
    "test_conformance": 75, "test_data_pipelines": 98, "test_multinode": 98, "test_deploy": 97,
    "test_memory_tier": 92, "test_real_models": 85, "test_sharded": 83, "test_dvc": 81, "test_chaos": 75,
    "test_report": 71, "test_elastic_streams": 63, "test_config": 63, "test_mlflow": 60, "test_zygote": 58,
    "test_example": 40, "test_supervisor": 38, "test_reliability": 36, "test_standby": 32,
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (:data:`_MODULE_SECONDS`), so the xdist workers end together
    instead of one idling while the other runs a long module handed out last (the longest-first
    rule: ~1 min of a 26 min run here, simulated); but the first module of each worker needs no
    server, so the servers (10-50 s to start) come up in the background meanwhile.  Under xdist
    this order holds only with ``--no-loadscope-reorder``, which the Makefile does not pass: by
    default ``--dist loadfile`` hands out modules by their number of tests.  Measured over a whole
    run (bench/RESULTS.md, 2026-12-06 09:06 UTC): the workers ended together (module sums 1709
    and 1686 s) but the run took 1725 s, not 1570: longest-first runs the CPU-bound modules
    (test_resume, test_distributed, the stream modules) side by side on the two cores, each up to
    2.9x slower, where the default order pairs them with modules that mostly wait.
    Then the modules not listed: those without a server, then those on the Prefect server, then
    those on the MLflow server too.  Whole modules move, so a module-scoped fixture (a trained
    reference run) is built once."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    def needs(item: pytest.Item) -> tuple[bool, ...]:
        return tuple(name in getattr(item, "fixturenames", ()) for name in reversed(_SERVER_FIXTURES))

    rank: dict[str, tuple[bool, ...]] = {}
    for item in items:
        rank[module(item)] = max(rank.get(module(item), ()), needs(item))
    seconds = {m: _MODULE_SECONDS.get(Path(m).stem, 0) for m in rank}
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    serverless = sorted((m for m in rank if not any(rank[m])), key=lambda m: -seconds[m])
    openers = {m: i for i, m in enumerate(serverless[:workers]) if seconds[m]}
    items.sort(key=lambda item: (openers.get(module(item), len(openers)), -seconds[module(item)], rank[module(item)]))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the servers the selected tests will need now, so their start overlaps other tests."""
    if session.config.option.collectonly:
        return
    for name in _SERVER_FIXTURES:
        if any(name in getattr(item, "fixturenames", ()) for item in session.items):
            _EARLY[name] = _LAUNCHERS[name](Path(tempfile.mkdtemp(prefix=f"convoy-{name}-")))


#: What a test must never leave in the checkout: an MLflow store made in the working directory
#: (a run whose tracking URI was not the test's own).
_CHECKOUT = Path(__file__).resolve().parent.parent
_STRAYS = ("mlflow.db", "mlartifacts", "mlruns")
_STRAYS_BEFORE = {name for name in _STRAYS if (_CHECKOUT / name).exists()}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop servers that no fixture took (an interrupted or deselected session); fail the session
    when the tests left an MLflow store in the checkout (the controller checks, once)."""
    from tests.flow_util import stop_group

    for server in _EARLY.values():
        stop_group(server.proc, check=False)
        server.log.close()
    _EARLY.clear()
    if hasattr(session.config, "workerinput"):
        return
    strays = [name for name in _STRAYS if (_CHECKOUT / name).exists() and name not in _STRAYS_BEFORE]
    if strays:
        sys.stderr.write(f"\nERROR: the tests left {', '.join(strays)} in the checkout {_CHECKOUT}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _server(name: str, home: Path) -> _Server:
    """The early-started server of ``name``, or one started now (a fixture used outside the hooks)."""
    return _EARLY.pop(name, None) or _LAUNCHERS[name](home)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``prefect server start`` on 127.0.0.1:<free port>; yield its API URL."""
    import prefect.context

    server = _server("prefect_api", tmp_path_factory.mktemp("prefect-home"))
    proc, log, home, url = server.proc, server.log, server.home, server.url
    try:
        _wait_healthy(proc, home, url, timeout_s=180)
        saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
        os.environ["PREFECT_API_URL"] = url  # for subprocesses (flows started by tests)
        os.environ["PREFECT_HOME"] = str(home)
        # For this process, *including* Prefect's background threads (API log and event workers),
        # which read the process-global settings, not the test thread's context: with a
        # thread-local override they fell back to an ephemeral server of their own.
        prefect.context.refresh_global_settings_context()
        try:
            yield url
        finally:
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            for worker in (APILogWorker, EventsWorker):  # deliver what is queued while the server is up
                with contextlib.suppress(Exception):
                    worker.drain_all(timeout=10)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"  # nothing may reach a dead server
            prefect.context.refresh_global_settings_context()
    finally:
        from tests.flow_util import stop_group

        stop_group(proc, check=False)
        log.close()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example corpus, prepared once for every end-to-end test."""
    from tests.flow_util import config, params
    from training.datapipe.corpus import prepare

    d = tmp_path_factory.mktemp("data")
    cfg = config(params(d, d, "prep"))
    prepare(cfg.data, cfg.train.seed)
    return d


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> str:
    """Digest after TOTAL steps trained by one uninterrupted worker (no Prefect, no chunks)."""
    from tests.flow_util import uninterrupted_digest

    return uninterrupted_digest(tmp_path_factory.mktemp("reference"), data_dir, "reference")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[dict[str, object]]:
    """A real S3-API HTTP endpoint on 127.0.0.1 with one bucket: moto's standalone server, the
    stand-in for AWS S3 or MinIO (no client is patched: DVC's s3fs talks HTTP to it).  ``env`` is
    what a machine using the remote sets: credentials, region and ``AWS_ENDPOINT_URL`` (botocore
    reads it; for MinIO it is the MinIO URL)."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "convoy-test",
        "AWS_SECRET_ACCESS_KEY": "convoy-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    try:
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )
        client.create_bucket(Bucket="convoy-remote")
        yield {"bucket": "convoy-remote", "env": env}
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` (SQLite backend, artifacts served) on 127.0.0.1, for tests where
    several "machines" log into one MLflow run.  Slow to start (15-50 s), so one per session,
    started early (pytest_collection_finish); it runs in its own process group (its job consumers
    included), killed whole at the end."""
    server = _server("mlflow_server", tmp_path_factory.mktemp("mlflow-server"))
    try:
        _wait_healthy(server.proc, server.home, server.url, timeout_s=240)
        yield server.url
    finally:
        from tests.flow_util import stop_group

        stop_group(server.proc, check=False)
        server.log.close()


@pytest.fixture(scope="session")
def mlflow_outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowOutage]:
    """A real ``mlflow server`` of its own for the tests that kill it, freeze it and start it again
    on the same port and store (tests/test_hermetic.py); started early like the shared one."""
    outage = MlflowOutage(_server("mlflow_outage", tmp_path_factory.mktemp("mlflow-outage")))
    try:
        _wait_healthy(outage.server.proc, outage.server.home, outage.server.url, timeout_s=240)
        yield outage
    finally:
        outage.stop()


class MlflowOutage:
    """A tracking server a test can SIGKILL, SIGSTOP/SIGCONT (its whole process group: the server
    and its uvicorn worker) and restart on the same port and SQLite store."""

    def __init__(self, server: _Server) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.proc.pid, sig)

    def kill(self) -> None:
        import signal

        self.signal(signal.SIGKILL)
        self.server.proc.wait(timeout=30)
        self.server.log.close()

    def restart(self, timeout_s: float = 240) -> None:
        """Start it again on the same port and store; returns once it answers."""
        port = int(self.server.url.rsplit(":", 1)[1])
        self.server = _launch_mlflow(self.server.home, port)
        _wait_healthy(self.server.proc, self.server.home, self.server.url, timeout_s)

    def stop(self) -> None:
        import signal

        from tests.flow_util import stop_group

        self.signal(signal.SIGCONT)  # a frozen server cannot stop
        stop_group(self.server.proc, check=False)
        self.server.log.close()


@pytest.fixture(autouse=True)
def _no_leaked_tracking_uri() -> Iterator[None]:
    """A test must not leave ``$MLFLOW_TRACKING_URI`` behind (``mlflow.set_tracking_uri`` writes
    it): every later test's subprocesses would log there, e.g. into the checkout."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    after = os.environ.get("MLFLOW_TRACKING_URI")
    assert after == before, f"the test left $MLFLOW_TRACKING_URI={after!r} (it was {before!r})"
