"""``convoy status``: where a run stands now, read from its run directory alone, as a table for a
person (refreshed live with ``--follow``) or as JSON.  The figures come from
:func:`training.tracking.progress.run_status`; this module only shows them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import console, fail
from training.config import ConfigError

if TYPE_CHECKING:
    from training.tracking.progress import RunStatus

STATE_COLOUR = {"running": "green", "finished": "bold green", "failed": "red", "dead": "red"}  # else yellow


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _status_table(facts: RunStatus) -> Table:
    """``convoy status`` for a person: one row per fact, the state coloured."""
    from training.tracking.progress import describe_upload

    colour = STATE_COLOUR.get(facts.state, "yellow")
    total = facts.total_steps
    table = Table(title=f"run {escape(facts.run_name)}", show_header=False, highlight=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("state", f"[{colour}]{facts.state}[/]")
    table.add_row(
        "step",
        f"{facts.step}/{total} ({100 * facts.step / total:.0f}%)" + (f", phase {facts.phase}" if facts.phase else ""),
    )
    who = f"pid {facts.pid} on {escape(str(facts.host))}" if facts.pid else "-"
    table.add_row(
        "heartbeat", f"{_age(facts.heartbeat_age_s)} ago, {who}" if facts.heartbeat_age_s is not None else "none"
    )
    table.add_row("loss", _loss_cell(facts))
    if facts.val_loss is not None:
        table.add_row("validation loss", f"{facts.val_loss:.4f} at step {facts.val_loss_step}")
    if facts.data_samples is not None:
        table.add_row("data", f"{int(facts.data_samples):,} samples trained (epoch {int(facts.data_epoch or 0)})")
    speed = f"{facts.steps_per_s:.2f} steps/s" if facts.steps_per_s else "-"
    if facts.tokens_per_s:
        speed += f", {facts.tokens_per_s:,.0f} tokens/s"
    elif facts.samples_per_s:  # a task without tokens
        speed += f", {facts.samples_per_s:,.0f} samples/s"
    table.add_row("speed", speed)
    table.add_row("ETA", _age(facts.eta_s) if facts.eta_s is not None else "-")
    digest, since = escape(str(facts.checkpoint_digest)), facts.steps_since_checkpoint
    checkpoint_cell = (
        f"step {facts.checkpoint_step} ({digest}), {since} steps since" if facts.checkpoint else "none yet"
    )
    table.add_row("newest verified checkpoint", checkpoint_cell)
    if (uploaded := describe_upload(facts)) is not None:
        table.add_row("uploaded to the remote", uploaded)
    kinds = f" ({', '.join(facts.failure_kinds)})" if facts.failure_kinds else ""
    table.add_row("failures / resumes", f"{facts.failures} / {facts.resumes}{kinds}")
    table.add_row("steps lost", str(facts.steps_lost))
    if (goodput := facts.measured_goodput()) is not None:
        table.add_row("goodput", escape(goodput.describe()))
    return table


def _loss_cell(facts: RunStatus) -> str:
    """``1.2712 at step 40 (entropy floor 1.1758, +0.0954)``: the loss and how far it is from the floor."""
    floor, loss = facts.entropy_floor, facts.loss
    cell = f"{loss:.4f} at step {facts.loss_step}" if loss is not None else "-"
    if floor is not None:
        cell += f" (entropy floor {floor:.4f}" + (f", {loss - floor:+.4f})" if loss is not None else ")")
    return cell


def status(
    run_dir: Annotated[Path, typer.Argument(help="run directory, e.g. runs/demo")],
    follow: bool = typer.Option(
        False, "--follow", "-f", metavar="", help="refresh every --every seconds until it stops running"
    ),
    every: float = typer.Option(2.0, help="refresh period of --follow, in seconds"),
    as_json: bool = typer.Option(
        False, "--json", metavar="", help="machine-readable output (one JSON object; with --follow one per line)"
    ),
) -> None:
    """Where a run stands now, read from its run directory alone.

    State (running / finished / failed / dead / stopped / never started), the worker's step from
    its heartbeat, heartbeat age, pid and host, loss, speed, ETA, the newest verified checkpoint,
    failures, resumes, steps lost, and goodput so far with its largest badput buckets.

    Example: convoy status runs/demo --follow
    """
    import time

    from rich.live import Live

    from training.rundir import load_run_config
    from training.tracking.progress import read_status

    try:
        cfg = load_run_config(run_dir)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    from training.checkpointing.store import CheckpointStore
    from training.tracking.goodput import StepJournal

    store = CheckpointStore(run_dir)  # one for the command: each checkpoint is hashed once (--follow)
    journal = StepJournal(run_dir)  # and the journal is read on, not again, for each goodput (--follow)
    if as_json:
        while True:
            facts = read_status(cfg, run_dir, store=store, journal=journal)
            sys.stdout.write(json.dumps(facts.as_dict(), separators=(",", ":") if follow else (", ", ": ")) + "\n")
            sys.stdout.flush()
            if not follow or facts.state != "running":
                return
            time.sleep(every)
    facts = read_status(cfg, run_dir, store=store, journal=journal)
    if not follow:
        console.print(_status_table(facts))
        return
    with Live(_status_table(facts), console=console, refresh_per_second=4) as live:
        while facts.state == "running":
            time.sleep(every)
            facts = read_status(cfg, run_dir, store=store, journal=journal)
            live.update(_status_table(facts))
