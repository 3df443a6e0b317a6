"""``convoy status``: where a run stands now, read from its run directory alone, as a table for a
person (refreshed live with ``--follow``) or as JSON.  The figures come from
:func:`training.tracking.progress.run_status`; this module only shows them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import console, fail
from training.config import ConfigError

STATE_COLOUR = {"running": "green", "finished": "bold green", "failed": "red", "dead": "red"}  # else yellow


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _status_table(facts: dict) -> Table:
    """``convoy status`` for a person: one row per fact, the state coloured."""
    from training.tracking.progress import describe_upload

    colour = STATE_COLOUR.get(facts["state"], "yellow")
    total = facts["total_steps"]
    table = Table(title=f"run {escape(facts['run_name'])}", show_header=False, highlight=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("state", f"[{colour}]{facts['state']}[/]")
    table.add_row(
        "step",
        f"{facts['step']}/{total} ({100 * facts['step'] / total:.0f}%)"
        + (f", phase {facts['phase']}" if facts["phase"] else ""),
    )
    who = f"pid {facts['pid']} on {escape(str(facts['host']))}" if facts["pid"] else "-"
    table.add_row(
        "heartbeat", f"{_age(facts['heartbeat_age_s'])} ago, {who}" if facts["heartbeat_age_s"] is not None else "none"
    )
    floor = facts.get("entropy_floor")
    loss = f"{facts['loss']:.4f} at step {facts['loss_step']}" if facts["loss"] is not None else "-"
    if floor is not None:
        loss += f" (entropy floor {floor:.4f}" + (
            f", {facts['loss'] - floor:+.4f})" if facts["loss"] is not None else ")"
        )
    table.add_row("loss", loss)
    if facts.get("val_loss") is not None:
        table.add_row("validation loss", f"{facts['val_loss']:.4f} at step {facts['val_loss_step']}")
    if facts.get("data_samples") is not None:
        table.add_row("data", f"{int(facts['data_samples']):,} samples trained (epoch {int(facts['data_epoch'])})")
    speed = f"{facts['steps_per_s']:.2f} steps/s" if facts["steps_per_s"] else "-"
    if facts["tokens_per_s"]:
        speed += f", {facts['tokens_per_s']:,.0f} tokens/s"
    elif facts.get("samples_per_s"):  # a task without tokens
        speed += f", {facts['samples_per_s']:,.0f} samples/s"
    table.add_row("speed", speed)
    table.add_row("ETA", _age(facts["eta_s"]) if facts["eta_s"] is not None else "-")
    checkpoint_cell = (
        (
            f"step {facts['checkpoint_step']} ({escape(facts['checkpoint_digest'])}), "
            f"{facts['steps_since_checkpoint']} steps since"
        )
        if facts["checkpoint"]
        else "none yet"
    )
    table.add_row("newest verified checkpoint", checkpoint_cell)
    if (uploaded := describe_upload(facts)) is not None:
        table.add_row("uploaded to the remote", uploaded)
    kinds = f" ({', '.join(facts['failure_kinds'])})" if facts["failure_kinds"] else ""
    table.add_row("failures / resumes", f"{facts['failures']} / {facts['resumes']}{kinds}")
    table.add_row("steps lost", str(facts["steps_lost"]))
    if facts.get("goodput") is not None:
        from training.tracking.goodput import Goodput

        table.add_row("goodput", escape(Goodput.from_dict(facts).describe()))
    return table


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
    from training.tracking.progress import run_status

    try:
        cfg = load_run_config(run_dir)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    from training.checkpointing.store import CheckpointStore

    store = CheckpointStore(run_dir)  # one for the command: each checkpoint is hashed once (--follow)
    if as_json:
        while True:
            facts = run_status(cfg, run_dir, store=store)
            sys.stdout.write(json.dumps(facts, separators=(",", ":") if follow else (", ", ": ")) + "\n")
            sys.stdout.flush()
            if not follow or facts["state"] != "running":
                return
            time.sleep(every)
    facts = run_status(cfg, run_dir, store=store)
    if not follow:
        console.print(_status_table(facts))
        return
    with Live(_status_table(facts), console=console, refresh_per_second=4) as live:
        while facts["state"] == "running":
            time.sleep(every)
            facts = run_status(cfg, run_dir, store=store)
            live.update(_status_table(facts))
