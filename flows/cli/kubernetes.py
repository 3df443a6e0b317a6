"""``convoy kubernetes``: write the Kubernetes manifests of a run (:mod:`flows.k8s_manifests` renders
them) from PARAMS and ``-S`` overrides, so what the cluster is told agrees with ``params.yaml``.

A sub-app of its own (``app``), registered by :mod:`flows.cli.main` as ``kubernetes``.  Like every
command: a bad input is one line on stderr, exit 2, and nothing written (everything is rendered
and checked before the first file is).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import typer

from flows.cli.common import ParamsArg, SetOpt, config_or_exit, console, fail
from flows.k8s_manifests import WORKDIR, RenderError, Target, render

app = typer.Typer(
    name="kubernetes",
    add_completion=False,
    no_args_is_help=True,
    help="Kubernetes manifests for a run: work pool template, deployment, runs volume, multi-node Job.",
)

RunsVolume = Literal["pvc", "emptydir"]
#: Why the Job is applied by hand: flow train launches a multi-node chunk itself (docs/kubernetes.md).
_LAUNCH = "flow train would start the other nodes itself, through orchestration.node_launch"


@app.callback()
def kubernetes() -> None:
    """Kubernetes manifests for a run (docs/kubernetes.md); a group even with one command, so
    ``convoy kubernetes render`` stays the spelling when more commands join it."""


def deployment_params(params: Path, cwd: Path) -> str:
    """PARAMS as the flow pod reads it: relative to the checkout (the image's working directory)."""
    if not params.is_absolute():
        return params.as_posix()
    try:
        return params.resolve().relative_to(cwd.resolve()).as_posix()
    except ValueError:
        raise RenderError(
            f"{params}: PARAMS must be inside this checkout (the flow pod reads the image's copy of it)"
        ) from None


@app.command("render")
def render_cmd(
    params: ParamsArg = Path("params.yaml"),
    set_: SetOpt = None,
    image: Annotated[str, typer.Option(help="image with this checkout at --workdir and convoy installed")] = "",
    namespace: Annotated[str, typer.Option(help="namespace of every object")] = "default",
    out: Annotated[Path, typer.Option(help="folder to write the files into (created)")] = Path("k8s"),
    pool: Annotated[str, typer.Option(help="Kubernetes work pool that runs flow train")] = "convoy-k8s",
    workdir: Annotated[str, typer.Option(help="the checkout's path inside the image")] = WORKDIR,
    runs_volume: Annotated[
        RunsVolume, typer.Option(help="pvc: runs_dir on a ReadWriteMany claim; emptydir: pod-local (tracking.dvc)")
    ] = "pvc",
    runs_claim: Annotated[str, typer.Option(help="name of the ReadWriteMany claim")] = "convoy-runs",
    storage: Annotated[str, typer.Option(help="size of the claim")] = "50Gi",
    storage_class: Annotated[str | None, typer.Option(help="storage class of the claim (a ReadWriteMany one)")] = None,
    env_secret: Annotated[
        str | None, typer.Option(help="Secret whose keys become every pod's environment (AWS_*, MLFLOW_*)")
    ] = None,
    chunk: Annotated[int, typer.Option(help="the chunk the multi-node Job trains (nnodes > 1)")] = 1,
    grace_period_s: Annotated[
        int | None, typer.Option(help="terminationGracePeriodSeconds (default: heartbeat.grace_s + 30)")
    ] = None,
) -> None:
    """Write the manifests for PARAMS into --out and list them.

    Example: convoy kubernetes render params.yaml -S train.device=cuda --image registry/convoy:0.1.0
    --namespace training --out deploy/kubernetes
    """
    cfg = config_or_exit(params, set_)
    target = Target(
        image=image,
        namespace=namespace,
        pool=pool,
        workdir=workdir,
        runs_volume=runs_volume,
        runs_claim=runs_claim,
        storage=storage,
        storage_class=storage_class,
        env_secret=env_secret,
        chunk=chunk,
        grace_period_s=grace_period_s,
    )
    try:
        target = replace(target, params=deployment_params(params, Path.cwd()), overrides=tuple(set_ or ()))
        files = render(cfg, target)
    except RenderError as exc:
        raise fail(str(exc)) from None
    if out.exists() and not out.is_dir():
        raise fail(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        (out / f.name).write_text(f.text())
        say(f"wrote {out / f.name}: {f.what}")
    if cfg.train.nnodes > 1:
        say(f"note: train.nnodes = {cfg.train.nnodes}: apply multinode-chunk-{chunk}.yaml per chunk; {_LAUNCH}")


def say(line: str) -> None:
    """One plain line on stdout (no markup: paths and names carry brackets)."""
    console.print(line, highlight=False, markup=False)


@app.command("open-run")
def open_run_cmd(params: ParamsArg = Path("params.yaml"), set_: SetOpt = None) -> None:
    """Create (or reopen, checking its fingerprint) the run directory PARAMS trains, and train nothing.

    What pod 0 of a multi-node chunk's Job runs first: its workers start on the run directory's
    config.json, which otherwise only flow train writes."""
    from training.config import ConfigError
    from training.rundir import keyed_config, link_current, open_run

    cfg = keyed_config(config_or_exit(params, set_))
    try:
        run_dir = open_run(cfg)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    link_current(cfg)
    say(f"run directory {run_dir} ready (fingerprint {cfg.fingerprint()})")


if __name__ == "__main__":  # python -m flows.cli.kubernetes: the Job's pods need no registration in flows.cli.main
    app()
