"""``python -m flows.cli``: the same as the ``convoy`` command."""

from flows.cli.main import app

app()
