"""Hostile and conflicting inputs: doctored checkpoints, a second worker, bad configs.

Each checkpoint here is doctored the way an attacker (or a confused tool) would: every hash in
the manifest is recomputed, so only checks that look at names and structure can refuse it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flows.cli.main import app
from tests.engine_util import make_run, run_worker, start_worker, wait_for_step
from tests.flow_util import REPO, config, params
from training.checkpointing import safetensors_io as st
from training.checkpointing.state_check import ExpectedState, checkpoint_validator
from training.checkpointing.store import MANIFEST, CheckpointStore, member_path, state_digest
from training.config import ConfigError, load_config
from training.events import read_events
from training.rundir import load_run_config
from training.task import check_task

NEWEST, OLDER = "step-000000040", "step-000000030"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained to step 40 (checkpoints at 30 and 40 kept); each test works on a copy."""
    run_dir = make_run(tmp_path_factory.mktemp("hostile"))
    code, out = run_worker(run_dir, 40)
    assert code == 0, out
    return run_dir


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "runs" / "run"
    shutil.copytree(trained, copy, ignore=shutil.ignore_patterns(".worker.lock*"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["runs_dir"] = str(tmp_path / "runs")
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def rehash(ck: Path, manifest: dict | None = None) -> None:
    """Recompute every file entry and the digest, as someone doctoring a checkpoint would."""
    manifest = manifest or json.loads((ck / MANIFEST).read_text())
    for name in manifest["files"]:
        target = ck / name if not os.path.isabs(name) else Path(name)
        size, digest = st.hash_file(target)
        manifest["files"][name] = {"size": size, "xxh3_128": digest}
    manifest["digest"] = state_digest(manifest["files"])
    (ck / MANIFEST).write_text(json.dumps(manifest))


def resume_falls_back(run_dir: Path, reason_part: str, until: int = 45) -> str:
    """The worker refuses the newest checkpoint, says why, and resumes from the older one."""
    code, out = run_worker(run_dir, until)
    assert code == 0, out
    assert f"skipping checkpoint {NEWEST}" in out and reason_part in out, out
    assert f"resumed from step 30 (checkpoint {OLDER}" in out, out
    skipped = [e for e in read_events(run_dir, "checkpoint_skipped") if e["checkpoint"] == NEWEST]
    assert skipped and reason_part in skipped[-1]["reason"]
    return out


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


# ---------------------------------------------------------------- 1. names confined to the checkpoint


def traversal(run_dir: Path, ck: Path) -> str:
    outside = run_dir.parent / "outside.json"
    outside.write_text('{"x": 1}\n')
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"]["../../../outside.json"] = {}
    rehash(ck, manifest)
    return "../../../outside.json"


def absolute(run_dir: Path, ck: Path) -> str:
    outside = run_dir.parent / "abs.json"
    outside.write_text('{"x": 1}\n')
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"][str(outside)] = {}
    rehash(ck, manifest)
    return str(outside)


def symlink_out(run_dir: Path, ck: Path) -> str:
    outside = run_dir.parent / "state-copy.json"
    shutil.copy(ck / "state.json", outside)
    (ck / "state.json").unlink()
    (ck / "state.json").symlink_to(outside)  # same bytes, same hash: only the link gives it away
    return "symbolic link"


@pytest.mark.parametrize("doctor", [traversal, absolute, symlink_out])
def test_manifest_names_outside_the_checkpoint_are_refused_everywhere(run_dir: Path, doctor: Callable) -> None:
    ck = run_dir / "checkpoints" / NEWEST
    reason_part = doctor(run_dir, ck)
    store = CheckpointStore(run_dir)
    with pytest.raises(ValueError, match="refused, not opened"):
        store.verify(ck)
    code, out = cli("verify", str(run_dir))
    assert code == 1 and "NOT valid" in out and "refused" in out, out
    code, out = cli("inspect", str(run_dir), "--json")
    rows = {r["name"]: r for r in json.loads(out[out.index("[") :])}
    assert rows[NEWEST]["valid"] is False and "refused" in rows[NEWEST]["reason"]
    resume_falls_back(run_dir, reason_part)


def test_member_path_accepts_only_plain_names(tmp_path: Path) -> None:
    for good in ("state.safetensors", "rank-3.json", "dcp/shard-00001-model-00001-of-00001.safetensors"):
        assert member_path(tmp_path, good) == tmp_path / good
    for bad in ("../x", "a/../../x", "/etc/passwd", ".tmp-x", "dcp/../../x", "", "x/y", None, 3, "dcp/.hidden"):
        with pytest.raises(ValueError, match="refused, not opened"):
            member_path(tmp_path, bad)


# ---------------------------------------------------------------- 2. one validation: hashes and structure


def test_pickle_posing_as_safetensors_fails_verify_and_inspect(run_dir: Path) -> None:
    ck = run_dir / "checkpoints" / NEWEST
    torch.save({"model": {}}, ck / "state.safetensors")  # pickle bytes; never loaded by convoy
    rehash(ck)
    code, out = cli("verify", str(run_dir))
    assert code == 1 and "not a safetensors file" in out, out
    code, out = cli("inspect", str(run_dir), "--json")
    rows = {r["name"]: r for r in json.loads(out[out.index("[") :])}
    assert rows[NEWEST]["valid"] is False and rows[OLDER]["valid"] is True
    resume_falls_back(run_dir, "not a safetensors file")


def only_a_torch_file(ck: Path) -> str:
    torch.save({"w": torch.zeros(2)}, ck / "model.pt")
    for name in os.listdir(ck):
        if name not in ("model.pt", MANIFEST):
            os.unlink(ck / name)
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"] = {"model.pt": {}}
    rehash(ck, manifest)
    return "not a file convoy writes"


def skeleton_names_a_foreign_tensor(ck: Path) -> str:
    skel = json.loads((ck / "state.json").read_text())
    skel["model"]["tok.weight"] = {"__t__": "someone.else"}
    (ck / "state.json").write_text(json.dumps(skel))
    rehash(ck)
    return "names tensors it lacks ['someone.else']"


def wrong_shapes(ck: Path) -> str:
    """A structurally perfect checkpoint of a wider model (same fingerprint, valid files)."""
    store = CheckpointStore(ck.parent.parent)  # no validator: read what is there
    _, parts = store.load(ck)
    parts["state"]["model"]["pos.weight"] = torch.zeros(32, 48)
    scratch = CheckpointStore(
        ck.parent.parent.parent / "scratch", fingerprint=json.loads((ck / MANIFEST).read_text())["fingerprint"]
    )
    scratch.save(40, parts, blocking=True)
    shutil.rmtree(ck)
    shutil.copytree(scratch.root / NEWEST, ck)
    return "model.pos.weight: checkpoint has [32, 48]"


def optimizer_of_another_model(ck: Path) -> str:
    store = CheckpointStore(ck.parent.parent)
    _, parts = store.load(ck)
    parts["state"]["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    scratch = CheckpointStore(
        ck.parent.parent.parent / "scratch", fingerprint=json.loads((ck / MANIFEST).read_text())["fingerprint"]
    )
    scratch.save(40, parts, blocking=True)
    shutil.rmtree(ck)
    shutil.copytree(scratch.root / NEWEST, ck)
    return "optimizer: exp_avg of parameter 0 has shape [7]"


@pytest.mark.parametrize(
    "doctor", [only_a_torch_file, skeleton_names_a_foreign_tensor, wrong_shapes, optimizer_of_another_model]
)
def test_checkpoint_that_does_not_fit_is_refused_and_the_resume_falls_back(run_dir: Path, doctor: Callable) -> None:
    reason_part = doctor(run_dir / "checkpoints" / NEWEST)
    code, out = cli("verify", str(run_dir))
    assert code == 1 and "NOT valid" in out, out
    resume_falls_back(run_dir, reason_part)


def test_verify_inspect_and_status_judge_without_importing_torch(run_dir: Path) -> None:
    """The read-only commands check what a resume checks on the files' headers, against the
    shapes the worker recorded (task_shapes.json), and never pay ``import torch``; a doctored
    record of the task's shapes is what they then refuse."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch imported' if 'torch' in sys.modules else 'no torch'))\n"
        "from flows.cli.main import app\n"
        "app()\n"
    )
    for command in ("verify", "inspect", "status"):
        out = subprocess.run(
            [sys.executable, "-c", probe, command, str(run_dir)], capture_output=True, text=True, cwd=REPO
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), out
    shapes = run_dir / "task_shapes.json"
    recorded = json.loads(shapes.read_text())
    recorded["model"]["pos.weight"][0][0] += 1
    shapes.write_text(json.dumps(recorded))
    code, out = cli("verify", str(run_dir))
    assert code == 1 and "model.pos.weight" in out and "the task" in out, out


def test_a_refused_checkpoint_reached_again_is_quarantined_as_invalid_and_listed(run_dir: Path) -> None:
    wrong_shapes(run_dir / "checkpoints" / NEWEST)
    resume_falls_back(run_dir, "model.pos.weight", until=50)  # trains through step 40 again
    kinds = {e["kind"] for e in read_events(run_dir) if e.get("checkpoint") == NEWEST and "moved_to" in e}
    assert kinds == {"checkpoint_invalid"}, kinds  # not "replaced ... non-deterministic replay"
    assert not read_events(run_dir, "checkpoint_replaced")
    code, out = cli("inspect", str(run_dir), "--json")
    rows = json.loads(out[out.index("[") :])
    quarantined = [r for r in rows if r["quarantined"]]
    assert len(quarantined) == 1 and quarantined[0]["name"].startswith(f"{NEWEST}.invalid-")
    assert "model.pos.weight" in quarantined[0]["reason"]
    assert CheckpointStore(run_dir).verify(run_dir / "checkpoints" / NEWEST).step == 40  # the new one is fine
    code, out = cli("inspect", str(run_dir))
    assert "quarantined" in out


def test_the_validator_accepts_what_the_worker_writes(trained: Path) -> None:
    parts = check_task(load_run_config(trained))
    store = CheckpointStore(trained, validator=checkpoint_validator(ExpectedState.of(parts)))
    assert [r["valid"] for r in store.inspect()] == [True, True]


# ---------------------------------------------------------------- 3. one worker per run


def test_second_worker_is_refused_and_changes_nothing(run_dir: Path) -> None:
    first = start_worker(run_dir, 120, env={"CONVOY_FAULTS": "slow_step=43:60"})  # busy when the second comes
    try:
        wait_for_step(run_dir, first, 42)
        beat_before = json.loads((run_dir / "heartbeat" / "rank-0.json").read_text())
        events_before = (run_dir / "events.jsonl").read_text()
        second = subprocess.run(
            [sys.executable, "-m", "flows.cli.main", "worker", "--run-dir", str(run_dir), "--until-step", "120"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 78, second.stderr
        assert f"being trained by another worker (pid {first.pid} on" in second.stderr, second.stderr
        assert first.poll() is None
        beat = json.loads((run_dir / "heartbeat" / "rank-0.json").read_text())
        assert beat["pid"] == first.pid == beat_before["pid"]
        after = (run_dir / "events.jsonl").read_text()
        assert after.startswith(events_before) and "config_error" not in after[len(events_before) :]
    finally:
        first.kill()
        first.wait()
    code, out = run_worker(run_dir, 60)  # the lease died with its holder
    assert code == 0, out


@pytest.mark.slow
def test_a_worker_started_beside_a_flow_is_refused(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    from tests.flow_util import assert_no_leftovers, in_thread
    from tests.flow_util import wait_for_step as wait_for_beat

    cfg = config(params(tmp_path, data_dir, "beside", heartbeat={"stall_s": 60}))
    run_dir = cfg.run_dir.resolve()
    seen: dict = {}

    def intruder() -> None:
        beat = wait_for_beat(run_dir, 25)
        seen["beat"] = beat
        seen["proc"] = subprocess.run(
            [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", "60"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    os.environ["CONVOY_FAULTS"] = "slow_step=28:15"  # the flow's worker is busy when the intruder comes
    try:
        from flows.train import run_training

        t = in_thread(intruder)
        summary = run_training(cfg)
        t.join(timeout=120)
    finally:
        os.environ.pop("CONVOY_FAULTS", None)
    assert not t.errors, t.errors
    assert seen["proc"].returncode == 78, seen["proc"].stderr
    assert f"pid {seen['beat'].pid}" in seen["proc"].stderr
    assert summary["final_step"] == 60 and not summary["failures"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()  # one row per step: nobody trained alongside
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(1, 61))
    assert_no_leftovers(run_dir)


# ---------------------------------------------------------------- 4./5. configs checked before a run exists


def empty_params(tmp_path: Path) -> str:
    path = tmp_path / "params.yaml"
    path.write_text("{}\n")
    return str(path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("task_args.n_heads=4", "unknown key 'n_heads'"),
        ("task_args.n_layer=0", "n_layer = 0"),
        ("task_args.n_head=3", "not divisible by n_head = 3"),
    ],
)
def test_bad_task_args_fail_validate_and_train_before_a_run_exists(tmp_path: Path, override: str, message: str) -> None:
    base = ["-S", f"runs_dir={tmp_path / 'runs'}", "-S", f"data.prepared_dir={tmp_path / 'data'}", "-S", override]
    code, out = cli("validate", empty_params(tmp_path), *base)
    assert code == 2 and message in out and len(out.strip().splitlines()) == 1, out
    code, out = cli("train", empty_params(tmp_path), *base)
    assert code == 2 and message in out, out
    assert not (tmp_path / "runs").exists()


def test_validate_checks_task_args_before_the_data_is_prepared(tmp_path: Path) -> None:
    code, out = cli("validate", empty_params(tmp_path), "-S", f"data.prepared_dir={tmp_path}")
    assert code == 0 and "data not prepared yet" in out, out
    with pytest.raises(ConfigError, match="n_head = 3"):
        check_task(load_config(None, [f"data.prepared_dir={tmp_path}", "task_args.n_head=3"]))


def test_yaml_errors_name_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  lr: 0.1\n  batch_size: [16\nrun_name: x\n")
    code, out = cli("validate", str(bad))
    assert code == 2 and f"{bad}:4:" in out and "not valid YAML" in out, out
    assert len(out.strip().splitlines()) == 1
    yaml.safe_load("a: 1")  # the YAML library is the real one
