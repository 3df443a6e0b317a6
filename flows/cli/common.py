"""What every ``convoy`` command shares: the consoles, the PARAMS argument and ``-S`` option, and
the one way a bad input ends a command (one line on stderr, exit 2, nothing written).

A module of its own so the commands split out of :mod:`flows.cli.main` (:mod:`flows.cli.status`,
:mod:`flows.cli.chaos`) use the same objects without importing :mod:`flows.cli.main`: run as
``python -m flows.cli.main`` that module is ``__main__``, and importing it again would build a second
app.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from training.config import ConfigError, RunConfig, load_config

# soft_wrap: a one-line answer stays one line when piped or grepped (rich would otherwise break
# it at 80 columns); tables still fit the terminal.
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

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
            from training.rundir import keyed_config
            from training.task import check_task

            check_task(cfg, fetch=True, resume_dir=keyed_config(cfg).run_dir)
        return cfg
    except ConfigError as exc:
        raise fail(str(exc)) from None
