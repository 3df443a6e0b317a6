"""The failure hooks' lookup keeps nothing of a finished run (issue 47, item 4): an entry is
dropped by the hook that used it, or when its run succeeded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tasks import hooks


def test_an_entry_is_dropped_by_its_hook_or_on_success(prefect_api: str, tmp_path: Path) -> None:
    hooks.remember_run("task-1", tmp_path, "run", chunk=1)
    hooks.remember_run("flow-1", tmp_path, "run")
    hooks.remember_run("task-2", tmp_path, "run", chunk=2)
    state = SimpleNamespace(data=RuntimeError("boom"), message="failed", name="Failed")
    hooks.chunk_failed(None, SimpleNamespace(id="task-1"), state)
    hooks.flow_failed(None, SimpleNamespace(id="flow-1", parameters={}), state)
    hooks.forget_run("task-2")  # what the chunk task does once it committed
    assert not {"task-1", "flow-1", "task-2"} & set(hooks._RUNS)
