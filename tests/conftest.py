"""Shared fixtures: ONE real Prefect API server for the whole test session.

Why not Prefect's ephemeral mode: every process that runs a flow would start its own uvicorn
server (12–28 s each, migrations may outlast the default start-up timeout, and a killed flow
process orphans it).  Against one running ``prefect server`` a flow starts in about 2 s.

The server runs in its own process group with a throw-away ``PREFECT_HOME``; the session ends by
killing that group.  The fixture is lazy: only tests that ask for ``prefect_api`` pay for it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest


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


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start ``prefect server start`` on 127.0.0.1:<free port>; yield its API URL."""
    import prefect.context

    home = tmp_path_factory.mktemp("prefect-home")
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
    proc, log = _start_server(cmd, home, env=env)
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
    from training.corpus import prepare

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
    several "machines" log into one MLflow run.  Slow to start (15-50 s), so one per session; it
    runs in its own process group (its job consumers included), killed whole at the end."""
    home = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db"]
    proc, log = _start_server([*cmd, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], home, cwd=home)
    try:
        _wait_healthy(proc, home, url, timeout_s=240)
        yield url
    finally:
        from tests.flow_util import stop_group

        stop_group(proc, check=False)
        log.close()
