"""``convoy snapshots``: the memory tiers on this machine (RAM under ``/dev/shm``), whose each is,
what it holds, and whether its run is gone; ``--free`` frees those whose run is gone or that were
not resumed within ``checkpoint.memory_keep_hours`` (:mod:`training.memory_sweep`'s rules; every
flow's start frees them too)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import ParamsArg, SetOpt, config_or_exit, console

if TYPE_CHECKING:
    from training.memory_sweep import TierVerdict


def snapshots(
    params: ParamsArg = Path("params.yaml"),
    set_: SetOpt = None,
    free_: bool = typer.Option(
        False, "--free", help="free the tiers whose run is gone (never a live or resumable one's)"
    ),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """List this machine's memory-tier snapshots (RAM); --free frees the orphaned ones."""
    from training.memory_sweep import free, survey

    cfg = config_or_exit(params, set_)
    keep = cfg.checkpoint.memory_keep_hours
    verdicts = survey(keep)
    freed = free(verdicts) if free_ else []
    if as_json:
        rows = [_row(v, v in freed) for v in verdicts]
        sys.stdout.write(json.dumps({"keep_hours": keep, "tiers": rows}, indent=1) + "\n")
        return
    table = Table(title=f"memory tiers on this machine (kept while active within {keep:g} h)", highlight=False)
    for column in ("folder", "run directory", "steps", "RAM", "last active", "verdict"):
        table.add_column(column)
    now = time.time()
    for v in verdicts:
        f = v.folder
        state = "[green]freed[/]" if v in freed else ("[red]orphaned[/]" if v.orphaned else "kept")
        table.add_row(
            escape(f.path.name),
            escape(v.run_dir),
            ", ".join(map(str, f.steps)) or "-",
            f"{f.size_bytes / 1e6:,.1f} MB",
            f"{(now - f.last_write) / 3600:.1f} h ago",
            f"{state}: {escape(v.why)}",
        )
    console.print(table)
    console.print(_footer(verdicts, freed), highlight=False)


def _row(v: TierVerdict, freed: bool) -> dict:
    f = v.folder
    return {
        "folder": str(f.path),
        "run_dir": f.owner.run_dir if f.owner else None,
        "steps": list(f.steps),
        "bytes": f.size_bytes,
        "last_write": f.last_write,
        "orphaned": v.orphaned,
        "freed": freed,
        "why": v.why,
    }


def _footer(verdicts: list[TierVerdict], freed: list[TierVerdict]) -> str:
    total = sum(v.folder.size_bytes for v in verdicts) / 1e9
    orphaned = [v for v in verdicts if v.orphaned and v not in freed]
    line = f"{len(verdicts)} tier(s), {total:.2f} GB of RAM"
    if freed:
        line += f"; freed {len(freed)} ({sum(v.folder.size_bytes for v in freed) / 1e9:.2f} GB)"
    if orphaned:
        line += f"; {len(orphaned)} orphaned: `convoy snapshots --free` frees them"
    return line
