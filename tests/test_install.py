"""One install of a staged directory as the newest checkpoint (training/checkpointing/install.py),
with one durable order, used by the store, the fork and the fetch.  The order is read from the
real system calls of a real save and a real install (os.fsync / os.rename / os.replace are
wrapped to note their paths, then called)."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_util import small_parts
from training.checkpointing.install import install
from training.checkpointing.store import CheckpointStore

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(call, path) of every fsync, rename and replace, in order; the calls still happen."""
    seen: list[tuple[str, str]] = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def on_fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def on_rename(src: Any, dst: Any) -> None:
        seen.append(("rename", f"{src} -> {dst}"))
        rename(src, dst)

    def on_replace(src: Any, dst: Any) -> None:
        seen.append(("replace", f"{src} -> {dst}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", on_fsync)
    monkeypatch.setattr(os, "rename", on_rename)
    monkeypatch.setattr(os, "replace", on_replace)
    return seen


def _index(seen: list[tuple[str, str]], call: str, test: Any) -> int:
    hits = [i for i, (c, path) in enumerate(seen) if c == call and test(path)]
    assert hits, (call, seen)
    return hits[0]


def assert_durable_order(seen: list[tuple[str, str]], stage: Path, final: Path, files: list[str]) -> None:
    """Files, then the stage, then the rename, then the parent, then LATEST."""
    renamed = _index(seen, "rename", lambda p: p == f"{stage} -> {final}")
    for name in files:  # under its name, or its temporary sibling's (training/fsutil.py)
        tmp = str(stage / Path(name).parent / f".{Path(name).name}.")
        assert _index(seen, "fsync", lambda p, n=name, t=tmp: p == str(stage / n) or p.startswith(t)) < renamed, name
    assert _index(seen, "fsync", lambda p: p == str(stage)) < renamed
    parent = min(i for i, (c, p) in enumerate(seen) if c == "fsync" and p == str(final.parent) and i > renamed)
    latest = _index(seen, "replace", lambda p: p.endswith(f"-> {final.parent / 'LATEST'}"))
    assert renamed < parent < latest
    assert ("fsync", str(final.parent)) in seen[latest:], "LATEST's own rename is made durable"


def test_install_makes_files_stage_rename_then_latest_durable(tmp_path: Path, syscalls: list) -> None:
    root = tmp_path / "checkpoints"
    stage = root / ".fetch-step-000000007"
    (stage / "sub").mkdir(parents=True)
    for name in ("a.safetensors", "sub/b.json"):
        (stage / name).write_bytes(b"x" * 10)  # as a download leaves them: written, never fsynced
    install(stage, root / "step-000000007", files_synced=False)
    assert_durable_order(syscalls, stage, root / "step-000000007", ["a.safetensors", "sub/b.json"])
    assert (root / "LATEST").read_text() == "step-000000007\n" and not stage.exists()


def test_the_stores_save_goes_through_install(tmp_path: Path, syscalls: list) -> None:
    store = CheckpointStore(tmp_path)
    store.save(5, small_parts(5), blocking=True)
    root = tmp_path / "checkpoints"
    final = root / "step-000000005"
    files = sorted(p.name for p in final.iterdir())
    assert_durable_order(syscalls, root / ".tmp-step-000000005", final, files)


def test_no_other_module_renames_a_checkpoint_into_place_or_writes_latest() -> None:
    """The store, the fork and the fetch all call install(); nothing else writes LATEST."""
    callers, latest_writers = set(), set()
    for room in ("training", "tasks", "flows"):
        for path in (REPO / room).rglob("*.py"):
            text = path.read_text()
            tree = ast.parse(text)
            names = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            if "install" in names:
                callers.add(path.relative_to(REPO).as_posix())
            if ".latest," in text or "/ LATEST," in text or "LATEST_FILE," in text:
                latest_writers.add(path.relative_to(REPO).as_posix())
    assert {"training/checkpointing/store.py", "training/rundir.py", "tasks/remote/remote_checkpoints.py"} <= callers
    assert latest_writers <= {"training/checkpointing/install.py"}, latest_writers
