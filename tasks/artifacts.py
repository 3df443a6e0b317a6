"""Prefect artifacts for a run: the per-chunk table and the failure/resume notes.

Artifacts sharing a key form a versioned history in the UI, so every flow run of one training run
publishes under the same keys: ``convoy-<run>-chunks`` and ``convoy-<run>-failures``.  Publishing
is best effort: an artifact that cannot be written must never fail a chunk that trained fine.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("convoy.artifacts")


def artifact_key(run_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run"
    return f"convoy-{slug}-{what}"


def prefect_ui_base() -> str | None:
    """The Prefect UI's address when a server (``PREFECT_API_URL``) is used; an embedded
    ephemeral API is gone once the command ends, so it has none."""
    from prefect.settings import get_current_settings

    ui = get_current_settings().ui_url
    return ui.rstrip("/") if ui else None


def prefect_ui_url(flow_run_id: str | None) -> str | None:
    """The flow run in the Prefect UI (None without a server)."""
    ui = prefect_ui_base()
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None


def chunk_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chunks table's rows: chunk, step range, status, attempts, failure kinds, loss at the
    boundary, seconds, digest.  Empty cells say "none" / "not committed": a lone "-" renders as
    a bullet in the UI."""
    return [
        {
            "chunk": r["chunk"],
            "steps": f"[{r['start_step']}, {r['end_step']})",
            "status": r.get("status", ""),
            "attempts": r.get("attempts", 0),
            "failures": ", ".join(r.get("failure_kinds", [])) or "none",
            "loss": round(float(r["loss"]), 4) if r.get("loss") is not None else "",
            "seconds": round(float(r.get("seconds", 0.0)), 1),
            "digest": r.get("digest") or "not committed",
        }
        for r in rows
    ]


def publish_chunk_table(run_name: str, rows: list[dict[str, Any]], mlflow_url: str | None = None) -> str | None:
    """This flow run's chunks table (:func:`chunk_table`)."""
    from prefect.artifacts import create_table_artifact

    try:
        return str(
            create_table_artifact(
                table=chunk_table(rows),
                key=artifact_key(run_name, "chunks"),
                description=f"convoy run {run_name}: chunks of this flow run"
                + (f"; metrics and resume audit: [MLflow run]({mlflow_url})" if mlflow_url else ""),
            )
        )
    except Exception as exc:  # noqa: BLE001 - audit must not break training
        log.warning("could not publish the chunk table artifact: %s", exc)
        return None


def note_title(chunk: int | None, attempt: int | None, kind: str) -> str:
    """The title of a failure's note: one wording for every note, so a flow that takes a dead
    one's run over can tell which failures have theirs (:mod:`tasks.missed_notes`)."""
    return f"chunk {chunk} attempt {attempt}: {kind}"


def note_description(run_name: str, title: str = "") -> str:
    """A note's description in Prefect: the run, then its title (without one: the prefix)."""
    return f"convoy run {run_name}: {title}"


def publish_failure_note(run_name: str, title: str, lines: list[str]) -> str | None:
    """Markdown note naming a failure and the step the next attempt resumes from."""
    from prefect.artifacts import create_markdown_artifact

    body = f"### {title}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n"
    try:
        return str(
            create_markdown_artifact(
                markdown=body, key=artifact_key(run_name, "failures"), description=note_description(run_name, title)
            )
        )
    except Exception as exc:  # noqa: BLE001
        log.warning("could not publish the failure artifact: %s", exc)
        return None


class FailureNotes:
    """Failure notes published on a thread of their own, in the order they were said.

    Why: a note is one call to Prefect's API, and it was made between a failure and its retry.
    On the embedded server it took 2.1 s once in 20 two-kill runs (bench/mttr.py, ``twice``: the
    SQLite database busy with the task runs' own writes), the whole tail of that path.  The call
    runs in a copy of the caller's context, so the note still belongs to the failed task run.  The
    run's resources hold one (:class:`tasks.run_resources.RunResources`) and join it before the
    run's final records."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="convoy-notes")
        self._pending: list[Future[Any]] = []
        self._closed = False

    def publish(self, run_name: str, title: str, lines: list[str]) -> None:
        """:func:`publish_failure_note`, without waiting for it."""
        self.later(publish_failure_note, run_name, title, lines)

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` after the notes said so far (a takeover's late notes), without waiting."""
        context = contextvars.copy_context()
        if self._closed:  # said after the run's end (none of convoy's paths does): said now
            with contextlib.suppress(Exception):
                context.run(fn, *args)
            return
        self._pending.append(self._pool.submit(context.run, fn, *args))

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for every note said so far (each logs its own failure; none raises)."""
        pending, self._pending = self._pending, []
        for note in pending:
            with contextlib.suppress(Exception):
                note.result(timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """:meth:`join`, then end the thread: a process that trains many runs (a flow server's
        fork, a test session) kept one idle ``convoy-notes`` thread per run before."""
        self._closed = True
        self.join(timeout_s)
        self._pool.shutdown(wait=False)
