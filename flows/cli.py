"""The ``convoy`` command.

Every command that takes params accepts ``[PARAMS]`` (default ``params.yaml``; built-in defaults
if it does not exist) and repeated ``-S section.key=value`` overrides.  A bad input prints one
line saying what is wrong and how to fix it, exits 2, and writes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from training.config import ConfigError, RunConfig, load_config
from training.events import Event, FailureKind
from training.paths import RunPaths

if TYPE_CHECKING:
    from flows.chaos_drill import ChaosReport

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Fault-tolerant, exactly-resumable training.")
console = Console()
err = Console(stderr=True)

ParamsArg = Annotated[Path, typer.Argument(help="params.yaml (built-in defaults if the default file is absent)")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("-S", "--set", metavar="KEY=VALUE", help="override (repeatable), e.g. -S train.lr=3e-4"),
]
EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def config_or_exit(params: Path, overrides: list[str] | None, build_task: bool = False) -> RunConfig:
    """The validated config, or one line and exit 2.  ``build_task``: also build the task (on the
    meta device) so bad ``task_args`` fail here, before anything is created."""
    try:
        cfg = load_config(params, overrides or [])
        if build_task:
            from training.task import check_task

            check_task(cfg, fetch=True)
        return cfg
    except ConfigError as exc:
        raise fail(str(exc)) from None


@app.command()
def validate(
    params: ParamsArg = Path("params.yaml"),
    set_: SetOpt = None,
    show: bool = typer.Option(False, "--show", help="print the resolved config"),
) -> None:
    """Check PARAMS (and overrides) without running anything.

    The task is built on the meta device, so task_args are checked too, and its first training
    batch and one validation batch are fetched and collated on the CPU (the prepared data must
    exist)."""
    cfg = config_or_exit(params, set_)
    try:
        from training.task import check_task

        built = check_task(cfg, fetch=True)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    if show:
        console.print_json(json.dumps(cfg.model_dump(mode="json")))
    task = (
        "task built, first batches fetched"
        if built is not None
        else "task_args checked; data not prepared yet (convoy prepare)"
    )
    console.print(
        f"ok: {params} is valid (run {cfg.run_name!r}, fingerprint {cfg.fingerprint()}; {task})",
        highlight=False,
        soft_wrap=True,
    )


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
def train(
    params: ParamsArg = Path("params.yaml"),
    set_: SetOpt = None,
    allow_config_change: bool = typer.Option(False, help="resume a run whose trajectory settings changed"),
    as_json: bool = typer.Option(
        False, "--json", metavar="", help="print the flow's machine summary (JSON) instead of the table"
    ),
    from_: Annotated[
        str | None,
        typer.Option(
            "--from", help="start a new run from runs/<parent> (its newest verified checkpoint) or runs/<parent>@<step>"
        ),
    ] = None,
) -> None:
    """Run (or continue) a training run as a Prefect flow of chunk tasks.

    Prints a live progress line while it trains, then a summary (steps, time, chunks, attempts,
    failures, resumes, steps lost, final loss, digest) with the MLflow run URL and, with a Prefect
    server, the flow-run URL.  Exit 1 if a chunk failed for good (its log's last lines are shown).

    With --from runs/<parent>[@step], these params train as a new run that starts from that
    checkpoint of the parent (model, optimizer state, RNG, data cursor, step).

    Examples: convoy train params.yaml -S train.lr=3e-4
              convoy train -S train.total_steps=2000 --from runs/demo   (train a finished run longer)
    """
    cfg = config_or_exit(params, set_, build_task=True)
    if from_ is not None:
        cfg = _child_config(cfg, from_)
    from flows.report import LiveProgress, failure_lines, link_lines, summary_table
    from flows.train import run_training
    from tasks.supervisor import ChunkFailed
    from training.rundir import keyed_config

    try:
        with LiveProgress(keyed_config(cfg), err):  # the directory that trains cfg (runs/<name>@<fp>)
            summary = run_training(cfg, allow_config_change=allow_config_change, overrides=set_)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except ChunkFailed as exc:
        first, *rest = failure_lines(exc)
        err.print(f"[bold red]training failed:[/] {escape(first)}", highlight=False, soft_wrap=True)
        for line in rest:
            err.print(line, highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str, indent=1) + "\n")
        return
    console.print(summary_table(summary))
    for line in link_lines(summary):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _child_config(cfg: RunConfig, spec: str) -> RunConfig:
    """``cfg`` as a child of ``spec``'s checkpoint (or the child it already is), one line if not."""
    from training.rundir import child_config

    try:
        return child_config(cfg, spec)
    except ConfigError as exc:
        raise fail(str(exc)) from None


@app.command()
def worker(
    run_dir: Annotated[Path, typer.Option(help="run directory")],
    until_step: Annotated[int, typer.Option(help="train up to this global step")],
) -> None:
    """Run one worker process in the foreground (what the chunk supervisor spawns)."""
    from training.worker import main

    raise typer.Exit(main(["--run-dir", str(run_dir), "--until-step", str(until_step)]))


def _store(run_dir: Path):
    """The run's store with the resume's own validation: structure always, and the model's
    shapes and dtypes when the task can be built here from the run's config."""
    from training.checkpointing.store import CheckpointStore
    from training.rundir import load_run_config
    from training.state import ExpectedState, checkpoint_validator
    from training.task import check_task

    if not RunPaths(run_dir).checkpoints.is_dir():
        raise fail(f"{run_dir}: no checkpoints/ folder; is this a convoy run directory?")
    parts = None
    try:
        parts = check_task(load_run_config(run_dir))
    except ConfigError as exc:
        err.print(f"note: model shapes not checked ({exc})", highlight=False, markup=False)
    else:
        if parts is None:
            err.print("note: model shapes not checked (the task's data is not on this machine)", highlight=False)
    expected = ExpectedState.of(parts) if parts is not None else None
    return CheckpointStore(run_dir, validator=checkpoint_validator(expected))


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
        table.add_row(
            str(r["step"]),
            escape(r["name"]),
            f"{r['bytes']:,}",
            "yes" if r["valid"] else ("[yellow]quarantined[/]" if r["quarantined"] else "[red]no[/]"),
            escape(r["digest"] if r["valid"] else r["reason"]),
        )
    console.print(table)


@app.command()
def verify(run_dir: Path) -> None:
    """Exit non-zero if the newest checkpoint does not verify."""
    from training.checkpointing.errors import CheckpointRejected

    store = _store(run_dir)
    dirs = store.step_dirs()
    if not dirs:
        raise fail(f"{run_dir}: no checkpoints", 1)
    step, path = dirs[0]
    try:
        ck = store.verify(path)
    except CheckpointRejected as exc:
        raise fail(f"newest checkpoint {path.name} is NOT valid: {exc}", 1) from None
    console.print(f"ok: {path.name} verified (step {step}, {ck.bytes:,} bytes, digest {ck.digest})")


@app.command()
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
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        table.add_row(key.replace("_", " "), shown)
    console.print(table)


def _measured_from_run(run_dir: Path, values: dict) -> dict:
    """Median measured blocking-save time and observed failure rate from a run's events."""
    from statistics import median

    from training.events import read_events

    events = read_events(run_dir)
    if not events:
        raise fail(f"{run_dir}: no events.jsonl; run training first")
    saves = [e["persist_s"] + e["stall_s"] for e in events if e["kind"] == Event.CHECKPOINT_SAVED]
    failures = [e for e in events if e["kind"] == Event.FAILURE and e.get("failure") != FailureKind.CONFIG]
    out: dict = {}
    if saves:
        out["save_hours"] = median(saves) / 3600
    hours = (events[-1]["time"] - events[0]["time"]) / 3600
    if failures and hours > 0:
        out["failure_rate_per_day"] = len(failures) / hours * 24 / values.get("gpus", 8)
    console.print(
        f"from {run_dir}: {len(saves)} saves (median {median(saves) if saves else 0:.3f} s), "
        f"{len(failures)} failures in {hours:.3f} h"
    )
    return out


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _status_table(st: dict) -> Table:
    """``convoy status`` for a person: one row per fact, the state coloured."""
    from training.tracking.progress import describe_upload

    colour = {"running": "green", "finished": "bold green", "failed": "red", "dead": "red"}.get(st["state"], "yellow")
    total = st["total_steps"]
    table = Table(title=f"run {escape(st['run_name'])}", show_header=False, highlight=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("state", f"[{colour}]{st['state']}[/]")
    table.add_row(
        "step",
        f"{st['step']}/{total} ({100 * st['step'] / total:.0f}%)" + (f", phase {st['phase']}" if st["phase"] else ""),
    )
    who = f"pid {st['pid']} on {escape(str(st['host']))}" if st["pid"] else "-"
    table.add_row(
        "heartbeat", f"{_age(st['heartbeat_age_s'])} ago, {who}" if st["heartbeat_age_s"] is not None else "none"
    )
    floor = st.get("entropy_floor")
    loss = f"{st['loss']:.4f} at step {st['loss_step']}" if st["loss"] is not None else "-"
    if floor is not None:
        loss += f" (entropy floor {floor:.4f}" + (f", {st['loss'] - floor:+.4f})" if st["loss"] is not None else ")")
    table.add_row("loss", loss)
    if st.get("val_loss") is not None:
        table.add_row("validation loss", f"{st['val_loss']:.4f} at step {st['val_loss_step']}")
    if st.get("data_samples") is not None:
        table.add_row("data", f"{int(st['data_samples']):,} samples trained (epoch {int(st['data_epoch'])})")
    speed = f"{st['steps_per_s']:.2f} steps/s" if st["steps_per_s"] else "-"
    if st["tokens_per_s"]:
        speed += f", {st['tokens_per_s']:,.0f} tokens/s"
    table.add_row("speed", speed)
    table.add_row("ETA", _age(st["eta_s"]) if st["eta_s"] is not None else "-")
    ck = (
        (
            f"step {st['checkpoint_step']} ({escape(st['checkpoint_digest'])}), "
            f"{st['steps_since_checkpoint']} steps since"
        )
        if st["checkpoint"]
        else "none yet"
    )
    table.add_row("newest verified checkpoint", ck)
    if (uploaded := describe_upload(st)) is not None:
        table.add_row("uploaded to the remote", uploaded)
    kinds = f" ({', '.join(st['failure_kinds'])})" if st["failure_kinds"] else ""
    table.add_row("failures / resumes", f"{st['failures']} / {st['resumes']}{kinds}")
    table.add_row("steps lost", str(st["steps_lost"]))
    return table


@app.command()
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
    failures, resumes and steps lost.

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
    if as_json:
        while True:
            st = run_status(cfg, run_dir)
            sys.stdout.write(json.dumps(st, separators=(",", ":") if follow else (", ", ": ")) + "\n")
            sys.stdout.flush()
            if not follow or st["state"] != "running":
                return
            time.sleep(every)
    st = run_status(cfg, run_dir)
    if not follow:
        console.print(_status_table(st))
        return
    with Live(_status_table(st), console=console, refresh_per_second=4) as live:
        while st["state"] == "running":
            time.sleep(every)
            st = run_status(cfg, run_dir)
            live.update(_status_table(st))


@app.command()
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


def _pull_target(run_dir: Path, cfg: RunConfig | None) -> Path:
    """The directory to pull into.  In a fresh clone ``runs/<name>`` (a link, not in git) is
    absent: the run of these params is ``runs/<name>@<fingerprint>`` (its ``.dvc`` files are)."""
    if run_dir.exists() or cfg is None:
        return run_dir
    from training.rundir import keyed_config

    keyed = keyed_config(cfg).run_dir
    if run_dir.name == cfg.run_name and keyed.is_dir():
        return keyed
    others = sorted(p.name for p in run_dir.parent.glob(f"{run_dir.name}@*")) if run_dir.parent.is_dir() else []
    hint = f"; runs of that name here: {', '.join(others)}" if others else ""
    raise fail(f"{run_dir}: no such run directory (are its checkpoints/*.dvc files committed?){hint}", 1)


def _pull_remote(remote: str | None, cfg: RunConfig | None, run_dir: Path) -> tuple[str | None, str]:
    """The remote to pull from and where it came from, by precedence: ``--remote``, the params'
    ``tracking.dvc_remote``, the run's ``config.json``, then (None) the repository's default
    remote (``dvc remote add -d``, in the committed ``.dvc/config``), else the local fallback."""
    if remote:
        return remote, "--remote"
    if cfg is not None and cfg.tracking.dvc_remote:
        return cfg.tracking.dvc_remote, "params tracking.dvc_remote"
    from training.rundir import load_run_config

    if RunPaths(run_dir).config_file.exists():
        try:
            recorded = load_run_config(run_dir).tracking.dvc_remote
        except ConfigError:
            recorded = ""
        if recorded:
            return recorded, f"{RunPaths(run_dir).config_file} tracking.dvc_remote"
    return None, (
        "no remote in --remote, params or the run's config.json: the repository's default remote, "
        "else a remote configured before, else $CONVOY_DVC_REMOTE or ~/.cache/convoy/dvc-remote"
    )


@app.command()
def pull(
    run_dir: Path,
    params: Annotated[Path, typer.Option(help="params whose tracking.dvc_remote (and run) to use")] = Path(
        "params.yaml"
    ),
    set_: SetOpt = None,
    remote: str | None = typer.Option(None, help="DVC remote name, URL or directory (overrides everything)"),
    latest_only: bool = typer.Option(False, help="pull only the newest versioned checkpoint"),
) -> None:
    """Restore a run's versioned checkpoints from the DVC remote (then `convoy train` resumes).

    Remote precedence: --remote, params tracking.dvc_remote, the run's config.json, the
    repository's default DVC remote, then a local fallback; every error names the one used."""
    from tasks.version import VersioningError, pull_run

    cfg = config_or_exit(params, set_) if params.exists() or set_ else None
    target = _pull_target(run_dir, cfg)
    chosen, source = _pull_remote(remote, cfg, target)
    try:
        out = pull_run(None, target, chosen, latest_only, source=source)
    except VersioningError as exc:
        raise fail(str(exc), 1) from None
    from training.rundir import adopt_pulled_run

    out["linked"] = adopt_pulled_run(cfg, target)  # runs/<name> → the pulled run, as `convoy train` leaves it
    console.print_json(json.dumps(out, default=str))


@app.command("prefect-setup")
def prefect_setup(
    deployment: str = typer.Option("train/nightly", help="deployment of flow train"),
    within_s: float | None = typer.Option(None, help="heartbeat silence that marks a run crashed"),
) -> None:
    """Create the flow-liveness automations (crash a silent flow run, restart a crashed one)."""
    from flows.liveness import ensure_liveness_automations

    ids = ensure_liveness_automations(deployment, within_s)
    console.print(f"liveness automations for {deployment}: {', '.join(ids)}")


def main() -> None:  # pragma: no cover - console script
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
