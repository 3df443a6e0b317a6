"""The ``convoy`` command.

Every command that takes params accepts ``[PARAMS]`` (default ``params.yaml``; built-in defaults
if it does not exist) and repeated ``-S section.key=value`` overrides.  A bad input prints one
line saying what is wrong and how to fix it, exits 2, and writes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from training.config import ConfigError, RunConfig, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Fault-tolerant, exactly-resumable training.")
console = Console()
err = Console(stderr=True)

ParamsArg = Annotated[Path, typer.Argument(help="params.yaml (built-in defaults if the default file is absent)")]
SetOpt = Annotated[list[str] | None, typer.Option("-S", "--set", help="override, e.g. -S train.lr=3e-4")]
EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def config_or_exit(params: Path, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(params, overrides or [])
    except ConfigError as exc:
        raise fail(str(exc)) from None


@app.command()
def validate(params: ParamsArg = Path("params.yaml"), set_: SetOpt = None,
             show: bool = typer.Option(False, "--show", help="print the resolved config")) -> None:
    """Check PARAMS (and overrides) without running anything."""
    cfg = config_or_exit(params, set_)
    if show:
        console.print_json(json.dumps(cfg.model_dump(mode="json")))
    console.print(f"ok: {params} is valid (run {cfg.run_name!r}, fingerprint {cfg.fingerprint()})")


@app.command()
def prepare(params: ParamsArg = Path("params.yaml"), set_: SetOpt = None) -> None:
    """Write the training corpus (synthetic, or a copy of data.path) to data.prepared_dir."""
    from training.corpus import prepare as prepare_corpus

    cfg = config_or_exit(params, set_)
    path = prepare_corpus(cfg.data, cfg.train.seed)
    meta = json.loads((path.parent / "corpus.json").read_text())
    floor = meta.get("entropy_floor_nats_per_char")
    extra = f", entropy floor {floor:.4f} nats/char" if floor else ""
    console.print(f"prepared {path} ({meta['bytes']:,} bytes{extra})")


@app.command()
def train(params: ParamsArg = Path("params.yaml"), set_: SetOpt = None,
          allow_config_change: bool = typer.Option(False, help="resume a run whose trajectory settings changed")) -> None:
    """Run (or continue) a training run as a Prefect flow of chunk tasks."""
    cfg = config_or_exit(params, set_)
    from flows.train import run_training

    try:
        summary = run_training(cfg, allow_config_change=allow_config_change)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    console.print_json(json.dumps(summary, default=str))


@app.command()
def worker(run_dir: Annotated[Path, typer.Option(help="run directory")],
           until_step: Annotated[int, typer.Option(help="train up to this global step")]) -> None:
    """Run one worker process in the foreground (what the chunk supervisor spawns)."""
    from training.worker import main

    raise typer.Exit(main(["--run-dir", str(run_dir), "--until-step", str(until_step)]))


def _store(run_dir: Path):
    from training.checkpoint import CheckpointStore

    if not (run_dir / "checkpoints").is_dir():
        raise fail(f"{run_dir}: no checkpoints/ folder; is this a convoy run directory?")
    return CheckpointStore(run_dir)


@app.command()
def inspect(run_dir: Path, as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Each checkpoint: step, bytes, verified or why not, digest."""
    rows = _store(run_dir).inspect()
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
        return
    table = Table(title=f"checkpoints in {run_dir}")
    for col in ("step", "name", "bytes", "valid", "digest / reason"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["step"]), r["name"], f"{r['bytes']:,}", "yes" if r["valid"] else "[red]no[/]",
                      r["digest"] if r["valid"] else r["reason"])
    console.print(table)


@app.command()
def verify(run_dir: Path) -> None:
    """Exit non-zero if the newest checkpoint does not verify."""
    store = _store(run_dir)
    dirs = store.step_dirs()
    if not dirs:
        raise fail(f"{run_dir}: no checkpoints", 1)
    step, path = dirs[0]
    try:
        ck = store.verify(path)
    except (ValueError, OSError) as exc:
        raise fail(f"newest checkpoint {path.name} is NOT valid: {exc}", 1) from None
    console.print(f"ok: {path.name} verified (step {step}, {ck.bytes:,} bytes, digest {ck.digest})")


def main() -> None:  # pragma: no cover - console script
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
