"""The shape rules of the code base that a reviewer would otherwise count by hand, and the
``convoy`` command list, which spans several modules (flows/cli*.py) but is shown in one order."""

from __future__ import annotations

import ast
from pathlib import Path

from typer.testing import CliRunner

from flows.cli.main import app

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def long_functions(folders: tuple[str, ...]) -> list[str]:
    """``path:line name (n lines)`` for each function or method longer than the limit."""
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_product_function_is_over_60_lines() -> None:
    assert long_functions(("training", "tasks", "flows", "bench")) == []


MAX_FILE_LINES = 500


def test_no_file_in_the_product_rooms_is_over_500_lines() -> None:
    """training/, tasks/ and flows/ stay in modules a reader can hold in mind at once."""
    long_files = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for folder in ("training", "tasks", "flows")
        for path in sorted((REPO / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert long_files == []


def test_convoy_help_lists_every_command_once_in_the_order_they_are_registered() -> None:
    out = CliRunner().invoke(app, ["--help"], terminal_width=120).output
    expected = [
        "validate",
        "prepare",
        "train",
        "worker",
        "inspect",
        "verify",
        "plan",
        "status",
        "chaos",
        "pull",
        "prefect-setup",
        "prefect-worker",
        "slurm",
        "kubernetes",
    ]
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("│ ") and len(line.split()) > 2]
    assert [name for name in listed if name in expected] == expected, out


def test_help_shows_no_type_for_a_flag() -> None:
    """A flag takes no value: its help line must not show one (typer 0.29 prints ``<bool>``)."""
    for args in (["--help"], ["train", "--help"], ["inspect", "--help"]):
        out = CliRunner().invoke(app, args, terminal_width=120).output
        assert "<bool>" not in out and "--no-allow-config-change" not in out, out
