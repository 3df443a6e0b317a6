"""``convoy plan``: the checkpoint interval and retries a run's failure rate and save cost call
for (:mod:`training.checkpointing.reliability`), from numbers given or measured in a run dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.table import Table

from flows.cli.common import console, fail
from training.events import FailureKind


def plan(
    gpus: int = typer.Option(8, help="number of GPUs (N)"),
    failure_rate_per_day: float = typer.Option(0.001, help="failures per GPU per day (lambda)"),
    job_hours: float = typer.Option(24.0, help="job length in hours"),
    save_hours: float | None = typer.Option(None, help="checkpoint save time in hours"),
    params: float | None = typer.Option(None, help="model parameters, to estimate size and save time"),
    bandwidth_gb_s: float = typer.Option(1.0, help="storage bandwidth (GB/s) for the estimate"),
    restart_minutes: float = typer.Option(5.0, help="time to detect, reload and rebuild (MTTR)"),
    interval_hours: float | None = typer.Option(None, help="your checkpoint interval, to compare"),
    keep_last: int = typer.Option(3, help="checkpoints kept (storage estimate)"),
    gpus_per_node: int = typer.Option(8, help="GPUs per node (host memory per node)"),
    from_run: Path | None = typer.Option(None, help="fill measured save time and failures from a run dir"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Failure probability, MTBF, Young/Daly interval, overhead, availability for a job."""
    from pydantic import ValidationError

    from training.checkpointing.reliability import PlanInput
    from training.checkpointing.reliability import plan as make_plan

    values = {
        k: v
        for k, v in dict(
            gpus=gpus,
            failure_rate_per_day=failure_rate_per_day,
            job_hours=job_hours,
            save_hours=save_hours,
            params=params,
            bandwidth_gb_s=bandwidth_gb_s,
            restart_minutes=restart_minutes,
            interval_hours=interval_hours,
            keep_last=keep_last,
            gpus_per_node=gpus_per_node,
        ).items()
        if v is not None
    }
    if from_run is not None:
        values.update(_measured_from_run(from_run, values))
    try:
        inp = PlanInput(**values)
    except ValidationError as exc:
        from training.config import format_validation_error

        raise fail(format_validation_error(exc, "plan").replace("plan: ", "", 1).replace("_", "-")) from None
    out = make_plan(inp)
    if as_json:
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return
    table = Table(title=f"convoy plan: {inp.gpus} GPUs, {inp.job_hours:g} h job")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in out.items():
        table.add_row(_PLAN_LABELS.get(key, key.replace("_", " ").removesuffix(" hours")), _plan_value(key, value))
    console.print(table)


#: Plan rows whose key, units dropped, would not say what they are.
_PLAN_LABELS = {
    "checkpoint_bytes": "checkpoint size",
    "save_hours": "save time",
    "expected_lost_hours": "expected time lost",
    "storage_bytes": "storage (keep-last copies)",
    "host_copy_replicated_bytes": "host memory per node beside training, replicated",
    "host_copy_sharded_bytes": "host memory per node beside training, sharded",
}


def _plan_value(key: str, value: object) -> str:
    """One plan figure with its unit: hours, bytes, a share of the job in %, yes/no."""
    if value is None:  # the sizes are estimated from --params only
        return "- (give --params)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key.endswith("_bytes"):
        return _bytes(float(value))
    if key.startswith(("overhead", "availability", "reliability")):
        return f"{float(value):.4%}"
    if key.endswith("_hours"):
        return f"{float(value):.4g} h"
    return f"{float(value):.4g}"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _measured_from_run(run_dir: Path, values: dict) -> dict:
    """Median measured blocking-save time and observed failure rate from a run's events."""
    from statistics import median

    from training.event_records import CheckpointSaved, EventLog
    from training.tracking.failure_record import RecordedFailure

    log = EventLog.read(run_dir)
    events = log.all(CheckpointSaved, RecordedFailure)
    if not events:
        raise fail(f"{run_dir}: no events.jsonl; run training first")
    saves = [(e.persist_s or 0.0) + (e.stall_s or 0.0) for e in events if isinstance(e, CheckpointSaved)]
    failures = [e for e in events if isinstance(e, RecordedFailure) and e.kind != FailureKind.CONFIG]
    out: dict = {}
    if saves:
        out["save_hours"] = median(saves) / 3600
    hours = (events[-1].time - events[0].time) / 3600
    if failures and hours > 0:
        out["failure_rate_per_day"] = len(failures) / hours * 24 / values.get("gpus", 8)
    console.print(
        f"from {run_dir}: {len(saves)} saves (median {median(saves) if saves else 0:.3f} s), "
        f"{len(failures)} failures in {hours:.3f} h"
    )
    return out


# `convoy status` and `convoy chaos` live in modules of their own; registered here, between plan and
# pull, because `convoy --help` lists the commands in the order they are registered.
