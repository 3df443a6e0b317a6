"""User-eye audit of what a chaos run leaves in the MLflow and Prefect UIs.

Starts a real MLflow server and a real Prefect server (each in a temporary directory), runs
``convoy chaos`` through them (and, with ``--plain``, a plain ``convoy train``), then takes
full-page screenshots of the pages a person would open with headless Chromium (Playwright) and
saves the REST answers behind them as ``rest.json``.

    /tmp/pw/bin/python bench/ui_audit.py --out /tmp/ui-audit            # servers + workload + shots
    /tmp/pw/bin/python bench/ui_audit.py --out /tmp/ui-audit --keep     # ... and leave the servers up
    /tmp/pw/bin/python bench/ui_audit.py --out /tmp/ui-audit-2 \\
        --reuse http://127.0.0.1:5000 http://127.0.0.1:4200             # only shots + REST, servers already up

Set-up, once (the project does not depend on a browser): ``apt-get install chromium`` and a venv
with Playwright, ``python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright``.
Runs with any Python that has Playwright (stdlib + playwright only); convoy, mlflow and prefect are
run as subprocesses from the project's virtual environment (``--venv``, default ``.venv``).
Chromium: ``--chromium`` (default /usr/bin/chromium).  Output in OUT: the PNGs (named after what
they show), ``rest.json``, ``shots.json`` (each screenshot's URL, whether it worked, and warnings
such as an error text on the page), ``logs/`` (servers, workload).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[ui-audit {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------- HTTP (urllib only)
def http(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def get(url: str, params: dict | None = None, **kw: Any) -> Any:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    return http("GET", url, **kw)


def post(url: str, body: Any, **kw: Any) -> Any:
    return http("POST", url, body if body is not None else {}, **kw)


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- servers
class Servers:
    """The MLflow and Prefect servers this script started (each in its own session, so stopping
    one stops its worker processes too)."""

    def __init__(self, venv: Path, tmp: Path, logs: Path) -> None:
        self.venv, self.tmp, self.logs = venv, tmp, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.mlflow_url = self.prefect_url = ""

    def _start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}-server.log", "ab")  # noqa: SIM115 - kept by Popen
        say(f"starting {name}: {' '.join(cmd)}")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp, start_new_session=True)
        self.procs[name] = p
        return p

    def start(self) -> None:
        mport, pport = free_port(), free_port()
        self.mlflow_url, self.prefect_url = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{pport}"
        env = dict(os.environ)
        # MLflow: SQLite store and proxied artifacts in the temp dir; one uvicorn worker and no
        # job runner (its huey consumers are 7 more processes on a 2-core machine); no telemetry.
        menv = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        mp = self._start(
            "mlflow",
            [
                str(self.venv / "bin" / "mlflow"), "server",
                "--host", "127.0.0.1", "--port", str(mport),
                "--backend-store-uri", f"sqlite:///{self.tmp / 'mlflow.db'}",
                "--artifacts-destination", str(self.tmp / "mlflow-artifacts"),
                "--workers", "1",
            ],
            menv,
        )  # fmt: skip
        # Prefect: its own PREFECT_HOME (SQLite there); the UI must be told where the API is
        # (PREFECT_SERVER_UI_API_URL, default http://127.0.0.1:4200/api: "Unable to connect").
        penv = {
            **env,
            "PREFECT_HOME": str(self.tmp / "prefect-server-home"),
            "PREFECT_SERVER_UI_API_URL": f"{self.prefect_url}/api",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        }
        for k in ("PREFECT_API_URL", "PREFECT_PROFILE"):
            penv.pop(k, None)
        pp = self._start(
            "prefect",
            [str(self.venv / "bin" / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(pport)],
            penv,
        )
        ok_m = wait_http(f"{self.mlflow_url}/health", 180, mp)
        ok_p = wait_http(f"{self.prefect_url}/api/health", 180, pp)
        if not (ok_m and ok_p):
            raise RuntimeError(f"servers did not come up (mlflow {ok_m}, prefect {ok_p}); see {self.logs}")
        say(f"MLflow up at {self.mlflow_url} (pid {mp.pid}), Prefect up at {self.prefect_url} (pid {pp.pid})")

    def stop(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                say(f"{name} server did not stop on SIGTERM: SIGKILL")
            try:  # its session's leftovers (uvicorn workers), stopped or not
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            say(f"stopped {name} server (pid {p.pid})")


# ---------------------------------------------------------------------------- workload
def run_logged(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, tag: str, stdout: Path | None = None) -> int:
    """Run ``cmd``, its stderr (and stdout unless ``stdout``) to ``log``; echo progress lines."""
    say(f"{tag}: {' '.join(cmd)}")
    t = time.monotonic()
    with open(log, "ab") as lf, open(stdout or os.devnull, "wb") as of:
        p = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=of if stdout else subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip

        def pump(stream: Any, echo: bool) -> None:
            for raw in iter(stream.readline, b""):
                lf.write(raw)
                lf.flush()
                line = raw.decode(errors="replace").rstrip()
                if echo and line and not line.startswith((" ", "\x1b")) and len(line) < 300:
                    print(f"    {tag}| {line}", flush=True)

        threads = [threading.Thread(target=pump, args=(p.stderr, True), daemon=True)]
        if not stdout:
            threads.append(threading.Thread(target=pump, args=(p.stdout, True), daemon=True))
        for th in threads:
            th.start()
        try:
            rc = p.wait()
        except KeyboardInterrupt:
            os.killpg(p.pid, signal.SIGTERM)
            raise
        for th in threads:
            th.join(timeout=10)
    say(f"{tag}: exit {rc} after {time.monotonic() - t:.0f} s")
    return rc


def workload(args: argparse.Namespace, srv: Servers, tmp: Path, logs: Path) -> dict[str, Any]:
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(args.params, work / "params.yaml")
    env = {
        **os.environ,
        "PREFECT_API_URL": f"{srv.prefect_url}/api",
        "PREFECT_UI_URL": srv.prefect_url,
        "PREFECT_HOME": str(tmp / "prefect-client-home"),
        "MLFLOW_TRACKING_URI": srv.mlflow_url,
    }
    env.pop("PREFECT_PROFILE", None)
    convoy = str(args.venv / "bin" / "convoy")
    sets: list[str] = []
    for s in args.set:
        sets += ["-S", s]
    out: dict[str, Any] = {"workdir": str(work)}
    t = time.monotonic()
    out["prepare_rc"] = run_logged(
        [convoy, "prepare", "params.yaml", *sets], work, env, logs / "prepare.log", "prepare"
    )
    cmd = [convoy, "chaos", "params.yaml", "--faults", args.faults, "--seed", str(args.seed), "--json", *sets]
    out["chaos_rc"] = run_logged(cmd, work, env, logs / "chaos.log", "chaos", stdout=logs / "chaos.json")
    out["chaos_s"] = round(time.monotonic() - t, 1)
    if args.plain:
        t = time.monotonic()
        out["plain_rc"] = run_logged([convoy, "train", "params.yaml", *sets], work, env, logs / "plain.log", "plain")
        out["plain_s"] = round(time.monotonic() - t, 1)
    return out


# ---------------------------------------------------------------------------- REST proofs
def kv(items: list[dict] | None) -> dict[str, Any]:
    return {t["key"]: t.get("value") for t in items or []}


def tags_of(run: dict) -> dict[str, str]:
    return {t["key"]: t.get("value", "") for t in run.get("data", {}).get("tags", [])}


def paged(fetch: Any, field: str) -> list[dict]:
    """Every item of a paged MLflow answer: ``fetch(page_token)`` until no next_page_token."""
    items: list[dict] = []
    token = None
    while True:
        r = fetch(token) or {}
        items += r.get(field, [])
        token = r.get("next_page_token")
        if not token:
            return items


def find_experiment(api: str, name: str) -> dict:
    exps = post(f"{api}/experiments/search", {"max_results": 1000}).get("experiments", [])
    exp = next((e for e in exps if e.get("name") == name), None)
    cands = [e for e in exps if e.get("name") != "Default"] or exps
    if exp is None and not cands:
        raise RuntimeError(f"no MLflow experiment at {api}")
    return exp or cands[0]


def metric_history(api: str, run_id: str, key: str) -> dict[str, Any]:
    def fetch(tok: str | None) -> dict:
        q = {"run_id": run_id, "metric_key": key, "max_results": 25000} | ({"page_token": tok} if tok else {})
        return get(f"{api}/metrics/get-history", q)

    steps = [p.get("step") for p in paged(fetch, "metrics")]
    return {
        "points": len(steps),
        "distinct_steps": len(set(steps)),
        "steps": steps if len(steps) <= 40 else f"{min(steps)}..{max(steps)}",
    }


def child_info(c: dict) -> dict[str, Any]:
    return {
        "run_id": c["info"]["run_id"],
        "name": c["info"].get("run_name"),
        "status": c["info"].get("status"),
        "tags": {k: v for k, v in tags_of(c).items() if k != "mlflow.log-model.history"},
        "n_params": len(c["data"].get("params", [])),
        "n_metrics": len(c["data"].get("metrics", [])),
    }


def parent_info(api: str, r: dict, runs: list[dict]) -> dict[str, Any]:
    """A training run: tags, params and metric keys, the history of loss, goodput and of the
    failure/resume metrics, and its attempts (child runs), oldest first."""
    metrics = sorted(m["key"] for m in r["data"].get("metrics", []))
    audited = [k for k in metrics if k in ("loss", "goodput") or "fail" in k or "resum" in k]
    children = [c for c in runs if tags_of(c).get("mlflow.parentRunId") == r["info"]["run_id"]]
    return {
        "run_id": r["info"]["run_id"],
        "run_name": r["info"].get("run_name"),
        "status": r["info"].get("status"),
        "tags": tags_of(r),
        "params_keys": sorted(p["key"] for p in r["data"].get("params", [])),
        "metrics_keys": metrics,
        "metric_history": {k: metric_history(api, r["info"]["run_id"], k) for k in audited},
        "children": [child_info(c) for c in sorted(children, key=lambda c: c["info"].get("start_time", 0))],
    }


def logged_models(api: str, eid: str) -> list[dict[str, Any]]:
    models = post(f"{api}/logged-models/search", {"experiment_ids": [eid], "max_results": 100}).get("models", [])
    return [
        {
            "model_id": m["info"].get("model_id"),
            "name": m["info"].get("name"),
            "source_run_id": m["info"].get("source_run_id"),
            "status": m["info"].get("status"),
            "tags": kv(m["info"].get("tags")),
            "params": kv(m.get("data", {}).get("params")),
            "metrics": [
                {k: x.get(k) for k in ("key", "value", "step", "run_id")} for x in m.get("data", {}).get("metrics", [])
            ],
        }
        for m in models
    ]


def registered_models(api: str) -> list[dict[str, Any]]:
    out = []
    fields = ("version", "status", "source", "run_id", "model_id", "description", "current_stage")
    for rm in get(f"{api}/registered-models/search", {"max_results": 100}).get("registered_models", []):
        mvs = get(f"{api}/model-versions/search", {"filter": f"name='{rm['name']}'"}).get("model_versions", [])
        out.append(
            {
                "name": rm["name"],
                "description": rm.get("description"),
                "tags": kv(rm.get("tags")),
                "versions": [{k: v.get(k) for k in fields} | {"tags": kv(v.get("tags"))} for v in mvs],
            }
        )
    return out


def mlflow_rest(base: str, experiment: str) -> dict[str, Any]:
    """The experiment, its training runs (the chaos run, or the one with most failures, first:
    ``main_run_id``) with their attempts, logged models and registered model versions."""
    api = f"{base}/api/2.0/mlflow"
    exp = find_experiment(api, experiment)
    eid = exp["experiment_id"]

    def fetch(tok: str | None) -> dict:
        body = {"experiment_ids": [eid], "max_results": 1000, "order_by": ["attributes.start_time ASC"]}
        return post(f"{api}/runs/search", body | ({"page_token": tok} if tok else {}))

    runs = paged(fetch, "runs")
    parents = [r for r in runs if "mlflow.parentRunId" not in tags_of(r)]

    def score(r: dict) -> tuple:
        failures = tags_of(r).get("convoy.failures", "0")
        n = int(failures) if failures.isdigit() else 0
        return ("chaos" in r["info"].get("run_name", ""), n, r["info"].get("start_time", 0))

    parents.sort(key=score, reverse=True)
    out: dict[str, Any] = {
        "experiment": {"id": eid, "name": exp.get("name"), "tags": kv(exp.get("tags"))},
        "runs_total": len(runs),
        "main_run_id": parents[0]["info"]["run_id"] if parents else None,
        "parents": [parent_info(api, r, runs) for r in parents],
    }
    for key, fn in (
        ("logged_models", lambda: logged_models(api, eid)),
        ("registered_models", lambda: registered_models(api)),
    ):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - a proof missing must not stop the others
            out[f"{key}_error"] = repr(e)
    return out


def prefect_rest(base: str) -> dict[str, Any]:
    api = f"{base}/api"
    frs = post(f"{api}/flow_runs/filter", {"sort": "START_TIME_ASC", "limit": 200}) or []
    trs = post(f"{api}/task_runs/filter", {"sort": "EXPECTED_START_TIME_ASC", "limit": 200}) or []
    arts = list(reversed(post(f"{api}/artifacts/filter", {"sort": "CREATED_DESC", "limit": 200}) or []))
    flows = {f["id"]: f["name"] for f in (post(f"{api}/flows/filter", {"limit": 200}) or [])}
    out: dict[str, Any] = {
        "flow_runs": [
            {
                "name": f["name"],
                "flow": flows.get(f.get("flow_id")),
                "id": f["id"],
                "state": f.get("state_name") or (f.get("state") or {}).get("name"),
                "state_message": (f.get("state") or {}).get("message"),
                "tags": f.get("tags"),
                "start_time": f.get("start_time"),
                "end_time": f.get("end_time"),
                "total_run_time": f.get("total_run_time"),
            }
            for f in frs
        ],
        "task_runs": [],
        "artifacts": [
            {
                "key": a.get("key"),
                "type": a.get("type"),
                "flow_run_id": a.get("flow_run_id"),
                "task_run_id": a.get("task_run_id"),
                "description": a.get("description"),
                "id": a.get("id"),
            }
            for a in arts
        ],
    }
    for t in trs:
        try:
            last = post(
                f"{api}/logs/filter",
                {"logs": {"task_run_id": {"any_": [t["id"]]}}, "sort": "TIMESTAMP_DESC", "limit": 1},
            )
            last_log = last[0]["message"] if last else None
            n_logs = len(post(f"{api}/logs/filter", {"logs": {"task_run_id": {"any_": [t["id"]]}}, "limit": 200}) or [])
        except Exception as e:  # noqa: BLE001
            last_log, n_logs = f"<error {e!r}>", None
        out["task_runs"].append(
            {
                "name": t["name"],
                "id": t["id"],
                "flow_run_id": t.get("flow_run_id"),
                "state_name": t.get("state_name") or (t.get("state") or {}).get("name"),
                "state_message": (t.get("state") or {}).get("message"),
                "run_count": t.get("run_count"),
                "empirical_policy": t.get("empirical_policy"),
                "n_logs": n_logs,
                "last_log": last_log,
            }
        )
    return out


# ---------------------------------------------------------------------------- screenshots
ERROR_TEXTS = re.compile(
    r"Something went wrong|Unable to connect|Page not found|Not Found|(?<![\w.])404(?![\w.])|Internal Server Error"
    r"|does not exist|Error:|RESOURCE_DOES_NOT_EXIST|Failed to fetch|No artifacts|No data|No results|Unauthorized",
    re.IGNORECASE,
)


class Shooter:
    def __init__(self, out: Path, chromium: str) -> None:
        from playwright.sync_api import sync_playwright

        self.out = out
        self.results: list[dict[str, Any]] = []
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        self.ctx = self.browser.new_context(viewport={"width": 1600, "height": 1000})
        # Only the local servers: analytics and CDN calls would keep the network busy forever.
        self.ctx.route(
            re.compile(r"^https?://(?!127\.0\.0\.1|localhost).*"), lambda route: route.abort()
        )  # fmt: skip
        self.page = self.ctx.new_page()
        # Network idle, counted here: Playwright's "networkidle" never comes on MLflow's UI (its
        # telemetry web worker's script stays a pending request forever).
        self._pending: set[int] = set()
        self._last = time.monotonic()

        def start(req: Any) -> None:
            if "telemetry-worker" not in req.url:
                self._pending.add(id(req))
                self._last = time.monotonic()

        def end(req: Any) -> None:
            self._pending.discard(id(req))
            self._last = time.monotonic()

        self.page.on("request", start)
        self.page.on("requestfinished", end)
        self.page.on("requestfailed", end)

    def close(self) -> None:
        try:
            self.browser.close()
        finally:
            self._pw.stop()

    def settle(self, extra_ms: int = 1500, quiet_s: float = 0.7, timeout_s: float = 20.0) -> bool:
        """Wait for no request in flight for ``quiet_s`` (at most ``timeout_s``), then ``extra_ms``
        for charts to draw.  False when the network never went quiet (a UI that polls)."""
        deadline = time.monotonic() + timeout_s
        quiet = False
        while time.monotonic() < deadline:
            if not self._pending and time.monotonic() - self._last >= quiet_s:
                quiet = True
                break
            self.page.wait_for_timeout(100)
        self.page.wait_for_timeout(extra_ms)
        return quiet

    # The tallest scrolled content: MLflow (and Prefect's run pages) scroll inside a container, so a
    # "full page" screenshot alone is one viewport high.
    _CONTENT_HEIGHT_JS = """() => {
        let h = document.documentElement.scrollHeight;
        for (const e of document.querySelectorAll('*')) {
            const s = getComputedStyle(e);
            if ((s.overflowY === 'auto' || s.overflowY === 'scroll') && e.scrollHeight > e.clientHeight + 4
                && e.clientHeight > window.innerHeight * 0.5) {  // the page's own scroller, not a boxed table
                h = Math.max(h, window.innerHeight + (e.scrollHeight - e.clientHeight));
            }
        }
        return h;
    }"""

    def capture(self, path: Path, max_h: int = 8000) -> str:
        """Full-page PNG, the viewport grown to the height of inner scroll containers first (and
        the network let go quiet again: charts and images below the fold load only when shown).
        Returns the page's text as captured."""
        w, h0 = 1600, 1000
        try:
            for _ in range(3):  # a taller viewport can re-layout (virtualised tables render more rows)
                h = min(max_h, int(self.page.evaluate(self._CONTENT_HEIGHT_JS)))
                cur = self.page.viewport_size["height"]
                if h <= cur + 4:
                    break
                self.page.set_viewport_size({"width": w, "height": h})
                self.settle(extra_ms=1000, timeout_s=10)
            text = self.page.inner_text("body", timeout=10000)
            self.page.screenshot(path=str(path), full_page=True, timeout=60000)
            return text
        finally:
            self.page.set_viewport_size({"width": w, "height": h0})

    def shot(self, name: str, url: str | None, prepare: Any = None, expect: tuple[str, ...] = ()) -> bool:
        """Open ``url`` (None: stay on the page), run ``prepare(page)``, save OUT/<name>.png."""
        rec: dict[str, Any] = {"file": f"{name}.png", "url": url, "ok": False, "warnings": []}
        t = time.monotonic()
        try:
            if url:
                # A fresh load each time: a hash-only change would keep the SPA's state (open
                # panels, selection) from the previous page.
                self.page.goto("about:blank")
                self.page.goto(url, wait_until="domcontentloaded", timeout=60000)
                if not self.settle():
                    rec["warnings"].append("network never went quiet (20 s)")
            if prepare is not None:
                note = prepare(self.page)
                if note:
                    rec["warnings"].append(str(note))
                self.settle()
            rec["final_url"] = self.page.url
            text = self.capture(self.out / f"{name}.png")
            rec["text_chars"] = len(text)
            if len(text.strip()) < 80:
                rec["warnings"].append(f"almost no text on the page ({len(text.strip())} chars)")
            for m in ERROR_TEXTS.finditer(text):
                i = m.start()
                rec["warnings"].append(f"page says {text[max(0, i - 60) : i + 80]!r}")
            for e in expect:
                if e not in text:
                    rec["warnings"].append(f"expected text {e!r} not on the page")
            rec["ok"] = True
            warn = f"  WARN {'; '.join(rec['warnings'])}" if rec["warnings"] else ""
            say(f"shot {name}.png ({time.monotonic() - t:.1f} s){warn}")
        except Exception as e:  # noqa: BLE001 - one failed screenshot must not stop the others
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(f"FAILED {name}.png: {rec['error']}")
        self.results.append(rec)
        return rec["ok"]


def prefect_tab(tab_id: str) -> Any:
    """prepare(): click a tab of a Prefect run page (``li.p-tab#<id>``: logs, task-runs, artifacts,
    details, parameters, ...); the UI's ``?tab=`` query does not select one on a fresh load."""

    def prepare(page: Any) -> str | None:
        loc = page.locator(f"li.p-tab#{tab_id}")
        if not loc.count():
            return f"no tab {tab_id!r} on the page"
        loc.first.click(timeout=5000)
        return None

    return prepare


def mlflow_overview(page: Any) -> str | None:
    """prepare() of a run's overview: the side panel closed, the whole description shown."""
    mlflow_tidy(page)
    try:
        more = page.get_by_text("Show more", exact=True)
        if more.count():
            more.first.click(timeout=3000)
    except Exception as e:  # noqa: BLE001
        return f"could not click 'Show more': {type(e).__name__}"
    return None


def mlflow_tidy(page: Any) -> None:
    """Close the "MLflow Assistant" side panel (open by default: it takes a third of the width)."""
    try:
        loc = page.locator("button[data-component-id='mlflow.assistant.chat_panel.close']")
        if loc.count():
            loc.first.click(timeout=3000)
            page.wait_for_timeout(500)
    except Exception:  # noqa: BLE001
        pass


ML = "workflowType=machine_learning"  # MLflow's "Model training" view (not GenAI)


def expand_children(page: Any) -> str | None:
    """prepare() of the runs list: open each parent's "+" (its child runs are collapsed under it)."""
    mlflow_tidy(page)
    loc = page.locator("[role=gridcell] button[data-component-id*='runnamecellrenderer']")
    n = loc.count()
    if not n:
        return "no expand buttons found for child runs"
    for i in range(min(n, 20)):
        try:
            loc.nth(i).click(timeout=3000)
            page.wait_for_timeout(300)
        except Exception as e:  # noqa: BLE001
            return f"expanding parent {i + 1} of {n} failed: {type(e).__name__}"
    return None


def expand_description(page: Any) -> str | None:
    """prepare() of the runs list: the experiment's description unfolded (two lines by default)."""
    mlflow_tidy(page)
    loc = page.locator("button[data-component-id='mlflow.experiment.metadata_editor.expand_button']")
    if not loc.count():
        return "no expand button on the experiment description"
    loc.first.click(timeout=3000)
    return None


def mlflow_parent_shots(sh: Shooter, base: str, eid: str, main: dict[str, Any]) -> None:
    sh.shot("mlflow-home", f"{base}/#/?{ML}", prepare=mlflow_tidy)
    runs = f"{base}/#/experiments/{eid}/runs?{ML}"
    sh.shot("mlflow-runs-list", runs, prepare=expand_children, expect=(main["run_name"] or "",))
    # MLflow has no experiment overview page in the machine-learning view (#/experiments/<id>/overview
    # is a 404): the runs page with the description unfolded, and the experiments list.
    sh.shot("mlflow-experiment-overview", runs, prepare=expand_description)
    sh.shot("mlflow-experiments-list", f"{base}/#/experiments?{ML}", prepare=mlflow_tidy)
    run_url = f"{base}/#/experiments/{eid}/runs/{main['run_id']}"
    sh.shot("mlflow-parent-overview", f"{run_url}?{ML}", prepare=mlflow_overview, expect=("Description",))
    sh.shot("mlflow-parent-charts", f"{run_url}/model-metrics?{ML}", prepare=mlflow_tidy, expect=("loss",))
    sh.shot("mlflow-parent-system-metrics", f"{run_url}/system-metrics?{ML}", prepare=mlflow_tidy)
    for name, path in (("timeline", "convoy/timeline.png"), ("table", "convoy/resume_events.json")):
        url = f"{run_url}/artifacts/{path}?{ML}"
        sh.shot(f"mlflow-parent-artifacts-{name}", url, prepare=mlflow_tidy, expect=(path.split("/")[-1],))


def mlflow_child_shots(sh: Shooter, base: str, eid: str, kids: list[dict[str, Any]]) -> None:
    """A failed attempt (a hang if there is one; one that passed over a checkpoint too), a killed
    one (orphaned by a dead flow), a finished one, and the failed one's worker log."""
    failed = [c for c in kids if c["status"] == "FAILED"]
    first = next((c for c in failed if c["tags"].get("convoy.failure_kind") == "hang"), failed[0] if failed else None)
    passed = next((c for c in failed if c["tags"].get("convoy.passed_over")), None)
    chosen = [
        ("mlflow-child-failed", first),
        ("mlflow-child-failed-passed-over", passed if passed is not first else None),
        ("mlflow-child-killed", next((c for c in kids if c["status"] == "KILLED"), None)),
        ("mlflow-child-finished", next((c for c in kids if c["status"] == "FINISHED"), None)),
    ]
    for name, c in chosen:
        if c is not None:
            url = f"{base}/#/experiments/{eid}/runs/{c['run_id']}?{ML}"
            sh.shot(name, url, prepare=mlflow_overview, expect=(c["name"],))
    if first is not None:
        url = f"{base}/#/experiments/{eid}/runs/{first['run_id']}/artifacts/convoy/worker-log-tail.txt?{ML}"
        sh.shot("mlflow-child-failed-worker-log", url, prepare=mlflow_tidy)


def mlflow_model_shots(sh: Shooter, base: str, eid: str, rid: str, rest: dict[str, Any]) -> None:
    """The training run's logged model (MLflow 3) and its registered model version."""
    every = rest.get("logged_models", [])
    models = [m for m in every if m.get("source_run_id") == rid] or every
    if models:
        model = f"{base}/#/experiments/{eid}/models/{models[0]['model_id']}"
        sh.shot("mlflow-logged-model", f"{model}?{ML}", prepare=mlflow_tidy)
        sh.shot("mlflow-logged-model-artifacts", f"{model}/artifacts?{ML}", prepare=mlflow_tidy)
        sh.shot("mlflow-logged-models-list", f"{base}/#/experiments/{eid}/models?{ML}", prepare=mlflow_tidy)
    rms = rest.get("registered_models", [])
    rm = next((r for r in rms for v in r["versions"] if v.get("run_id") == rid), rms[0] if rms else None)
    if rm and rm["versions"]:
        v = next((v for v in rm["versions"] if v.get("run_id") == rid), rm["versions"][-1])
        name = urllib.parse.quote(rm["name"], safe="")
        sh.shot("mlflow-registered-model", f"{base}/#/models/{name}/versions/{v['version']}?{ML}", prepare=mlflow_tidy)
        sh.shot("mlflow-registered-models-list", f"{base}/#/models?{ML}", prepare=mlflow_tidy)


def mlflow_shots(sh: Shooter, base: str, rest: dict[str, Any]) -> None:
    eid = rest["experiment"]["id"]
    main = next((p for p in rest["parents"] if p["run_id"] == rest.get("main_run_id")), None)
    if main is None:
        say("no MLflow training run found: MLflow shots skipped")
        return
    mlflow_parent_shots(sh, base, eid, main)
    mlflow_child_shots(sh, base, eid, main["children"])
    mlflow_model_shots(sh, base, eid, main["run_id"], rest)


def prefect_shots(sh: Shooter, base: str, rest: dict[str, Any]) -> None:
    sh.shot("prefect-runs", f"{base}/runs")
    for n, fr in enumerate(rest["flow_runs"], 1):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", fr["name"])[:60]
        url = f"{base}/runs/flow-run/{fr['id']}"
        sh.shot(f"prefect-flow-run-{n}-{slug}", url, expect=(fr["name"],))
        sh.shot(f"prefect-flow-run-{n}-artifacts", url, prepare=prefect_tab("artifacts"))
        sh.shot(f"prefect-flow-run-{n}-task-runs", url, prepare=prefect_tab("task-runs"))
    trs = rest["task_runs"]
    retried = [t for t in trs if (t.get("run_count") or 0) > 1]
    seen: set[str] = set()
    for t in retried:
        if t["name"] in seen:
            continue
        seen.add(t["name"])
        sh.shot(f"prefect-task-run-{t['name']}-retried", f"{base}/runs/task-run/{t['id']}", expect=(t["name"],))
    bad = [t for t in trs if t.get("state_name") in ("Crashed", "Failed")]
    for t in bad[:2]:
        sh.shot(
            f"prefect-task-run-{t['name']}-{t['state_name'].lower()}-logs",
            f"{base}/runs/task-run/{t['id']}",
            prepare=prefect_tab("logs"),
        )
    sh.shot("prefect-artifacts-index", f"{base}/artifacts")
    keys = sorted({a["key"] for a in rest["artifacts"] if a.get("key")})
    for k in keys:
        sh.shot(f"prefect-artifact-key-{k}", f"{base}/artifacts/key/{k}")


# ---------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="output directory (screenshots, rest.json, logs/)")
    ap.add_argument("--venv", type=Path, default=Path(".venv"), help="the project's venv (relative: to the repo root)")
    ap.add_argument("--reuse", nargs=2, metavar=("MLFLOW_URL", "PREFECT_URL"), help="servers already up: no workload")
    ap.add_argument("--keep", action="store_true", help="leave the servers running at the end")
    ap.add_argument("--plain", action="store_true", help="also a plain `convoy train` into the same servers")
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml")
    ap.add_argument("--faults", default="all")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "-S",
        "--set",
        action="append",
        default=None,
        help="override for the workload (repeatable; default: total_steps 300, chunk_steps 100, checkpoint every 25)",
    )
    ap.add_argument("--experiment", default="convoy", help="MLflow experiment to audit")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--tmp", type=Path, default=None, help="servers' stores and workload (default: a new temp dir)")
    args = ap.parse_args()
    if args.set is None:
        args.set = ["train.total_steps=300", "train.chunk_steps=100", "checkpoint.every_steps=25"]
    if not args.venv.is_absolute():
        args.venv = (REPO / args.venv).resolve()
    args.params = args.params.resolve()
    args.out = args.out.resolve()
    return args


def collect_rest(mlflow_url: str, prefect_url: str, experiment: str, out: Path) -> dict[str, Any]:
    rest: dict[str, Any] = {"mlflow_url": mlflow_url, "prefect_url": prefect_url}
    for key, fn in (
        ("mlflow", lambda: mlflow_rest(mlflow_url, experiment)),
        ("prefect", lambda: prefect_rest(prefect_url)),
    ):
        say(f"REST: {key}")
        try:
            rest[key] = fn()
        except Exception as e:  # noqa: BLE001 - the screenshots are still worth taking
            rest[f"{key}_error"] = repr(e)
            say(f"{key} REST failed: {e!r}")
    (out / "rest.json").write_text(json.dumps(rest, indent=1, default=str))
    say(f"wrote {out / 'rest.json'}")
    return rest


def take_shots(args: argparse.Namespace, mlflow_url: str, prefect_url: str, rest: dict[str, Any]) -> dict[str, Any]:
    sh = Shooter(args.out, args.chromium)
    try:
        if "mlflow" in rest:
            mlflow_shots(sh, mlflow_url, rest["mlflow"])
        if "prefect" in rest:
            prefect_shots(sh, prefect_url, rest["prefect"])
    finally:
        sh.close()
        (args.out / "shots.json").write_text(json.dumps(sh.results, indent=1))
    failed = [r for r in sh.results if not r["ok"]]
    warned = [r for r in sh.results if r["ok"] and r["warnings"]]
    say(f"{len(sh.results) - len(failed)} screenshots in {args.out}, {len(failed)} failed, {len(warned)} with warnings")
    for r in failed:
        say(f"  failed {r['file']}: {r.get('error')}")
    for r in warned:
        say(f"  warning {r['file']}: {'; '.join(r['warnings'])}")
    return {"ok": len(sh.results) - len(failed), "failed": [r["file"] for r in failed]}


def main() -> int:
    args = parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    srv: Servers | None = None
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}
    try:
        if args.reuse:
            mlflow_url, prefect_url = (u.rstrip("/") for u in args.reuse)
            summary["reuse"] = True
        else:
            tmp = (args.tmp or Path(tempfile.mkdtemp(prefix="convoy-ui-audit-"))).resolve()
            tmp.mkdir(parents=True, exist_ok=True)
            say(f"temp dir {tmp}")
            srv = Servers(args.venv, tmp, logs)
            srv.start()
            mlflow_url, prefect_url = srv.mlflow_url, srv.prefect_url
            summary["tmp"] = str(tmp)
            summary["workload"] = workload(args, srv, tmp, logs)
        summary["mlflow_url"], summary["prefect_url"] = mlflow_url, prefect_url
        rest = collect_rest(mlflow_url, prefect_url, args.experiment, args.out)
        summary["shots"] = take_shots(args, mlflow_url, prefect_url, rest)
    finally:
        summary["elapsed_s"] = round(time.monotonic() - T0, 1)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        if srv is not None and args.keep:
            pids = {k: p.pid for k, p in srv.procs.items()}
            say(f"servers kept: MLflow {srv.mlflow_url} (pid {pids.get('mlflow')}),")
            say(f"              Prefect {srv.prefect_url} (pid {pids.get('prefect')})")
            say(f"rerun the shots: {sys.executable} {Path(__file__)} --out DIR \\")
            say(f"    --reuse {srv.mlflow_url} {srv.prefect_url}")
        elif srv is not None:
            srv.stop()
    say(f"done in {time.monotonic() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
