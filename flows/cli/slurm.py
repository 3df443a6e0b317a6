"""``convoy slurm script``: the sbatch script of the recommended Slurm path (docs/slurm.md).

Why a command and not a file in the repo: the script must carry this run's node count, GPUs per
node, params and overrides, this checkout's directory and this environment's interpreter; a
copied template gets one of them wrong.  What the script holds, and why each line:

* ``--requeue`` and ``--signal=B:USR1@<lead>``: the time-limit warning goes to the batch shell,
  which ``exec``\\ s ``convoy train`` (so it is convoy that gets it: :mod:`flows.slurm_job`);
* ``--open-mode=append``: a requeued job appends to the same log instead of truncating it;
* ``--nodes`` = ``train.nnodes``, one task per node; ``--gpus-per-node`` = ``train.ranks`` for a
  CUDA run (torchrun starts the ranks on each node, not Slurm).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import typer

from flows.cli.common import ParamsArg, SetOpt, config_or_exit, console, err, fail
from training.config import RunConfig

slurm = typer.Typer(no_args_is_help=True, help="Run convoy on a Slurm cluster (docs/slurm.md).")


def sbatch_script(
    cfg: RunConfig,
    params: Path,
    overrides: list[str],
    time_limit: str,
    signal_lead_s: int,
    sbatch_options: list[str],
    workdir: Path,
) -> str:
    """The batch script: ``#SBATCH`` lines, then ``exec convoy train`` with these params."""
    name = cfg.run_name
    lines = [
        "#!/bin/bash",
        f"# convoy: run {name} in Slurm allocations, requeued at each time limit (docs/slurm.md).",
        f"#SBATCH --job-name=convoy-{name}",
        f"#SBATCH --nodes={len(set(cfg.train.hosts)) or cfg.train.nnodes}",  # hosts named: each once
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --signal=B:USR1@{signal_lead_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={Path(cfg.runs_dir).resolve() / f'{name}.slurm-%j.out'}",
    ]
    if cfg.train.device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={cfg.train.ranks}")
    lines += [f"#SBATCH {opt}" for opt in sbatch_options]
    train = [sys.executable, "-m", "flows.cli.main", "train", str(params)]
    for value in overrides:
        train += ["-S", value]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        "export PYTHONUNBUFFERED=1",
        "# exec: the batch shell becomes convoy train, which gets Slurm's USR1 (--signal=B:...)",
        f"exec {shlex.join(train)}",
    ]
    return "\n".join(lines) + "\n"


@slurm.command("script")
def script(
    params: ParamsArg = Path("params.yaml"),
    set_: SetOpt = None,
    time_limit: str = typer.Option("24:00:00", "--time", help="the allocation's time limit (sbatch --time)"),
    signal_lead_s: int = typer.Option(
        300,
        "--signal-lead",
        min=10,
        help="seconds before the limit that Slurm sends USR1 (stop, emergency checkpoint, requeue); "
        "Slurm may send it up to 60 s earlier",
    ),
    sbatch_option: list[str] = typer.Option(
        [], "--sbatch", help="another #SBATCH line, repeatable, e.g. --sbatch=--partition=gpu"
    ),
    out: Path | None = typer.Option(None, "--out", help="write the script here (default: stdout)"),
    submit: bool = typer.Option(False, "--submit", help="submit it with sbatch and print the job id"),
) -> None:
    """Print (or write, or submit) the sbatch script that trains this run through every time limit.

    Example: convoy slurm script params.yaml --time 48:00:00 --sbatch=--partition=gpu --submit
    """
    cfg = config_or_exit(params, set_)
    Path(cfg.runs_dir).mkdir(parents=True, exist_ok=True)  # Slurm fails a job whose --output it cannot open
    text = sbatch_script(cfg, params, set_ or [], time_limit, signal_lead_s, sbatch_option, Path.cwd())
    if out is not None:
        out.write_text(text)
        out.chmod(0o755)
        err.print(f"wrote {out}", highlight=False)
    if submit:
        try:
            done = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True)
        except FileNotFoundError:
            raise fail("sbatch is not on PATH: run this on a Slurm login node, or drop --submit") from None
        if done.returncode != 0:
            raise fail(f"sbatch refused the script: {done.stderr.strip()}")
        console.print(f"submitted job {done.stdout.strip()}", highlight=False)
    elif out is None:
        sys.stdout.write(text)
