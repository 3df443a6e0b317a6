"""What a person reads at the end of ``convoy train``: a short table, links, failures in words.

Why a module of its own: the flow returns a machine summary (``convoy train --json`` prints it
unchanged); this turns it into a handful of lines, and turns a :class:`ChunkFailed` into a
sentence plus the right log and its last lines instead of an exception repr.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from flows.run_summary import RunSummary
from training.event_records import CheckpointFetched
from training.tracking.resume_audit import ResumeAudit

if TYPE_CHECKING:
    from training.tracking.progress import RunStatus

#: MLflow 3 opens on its GenAI pages; this query selects the classic machine-learning view.
ML_VIEW = "workflowType=machine_learning"
LOG_LINES = 8


#: Where ``mlflow ui`` serves when given no ``--host``/``--port``.
MLFLOW_UI_DEFAULT = "http://127.0.0.1:5000"


def mlflow_link(run_dir: str | Path) -> tuple[str | None, str | None]:
    """(URL of the run in the MLflow UI, hint how to start that UI), from ``run.json``: built
    from the tracking URI the run actually used.

    A server URI (``http(s)://``) is its own UI.  A local store (``sqlite:``/a path) has no UI
    running: the URL is where ``tracking.mlflow_ui_url`` says it is served (``mlflow ui``'s
    default address without it) and the hint the command that serves that store there."""
    from urllib.parse import urlsplit

    from training.run_identity import RunInfo
    from training.rundir import run_info

    info = run_info(run_dir) or RunInfo()
    run_id, exp_id, uri = info.mlflow_run_id, info.mlflow_experiment_id, info.mlflow_tracking_uri
    if not run_id or not uri:
        return None, None
    path = f"#/experiments/{exp_id}/runs/{run_id}?{ML_VIEW}" if exp_id else f"#/runs/{run_id}?{ML_VIEW}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{path}", None
    ui = (info.mlflow_ui or MLFLOW_UI_DEFAULT).rstrip("/")
    where = urlsplit(ui)
    serve = f" --host {where.hostname}" if where.hostname not in (None, "127.0.0.1", "localhost") else ""
    serve += f" --port {where.port}" if where.port not in (None, 5000) else ""
    return f"{ui}/{path}", f"mlflow ui --backend-store-uri {uri}{serve}"


def prefect_link(flow_run_id: str | None) -> str | None:
    """The flow run in the Prefect UI (None with an embedded ephemeral API: gone once the command
    ends)."""
    from tasks.artifacts import prefect_ui_url

    return prefect_ui_url(flow_run_id)


def summary_table(summary: RunSummary) -> Table:
    """The end-of-run table: steps, time, chunks, attempts, failures, resumes, steps lost, goodput
    and its largest badput buckets, loss, digest."""
    audit, attempts, kinds = ResumeAudit.from_dict(summary.audit), summary.attempts, summary.failure_kinds
    table = Table(title=f"convoy train: {escape(summary.run_name)}", show_header=False, highlight=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("steps", f"{summary.final_step} (run dir {escape(summary.run_dir)})")
    table.add_row("time", f"{summary.seconds:.1f} s")
    parent = f", {summary.parent_chunks} the parent's" if summary.parent_chunks else ""
    table.add_row("chunks", f"{summary.trained_chunks} trained, {summary.skipped_chunks} already committed{parent}")
    table.add_row("attempts", f"{sum(attempts.values())} for {len(attempts)} chunk(s)")
    table.add_row(
        "failures / resumes",
        f"{audit.failures or 0} / {audit.resumes or 0}" + (f" ({', '.join(kinds)})" if kinds else ""),
    )
    table.add_row("steps lost", str(audit.steps_lost or 0))
    if (goodput := summary.measured_goodput) is not None:
        table.add_row("goodput", escape(goodput.describe()))
    for row in summary.passed_over:
        table.add_row("passed over", escape(f"{row['passed_over']}; resumed from step {row['resumed_from_step']}"))
    if summary.taken_over:
        table.add_row("took over", escape(f"dead flow run(s) {', '.join(summary.taken_over)} (now Crashed)"))
    table.add_row("final loss", loss_text(summary.final_loss, summary.entropy_floor))
    table.add_row("digest", escape(str(summary.digest)))
    for name, value in travel_rows(summary):
        table.add_row(name, escape(value))
    if summary.registered_model:
        table.add_row("model", escape(f"MLflow registered model {summary.registered_model}"))
    return table


def travel_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """Where checkpoints came from (``tracking.dvc``): the flow's fetch at its start and, in pool
    mode, each chunk whose attempts ran on more than one node, with what the later one fetched."""
    rows = []
    got = CheckpointFetched.from_json(summary.fetched or {})  # the flow's checkpoint_fetched event
    if got.step is not None:
        rows.append(("fetched from the remote", f"step {got.step} in {got.fetch_s or 0.0:.2f} s"))
    for r in summary.chunks:
        nodes = [str(n) for n in r.nodes or []]
        if len(set(nodes)) > 1:
            fetched = [CheckpointFetched.from_json(f) for f in r.fetched or []]  # the nodes' events (NodeOutcome)
            fetches = ", ".join(f"step {f.step} on {f.node} in {f.fetch_s or 0.0:.2f} s" for f in fetched)
            rows.append((f"chunk {r.chunk} nodes", " → ".join(nodes) + (f" (fetched {fetches})" if fetches else "")))
    return rows


def loss_text(loss: float | None, floor: float | None) -> str:
    """``1.2712 (entropy floor 1.1758, +0.0954)``: how far the loss is from the lowest the
    corpus allows (no floor for a corpus nobody knows it of)."""
    if loss is None:
        return "-"
    return f"{loss:.4f}" + (f" (entropy floor {floor:.4f}, {loss - floor:+.4f})" if floor is not None else "")


def link_lines(summary: RunSummary) -> list[str]:
    """Where to look next: the MLflow run (machine-learning view) and the Prefect flow run."""
    lines = []
    url, hint = mlflow_link(summary.run_dir)
    if url:
        lines.append(f"MLflow run: {url}" + (f"  (serve it with: {hint})" if hint else ""))
    flow = prefect_link(summary.flow_run_id)
    if flow:
        lines.append(f"Prefect flow run: {flow}")
    return lines


def failure_lines(exc: Any) -> list[str]:
    """A failed chunk in words: kind, step, detection time, resume point, the log and its end.

    The log is read from the file the supervisor followed (for a pipelined worker the log of the
    chunk that started it), so its last lines are there even when the attempt's own tail is empty."""
    from tasks.records.mlflow_audit import log_tail

    d = exc.details
    lines = [f"{exc.kind}: {d.reason or exc.message}"]
    facts = []
    if d.failed_at_step is not None:
        facts.append(f"at step {d.failed_at_step}")
    if d.detected_after_s is not None:
        facts.append(f"detected after {d.detected_after_s:.1f} s")
    if d.resume_step is not None:
        facts.append(f"a retry resumes from step {d.resume_step}")
    if d.steps_lost is not None:
        facts.append(f"{d.steps_lost} step(s) lost")
    if facts:
        lines.append(", ".join(facts))
    if d.passed_over:
        from training.tracking.resume_audit import describe_passed_over

        lines.append(f"passed over (do not verify): {describe_passed_over(d.passed_over)}")
    if d.log:
        lines.append(f"log: {d.log}")
        lines.extend(f"  | {line}" for line in log_tail(d.log, LOG_LINES))
    return lines


# ---------------------------------------------------------------------------------- live progress
#: A non-TTY (CI, `dvc repro` logs) gets a plain line this often, or at every 10 % of the run.
PLAIN_EVERY_S = 30.0
PLAIN_EVERY_FRACTION = 0.1


def progress_line(st: RunStatus, chunk_steps: int) -> str:
    """One line from :func:`training.tracking.progress.read_status`: step/total, chunk k/n and attempt,
    loss, speed, ETA, last checkpoint, failures."""
    total, step = st.total_steps, st.step
    chunks = -(-total // chunk_steps)
    chunk = min(chunks, step // chunk_steps + 1)
    attempt = 1 + sum(1 for c in st.failure_chunks if c == chunk)
    attempt = st.chunk_attempts.get(chunk, attempt)  # numbered across flow runs when known
    parts = [f"step {step}/{total} ({100 * step / total:.0f}%)", f"chunk {chunk}/{chunks} attempt {attempt}"]
    if st.loss is not None:
        parts.append(f"loss {st.loss:.4f}")
    if st.tokens_per_s:
        parts.append(f"{st.tokens_per_s:,.0f} tok/s")
    elif st.samples_per_s:  # a task without tokens
        parts.append(f"{st.samples_per_s:,.0f} samples/s")
    if st.steps_per_s:
        parts.append(f"{st.steps_per_s:.2f} steps/s")
    if st.eta_s is not None:
        parts.append(f"ETA {st.eta_s / 60:.1f} min" if st.eta_s >= 120 else f"ETA {st.eta_s:.0f} s")
    parts.append(f"checkpoint {st.checkpoint_step if st.checkpoint_step is not None else '-'}")
    parts.append(f"failures {st.failures}")
    return " · ".join(parts)


def plain_due(now: float, last_time: float, step: int, last_step: int, total: int) -> bool:
    """Whether a non-TTY should get the next plain line: every 30 s, or 10 % more of the run."""
    return now - last_time >= PLAIN_EVERY_S or step - last_step >= PLAIN_EVERY_FRACTION * total


class _PlainPrinter:
    """Stands in for a Prefect console handler's console: prints through the live console with
    markup off, so a log line's ``[worker rank 0]`` is shown, not read as a style."""

    def __init__(self, console: Any) -> None:
        self.console = console

    def print(self, message: Any, **_: Any) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)


class LiveProgress:
    """A background thread that shows the run's progress while the flow trains in this process.

    On a terminal: one rich live line under Prefect's log lines (Prefect's console handlers print
    through the live console meanwhile, so the two never overwrite each other).  Elsewhere: a
    plain line every :data:`PLAIN_EVERY_S` s or :data:`PLAIN_EVERY_FRACTION` of the run.  Fed by
    :func:`training.tracking.progress.read_status` (heartbeat, metrics, checkpoints, events)."""

    def __init__(self, config: Any, console: Any, every_s: float = 2.0) -> None:
        import threading

        self.config, self.console, self.every_s = config, console, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="convoy-progress", daemon=True)
        self._live: Any = None
        self._swapped: list[tuple[Any, Any]] = []

    def _line(self) -> tuple[str, int] | None:
        from training.tracking.progress import read_status

        run_dir = self.config.run_dir
        if not (run_dir / "config.json").exists():
            return None
        try:
            # The worker verifies what it restores; the line shows no goodput (it reads the whole journal).
            st = read_status(self.config, run_dir, verify=False, goodput=False)
        except Exception:  # noqa: BLE001 - a progress line must never break training
            return None
        return progress_line(st, self.config.train.chunk_steps), st.step

    def _run(self) -> None:
        import time

        last_time, last_step = time.time(), 0
        while not self._stop.wait(self.every_s):
            got = self._line()
            if got is None:
                continue
            line, step = got
            if self._live is not None:
                from rich.text import Text

                self._live.update(Text(line, style="cyan"))
            elif plain_due(time.time(), last_time, step, last_step, self.config.train.total_steps):
                self.console.print(f"progress: {line}", highlight=False, markup=False, soft_wrap=True)
                last_time, last_step = time.time(), step

    def _route_prefect_console(self) -> None:
        """Point Prefect's console handlers at the live console while the line is shown."""
        import logging

        from prefect.logging.handlers import PrefectConsoleHandler

        loggers = [
            logging.getLogger(),
            *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
        ]
        for lg in loggers:
            for h in lg.handlers:
                if isinstance(h, PrefectConsoleHandler):
                    self._swapped.append((h, h.console))
                    h.console = _PlainPrinter(self.console)

    def __enter__(self) -> LiveProgress:
        if self.console.is_terminal:
            from rich.live import Live
            from rich.text import Text

            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=2, transient=True)
            self._live.start()
            self._route_prefect_console()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for handler, original in self._swapped:
            handler.console = original
        if self._live is not None:
            self._live.stop()
