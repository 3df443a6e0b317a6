"""No product module keeps state in a module-level container (issue 47, item 4: one owner each).

A dict, list or set at module level that code fills at run time is a registry: whatever lands in
it lives as long as the process and is reached by name, not passed, so no signature says who
depends on it (``hooks._RUNS`` was one, ``goodput._cache`` and ``mlflow_audit._child_uris``
others).  Their state now has an owner that is passed (``RunResources``, a hook bound to its
target, a ``StepJournal``, the run's tracker).  None is allowed: a new one gets an owner, not an
exception here.  Read from the source, three ways a container is a registry:

1. bound to a name that is no constant's (``_?ALL_CAPS``, or ``__all__``): state by its name;
2. empty, whatever its name: it is there only to be filled;
3. changed inside a function (``NAME[k] = v``, ``del NAME[k]``, ``NAME.append(...)``,
   ``global NAME``): a constant's name on a registry.

A table filled where it is defined and only read after (``_WRITES``, ``BUCKETS``) is a constant.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("flows", "tasks", "training")  # the product's rooms, as tests/test_import_rooms.py reads them
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*|__all__")
CONTAINER_CALLS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
MUTATORS = {
    "append",
    "appendleft",
    "extend",
    "insert",
    "add",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "remove",
    "discard",
    "clear",
    "__setitem__",
}


def _container(value: ast.expr) -> tuple[bool, bool]:
    """(``value`` makes a mutable container, it is empty)."""
    if isinstance(value, ast.Dict):
        return True, not value.keys
    if isinstance(value, ast.List | ast.Set):
        return True, not value.elts
    if isinstance(value, ast.DictComp | ast.ListComp | ast.SetComp):
        return True, False
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in CONTAINER_CALLS:
            factory = 1 if name == "defaultdict" else 0  # defaultdict(list) is empty
            return True, len(value.args) <= factory and not value.keywords
    return False, False


def _module_containers(tree: ast.Module) -> dict[str, tuple[int, bool]]:
    """Each module-level name bound to a mutable container: (line, it is empty)."""
    found: dict[str, tuple[int, bool]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        mutable, empty = _container(value)
        for target in targets:
            if mutable and isinstance(target, ast.Name):
                found[target.id] = (node.lineno, empty)
    return found


def _changed_in_functions(tree: ast.Module, names: set[str]) -> set[str]:
    """Which of ``names`` a function changes (rule 3); a function's own local of the name is its own."""
    changed: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        nodes = list(ast.walk(fn))
        declared = {n for node in nodes if isinstance(node, ast.Global) for n in node.names}
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        local |= {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        theirs = (names - local) | (names & declared)
        changed |= names & declared
        for node in nodes:
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                if isinstance(node.value, ast.Name) and node.value.id in theirs:
                    changed.add(node.value.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if node.func.attr in MUTATORS and isinstance(owner, ast.Name) and owner.id in theirs:
                    changed.add(owner.id)
    return changed


def registries(source: str, where: str) -> list[str]:
    """``where:line name (why)`` for each module-level registry in ``source`` (rules 1-3)."""
    tree = ast.parse(source, where)
    containers = _module_containers(tree)
    changed = _changed_in_functions(tree, set(containers))
    found = []
    for name, (line, empty) in sorted(containers.items(), key=lambda kv: kv[1][0]):
        why = [
            *(["not a constant's name"] if not CONSTANT.fullmatch(name) else []),
            *(["empty"] if empty else []),
            *(["changed by a function"] if name in changed else []),
        ]
        if why:
            found.append(f"{where}:{line} {name} ({', '.join(why)})")
    return found


def test_no_product_module_keeps_a_registry() -> None:
    found = []
    for room in PRODUCT:
        for path in sorted((REPO / room).rglob("*.py")):
            found += registries(path.read_text(), str(path.relative_to(REPO)))
    assert found == [], "give this state an owner that is passed (docs/architecture.md, 'One owner each')"


def test_the_registry_check_finds_each_kind() -> None:
    source = """
_RUNS: dict[str, int] = {}
_seen = {"a": 1}
TABLE = {"a": 1}
LATER = defaultdict(list)
ORDER = ["a"]
WORDS = ("a",)
__all__ = ["f"]


def f(x: int) -> None:
    TABLE[x] = x
    ORDER.append(x)


def g() -> None:
    WORDS = []
    WORDS.append(1)
"""
    assert registries(source, "m.py") == [
        "m.py:2 _RUNS (empty)",
        "m.py:3 _seen (not a constant's name)",
        "m.py:4 TABLE (changed by a function)",
        "m.py:5 LATER (empty)",
        "m.py:6 ORDER (changed by a function)",
    ]
    assert registries("_child_uris: dict[str, str] = {}\n", "tasks/records/mlflow_audit.py") == [
        "tasks/records/mlflow_audit.py:1 _child_uris (not a constant's name, empty)"
    ]  # the last registry allowed, gone with the tracking seam: none is, a registry gets an owner
