"""The ``convoy`` command.

Every command that takes params accepts ``[PARAMS]`` (default ``params.yaml``; built-in defaults
if it does not exist) and repeated ``-S section.key=value`` overrides.  A bad input prints one
line saying what is wrong and how to fix it, exits 2, and writes nothing (:mod:`flows.cli.common`).
``convoy status`` is in :mod:`flows.cli.status`, ``convoy chaos`` in :mod:`flows.cli.chaos`,
``convoy snapshots`` in :mod:`flows.cli.snapshots`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.chaos import chaos
from flows.cli.common import ParamsArg, SetOpt, config_or_exit, console, err, fail
from flows.cli.kubernetes import app as kubernetes_app
from flows.cli.plan import plan
from flows.cli.slurm import slurm
from flows.cli.snapshots import snapshots
from flows.cli.status import status
from training.config import ConfigError, RunConfig
from training.events import EXIT_PREEMPTED
from training.paths import RunPaths

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Fault-tolerant, exactly-resumable training.")


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
        from training.rundir import keyed_config
        from training.task import check_task, unhonoured

        built = check_task(cfg, fetch=True, resume_dir=keyed_config(cfg).run_dir)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    if show:
        console.print_json(json.dumps(cfg.model_dump(mode="json")))
    for line in unhonoured(cfg, built) if built is not None else []:
        console.print(f"note: {line}", highlight=False, soft_wrap=True)
    fitted = _host_memory_or_exit(cfg, built)
    if fitted is not None:  # before the verdict, which stays the last line (scripts read it)
        console.print(fitted.line, highlight=False, soft_wrap=True)
        for line in fitted.gave_up:
            console.print(f"convoy train would give up: {line}", highlight=False, soft_wrap=True)
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


def _host_memory_or_exit(cfg: RunConfig, built: object) -> object:
    """The run's host-memory projection (``training.memory_budget``), or one line and exit 2 for a
    run projected to run out of memory; None where the task could not be built here."""
    from training.memory_budget import fitted

    if built is None:
        return None
    try:
        return fitted(cfg, built)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise fail(str(exc)) from None


@app.command()
def prepare(params: ParamsArg = Path("params.yaml"), set_: SetOpt = None) -> None:
    """Write the training corpus (synthetic, or a copy of data.path) to data.prepared_dir."""
    from training.datapipe.corpus import prepare as prepare_corpus

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
    allow_config_change: bool = typer.Option(
        False, "--allow-config-change", help="resume a run whose trajectory settings changed"
    ),
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
    if from_ is None and _nothing_to_do(config_or_exit(params, set_), as_json):
        return
    cfg = _checked_beside_prefect(params, set_)
    if from_ is not None:
        cfg = _child_config(cfg, from_)
    from flows.report import LiveProgress, failure_lines, link_lines, summary_table
    from flows.run_summary import RunSummary
    from flows.train import run_training
    from tasks.supervision.supervisor import ChunkFailed
    from training.rundir import keyed_config

    try:
        cfg, slurm_stop = _in_slurm_job(cfg)
        with slurm_stop, LiveProgress(keyed_config(cfg), err):  # trains in runs/<name>@<fp>
            summary = run_training(cfg, allow_config_change=allow_config_change, overrides=set_)
        if getattr(slurm_stop, "warned_at", None) is not None:
            raise typer.Exit(EXIT_PREEMPTED)  # requeued: Slurm ends this allocation now
    except ConfigError as exc:
        raise _refused(exc) from None
    except ChunkFailed as exc:
        first, *rest = failure_lines(exc)
        err.print(f"[bold red]training failed:[/] {escape(first)}", highlight=False, soft_wrap=True)
        for line in rest:
            err.print(line, highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str, indent=1) + "\n")
        return
    typed = RunSummary.from_dict(summary)
    console.print(summary_table(typed))
    for line in link_lines(typed):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _refused(exc: ConfigError) -> typer.Exit:
    """A refusal after Prefect's early start: one line, the temporary server stopped without one."""
    from flows.ephemeral_api import stop_quietly

    stop_quietly()
    return fail(str(exc))


def _checked_beside_prefect(params: Path, set_: list[str] | None) -> RunConfig:
    """The config with its task built and checked, while Prefect's temporary API starts."""
    from flows.ephemeral_api import EarlyStart, stop_quietly

    api = EarlyStart()
    try:
        return config_or_exit(params, set_, build_task=True)
    except typer.Exit:
        api.join()  # the error is printed first; the server is tied before the process ends
        stop_quietly()  # and stopped without a line of Prefect's: the error stays the only line
        raise
    finally:
        api.join()


def _in_slurm_job(cfg: RunConfig) -> tuple[RunConfig, Any]:
    """Inside a Slurm job: the allocation's nodes and its time limit (:mod:`flows.slurm_job`);
    elsewhere ``cfg`` unchanged and a context that does nothing."""
    from flows.slurm_job import SlurmJob, TimeLimitStop, fit_to_allocation

    job = SlurmJob.from_env()
    if job is None:
        return cfg, contextlib.nullcontext()
    from training.checkpointing.store import CheckpointStore
    from training.rundir import keyed_config

    cfg = fit_to_allocation(cfg, job)
    run_dir = keyed_config(cfg).run_dir

    def newest() -> int:
        return CheckpointStore(run_dir.resolve()).resume_point().step or 0

    def say(line: str) -> None:
        err.print(line, highlight=False, markup=False, soft_wrap=True)

    return cfg, TimeLimitStop(job, run_dir, say, newest)


def _nothing_to_do(cfg: RunConfig, as_json: bool) -> bool:
    """A finished run answered at once, without a flow (:mod:`training.finished`)."""
    from training.finished import finished_run
    from training.rundir import keyed_config, link_current

    keyed = keyed_config(cfg)
    done = finished_run(keyed)
    if done is None:
        return False
    link_current(keyed)  # runs/<name> names the run these params train, as the flow's open would
    if as_json:
        answer = {
            "run": keyed.run_name,
            "final_step": done.step,
            "digest": done.digest,
            "trained_chunks": 0,
            "flow_run_id": done.flow_run_id,  # the flow run that finished it
            "nothing_to_do": True,
        }
        sys.stdout.write(json.dumps(answer, indent=1) + "\n")
        return True
    console.print(
        f"run {keyed.run_name} is finished: step {done.step} of train.total_steps = {done.step}, digest "
        f"{done.digest}; nothing to do. `convoy status {keyed.run_dir}` shows it; to train it longer: "
        f"`convoy train -S train.total_steps=<more> --from {keyed.run_dir}`",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    return True


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
    """The run's store as a judge only: every check a resume makes (hashes, headers, structure,
    and the model's shapes and dtypes as the run's worker recorded them), on the headers instead
    of tensors: no ``import torch``, no task built, so the answer comes in well under a second."""
    from training.checkpointing.state_check import checkpoint_validator, read_task_shapes
    from training.checkpointing.store import CheckpointStore

    paths = RunPaths(run_dir)
    if not paths.checkpoints.is_dir():
        raise fail(f"{run_dir}: no checkpoints/ folder; is this a convoy run directory?")
    expected = read_task_shapes(paths.task_shapes)
    if expected is None:
        err.print(
            f"note: model shapes not checked ({paths.task_shapes.name} missing: the run was trained by an "
            "older convoy or not on this machine)",
            highlight=False,
            markup=False,
        )
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
        checkpoint = store.verify(path)
    except CheckpointRejected as exc:
        raise fail(f"newest checkpoint {path.name} is NOT valid: {exc}", 1) from None
    console.print(f"ok: {path.name} verified (step {step}, {checkpoint.bytes:,} bytes, digest {checkpoint.digest})")


app.command()(plan)
app.command()(status)
app.command()(chaos)
app.command()(snapshots)
app.add_typer(slurm, name="slurm")
app.add_typer(kubernetes_app, name="kubernetes")


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
    from tasks.remote.dvc_pull import pull_run
    from tasks.remote.dvc_version import VersioningError

    cfg = config_or_exit(params, set_) if params.exists() or set_ else None
    target = _pull_target(run_dir, cfg)
    chosen, source = _pull_remote(remote, cfg, target)
    try:
        out = pull_run(None, target, chosen, latest_only, source=source).as_dict()
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
    from flows.flow_liveness import ensure_liveness_automations

    ids = ensure_liveness_automations(deployment, within_s)
    console.print(f"liveness automations for {deployment}: {', '.join(ids)}")


@app.command("prefect-worker")
def prefect_worker(
    pool: Annotated[str, typer.Option("--pool", "-p", help="the work pool to serve")],
    name: Annotated[str | None, typer.Option("--name", "-n", help="the worker's name")] = None,
    limit: Annotated[int | None, typer.Option("--limit", "-l", help="flow runs at a time")] = None,
    work_queue: Annotated[list[str] | None, typer.Option("--work-queue", "-q", help="queues to poll")] = None,
) -> None:
    """A Prefect process worker whose flow runs are forked, not started (a relaunch in seconds).

    What `prefect worker start --pool POOL` does, with a server beside it that has imported
    Prefect, flow train and torch once and forks each flow run (docs/deployments.md)."""
    from flows.flow_worker import WorkerOptions, run_worker

    options = WorkerOptions(pool, name, limit, list(work_queue or []))
    raise typer.Exit(run_worker(options, lambda line: console.print(escape(line), highlight=False)))


def main() -> None:  # pragma: no cover - console script
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
