"""``convoy chaos``: train through the real flow while injecting real faults
(:mod:`flows.chaos_drill` runs the drill), then print what each fault cost: a table on stdout,
the diagnosis on stderr, or the whole report as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from flows.cli.common import ParamsArg, SetOpt, config_or_exit, console, err, fail

if TYPE_CHECKING:
    from flows.chaos_drill import ChaosReport


def chaos(
    params: ParamsArg = Path("params.yaml"),
    set_: SetOpt = None,
    faults: str = typer.Option(
        "kill,term,hang,slow,corrupt,delete,diskfull,flowkill",
        help="comma-separated faults, or all: kill (SIGKILL the worker), term (SIGTERM: preemption), "
        "hang (SIGSTOP), slow (one slow step, must not be called a hang), corrupt (flip a byte in "
        "the newest checkpoint, then kill), delete (remove the newest checkpoint, then kill), "
        "diskfull (the next save fails with ENOSPC), flowkill (SIGKILL the flow, then train again)",
    ),
    seed: int = typer.Option(0, help="seed for the moments of injection"),
    timeout_s: float = typer.Option(1800, help="give up on the chaos run after this long"),
    as_json: bool = typer.Option(
        False, "--json", metavar="", help="print the report as JSON on stdout (progress stays on stderr)"
    ),
) -> None:
    """Train through the real flow while injecting real faults; compare with a fault-free run.

    Prints per fault: the step it hit, what it was detected as and after how long, steps lost
    and recovery time; then the final digest against the reference run's. Exit 0 if every
    fault was survived.

    Example: convoy chaos params.yaml --faults kill,hang --seed 1
    """
    from flows.chaos_drill import ChaosRunner, parse_faults

    config_or_exit(params, set_)
    try:
        kinds = parse_faults(faults)
    except ValueError as exc:
        raise fail(str(exc)) from None
    runner = ChaosRunner(
        params,
        set_ or [],
        kinds,
        seed,
        timeout_s=timeout_s,
        log=lambda m: err.print(f"[chaos] {m}", highlight=False, markup=False),
    )
    report = runner.run()
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=1) + "\n")
    else:
        _print_chaos_report(report, runner.cfg.run_name)
    raise typer.Exit(0 if report.survived else 1)


def _dash(value: object) -> str:
    """A table cell: ``-`` for an unmeasured (None) value, so the columns stay readable."""
    return str(value if value is not None else "-")


def _chaos_table(report: ChaosReport, run_name: str) -> Table:
    """One row per injected fault: what hit, how it was seen, what it cost."""
    table = Table(title=f"convoy chaos: {run_name}")
    for col in (
        "fault",
        "at step",
        "detected as",
        "detected after s",
        "steps lost",
        "recovery s",
        "survived",
        "note",
    ):
        table.add_column(col)
    for f in report.faults:
        table.add_row(
            f.kind,
            _dash(f.injected_step),
            str(f.detected_as or "-"),
            _dash(f.detected_after_s),
            _dash(f.steps_lost),
            _dash(f.recovery_s),
            "yes" if f.survived else "[red]NO[/]",
            f.note,
        )
    return table


def _print_chaos_report(report: ChaosReport, run_name: str) -> None:
    """The human form of the chaos report: the table on stdout, the diagnosis on stderr."""
    console.print(_chaos_table(report, run_name))
    same = report.final_digest == report.reference_digest
    console.print(f"final digest {report.final_digest} {'==' if same else '!='} reference {report.reference_digest}")
    console.print(
        f"metrics logged exactly once per step: {report.metrics_exactly_once}; "
        f"goodput {report.goodput}; wall {report.wall_s} s; flow exit {report.exit_code}"
    )
    for line in report.diagnosis:
        err.print(line, highlight=False, markup=False)
    console.print("[bold green]SURVIVED[/]" if report.survived else "[bold red]NOT SURVIVED[/]")
