"""The rooms' import rules, read from the source (every ``import``, also those inside functions):
no circle between product modules, no import against the rooms' direction
(flows -> tasks -> training; inside tasks: top -> {supervision, remote, records},
remote -> records), Prefect only in the Prefect rooms, MLflow never in ``training``, and no two
product modules with the same name.  Inside ``training``: its checkpoint rooms stand on
training's base alone, the memory tier's room (``training.checkpointing.memory``) above the rest
of ``training.checkpointing``, and the state imports no checkpoint room; the data room
(``training.datapipe``) stands on training's base and the checkpoint rooms alone, and the worker
loop's room (``training.loop``) is imported, in ``training``, only by the two entry points above it
(``training.worker``, ``training.zygote``), which it never imports."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("flows", "tasks", "training")

#: room -> the rooms it may import (itself always).
MAY_IMPORT: dict[str, set[str]] = {
    "training": set(),
    "tasks.supervision": {"training"},
    "tasks.records": {"training"},
    "tasks.remote": {"training", "tasks.records"},
    "tasks": {"training", "tasks.supervision", "tasks.remote", "tasks.records"},
    "flows": {"training", "tasks", "tasks.supervision", "tasks.remote", "tasks.records"},
    "flows.cli": {"training", "tasks", "tasks.supervision", "tasks.remote", "tasks.records", "flows"},
}
#: third-party packages a room may not import at all.
FORBIDDEN = {
    "training": {"prefect", "mlflow", "dvc"},
    "tasks.supervision": {"prefect", "mlflow", "dvc"},
    "tasks.records": {"prefect", "dvc"},
    "tasks.remote": {"prefect"},
}

#: Training's base: what a checkpoint is made of and where it lives (config, paths, files,
#: events, the task's parts).  The checkpoint rooms import, of training's top, these alone; they
#: import, of training, only each other.
TRAINING_BASE = {
    "training.chunk_boundary",
    "training.config",
    "training.config_text",
    "training.device_rng",
    "training.event_records",
    "training.events",
    "training.faults",
    "training.fsutil",
    "training.locks",
    "training.parts",
    "training.paths",
    "training.release",
    "training.datapipe.sample_rng",
    "training.sharding",
    "training.trajectory",
}
CHECKPOINTING = "training.checkpointing"
MEMORY = "training.checkpointing.memory"
#: What checkpointing stores: any store must be able to take it, so it imports no checkpoint room.
STATE = {"training.state", "training.task", "training.parts"}
#: The data room (order, streams, per-sample seeding, adapters): what a step trains on stands on
#: training's base and the checkpoint rooms alone (its ``sample_rng`` is one of the base's modules).
DATA = "training.datapipe"
#: The worker loop's room, below the entry points that start a worker by name: in ``training`` only
#: they import it, and it never imports them.
LOOP = "training.loop"
LOOP_ENTRIES = {"training.worker", "training.zygote"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for room in PRODUCT for p in sorted((REPO / room).rglob("*.py"))}


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports: product modules by name, others by their top package."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from tasks.remote import dvc_version`` imports the submodule when there is one
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out.update(subs or {node.module})
    return {name if name.split(".")[0] in PRODUCT else name.split(".")[0] for name in out}


def room(module: str) -> str:
    """The longest room name that ``module`` lies in."""
    return max((r for r in MAY_IMPORT if module == r or module.startswith(r + ".")), key=len)


def graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imported(path, modules) for name, path in modules.items()}


def test_no_import_goes_against_the_rooms() -> None:
    wrong = []
    for module, deps in graph().items():
        here = room(module)
        for dep in deps:
            if dep.split(".")[0] in PRODUCT:
                there = room(dep)
                if there != here and there not in MAY_IMPORT[here]:
                    wrong.append(f"{module} ({here}) imports {dep} ({there})")
            elif dep in FORBIDDEN.get(here, set()):
                wrong.append(f"{module} ({here}) imports {dep}")
    assert wrong == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_product_modules() -> None:
    # a package's __init__ is where its submodules live, not an import of them: leave it out
    edges = {m: {d for d in deps if d != m.rpartition(".")[0]} for m, deps in graph().items()}
    assert cycles(edges) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_product_modules_share_a_name() -> None:
    names = Counter(name.rpartition(".")[2] for name, path in product_modules().items() if path.stem != "__init__")
    names.pop("__main__", None)
    assert [n for n, count in names.items() if count > 1] == []


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports against training's inner layers: base <- checkpointing <- memory; state apart."""
    wrong = []
    for module, deps in edges.items():
        mine = {d for d in deps if within(d, "training") and d != "training"}
        if within(module, CHECKPOINTING):
            wrong += [
                f"{module} imports {d} (not training's base)"
                for d in mine
                if not within(d, CHECKPOINTING) and d not in TRAINING_BASE
            ]
            if not within(module, MEMORY):
                wrong += [f"{module} imports the memory room's {d}" for d in mine if within(d, MEMORY)]
        if module in TRAINING_BASE:
            wrong += [f"{module} (base) imports {d}" for d in mine if d not in TRAINING_BASE]
        if module in STATE:
            wrong += [f"{module} (the state) imports {d}" for d in mine if within(d, CHECKPOINTING)]
        if within(module, DATA):
            wrong += [
                f"{module} (data room) imports {d}"
                for d in mine
                if not (within(d, DATA) or within(d, CHECKPOINTING) or d in TRAINING_BASE)
            ]
        if within(module, LOOP):
            wrong += [f"{module} (loop room) imports the entry point {d}" for d in mine if d in LOOP_ENTRIES]
        elif module not in LOOP_ENTRIES:
            wrong += [f"{module} imports the loop room's {d}" for d in mine if within(d, LOOP)]
    return sorted(wrong)


def test_training_keeps_its_inner_layers() -> None:
    edges = {m: deps - {m.rpartition(".")[0]} for m, deps in graph().items() if within(m, "training")}
    assert set(TRAINING_BASE) | {DATA, LOOP} | LOOP_ENTRIES <= edges.keys()  # a module renamed away is said here
    assert layer_violations(edges) == []


def test_the_layer_check_finds_each_kind_of_wrong_import() -> None:
    edges = {
        "training.checkpointing.memory.memory_tier": {"training.rundir", "training.paths"},
        "training.checkpointing.store": {"training.checkpointing.memory.slot_files", "training.config"},
        "training.paths": {"training.state"},
        "training.state": {"training.checkpointing.sharded", "training.datapipe.data"},
        "training.datapipe.streams": {"training.state", "training.config", "training.checkpointing.verify"},
        "training.loop.step": {"training.worker", "training.loop.runtime", "training.datapipe.data"},
        "training.tracking.progress": {"training.loop.claim"},
        "training.worker": {"training.loop.step"},
    }
    assert layer_violations(edges) == [
        "training.checkpointing.memory.memory_tier imports training.rundir (not training's base)",
        "training.checkpointing.store imports the memory room's training.checkpointing.memory.slot_files",
        "training.datapipe.streams (data room) imports training.state",
        "training.loop.step (loop room) imports the entry point training.worker",
        "training.paths (base) imports training.state",
        "training.state (the state) imports training.checkpointing.sharded",
        "training.tracking.progress imports the loop room's training.loop.claim",
    ]


def test_every_product_module_is_on_the_map() -> None:
    """docs/architecture.md names every module (its file name in backticks, alone or in a path):
    a module nobody can find on the map is one nobody reads before changing its room."""
    import re

    doc = (REPO / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(REPO))
        for room in PRODUCT
        for path in sorted((REPO / room).rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
        and not re.search(r"`[^`\n]*\b" + re.escape(path.name) + "`", doc)
    ]
    assert unnamed == [], f"add to docs/architecture.md: {unnamed}"
