"""The failure hooks know their run without a lookup (issue 47, item 4): a chunk's hook is bound
to its target when the chunk is submitted, the flow's hooks read the run from the flow run's own
parameters, keyed as the flow body keys them; nothing module-level holds a run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tasks import hooks
from tasks.chunk import audited, run_chunk
from training.config import config_from_dict
from training.events import read_events
from training.rundir import keyed_config

STATE = SimpleNamespace(data=RuntimeError("boom"), message="failed", name="Failed")


def test_a_chunk_hook_is_bound_to_its_chunk_when_submitted(prefect_api: str, tmp_path: Path) -> None:
    resources: Any = SimpleNamespace(run_dir=tmp_path, config=SimpleNamespace(run_name="run"), checkpoints=None)
    assert run_chunk.on_failure_hooks == []  # unbound: a hook with no target would have to look one up
    task = audited(run_chunk.with_options(retries=2), resources, chunk=3)
    assert task.retries == 2 and run_chunk.on_failure_hooks == []  # the options kept, the base task untouched
    (hook,) = task.on_failure_hooks
    hook(task, SimpleNamespace(id="any task run"), STATE)
    (event,) = read_events(tmp_path, "chunk_failed")
    assert (event["chunk"], event["failure"], event["message"]) == (3, "RuntimeError", "boom")


def test_the_flow_hook_writes_to_the_keyed_run_its_parameters_name(prefect_api: str, tmp_path: Path) -> None:
    """Under ``on_config_change: new_run`` the flow trains ``runs/<name>@<fp>``: the hook must not
    write to ``runs/<name>`` (the link to whichever config trained last)."""
    cfg = config_from_dict({"run_name": "demo", "runs_dir": str(tmp_path / "runs"), "on_config_change": "new_run"})
    keyed = keyed_config(cfg)
    assert keyed.run_dir != cfg.run_dir
    flow_run = SimpleNamespace(id="flow-1", parameters={"config": cfg.model_dump(mode="json")})
    hooks.flow_failed(None, flow_run, STATE)  # the flow failed before it made the run: nothing to write
    assert not (tmp_path / "runs").exists()
    keyed.run_dir.mkdir(parents=True)
    hooks.flow_failed(None, flow_run, STATE)
    (event,) = read_events(keyed.run_dir, "flow_failed")
    assert (event["flow_run_id"], event["chunk"], event["failure"]) == ("flow-1", None, "RuntimeError")
