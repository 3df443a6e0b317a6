"""The shape of the test suite itself: a helper two test modules share lives in a helper module
(``tests/<topic>_util.py``), never in a test module that another imports (importing a test module
runs its module-level code and ties one module's constants to another's)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    """``tests.test_x`` (or ``test_x`` relative to tests/): a test module, not a helper."""
    parts = dotted.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and parts[0].startswith("test_")


def imported_test_modules(source: str, filename: str = "<source>") -> list[str]:
    """``line: module`` for each import of a test module in ``source``, at any depth (module level
    or inside a function): ``import tests.test_x``, ``from tests.test_x import ...``,
    ``from tests import test_x`` and their relative forms."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("tests.")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 0 and base != "tests" and not base.startswith("tests."):
                continue
            names = [base] if base not in ("", "tests") else []
            names += [f"{base}.{alias.name}".lstrip(".") for alias in node.names if base in ("", "tests")]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if _is_test_module(name)]
    return found


def test_the_detector_sees_every_form_of_importing_a_test_module() -> None:
    source = """
import tests.test_a
from tests.test_b import helper
from tests import test_c, flow_util
from .test_d import helper
from . import test_e

def f():
    from tests.test_f import helper
"""
    found = imported_test_modules(source)
    assert [line.split(": ")[1] for line in found] == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "test_d",
        "test_e",
        "tests.test_f",
    ]
    helpers = "import tests.flow_util\nfrom tests.engine_util import make_run\nfrom tests import dvc_util\n"
    assert imported_test_modules(helpers) == []


def test_no_module_of_the_suite_imports_a_test_module() -> None:
    """Every file under tests/ (test modules and helpers): shared helpers come from ``*_util.py``."""
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{hit}"
        for path in sorted(TESTS.rglob("*.py"))
        for hit in imported_test_modules(path.read_text(), str(path))
    ]
    assert offenders == []
