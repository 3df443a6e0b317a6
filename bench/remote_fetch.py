"""Checkpoints that travel (invariant 10): T_fetch against a raw copy, and upload lag vs interval.

1. **T_fetch** of the ~1.2 GB state (24 x Linear(2048, 2048) + AdamW moments after one step, as in
   bench/checkpoint.py) from a local-directory DVC remote: machine A commits it and uploads it
   (``version_checkpoint``: dvc add + push + the remote index); machine B (another repository,
   its own DVC cache, nothing local) runs ``fetch_newest``: read the index, copy the objects into
   a stage, verify (sizes, xxh3 hashes, structure, digest), install, fill metrics.  Baseline in the
   same run: ``shutil.copyfile`` of the very same object files from the remote into a directory
   (the bytes any download must move).  Both warm (page cache), interleaved, ``--repeats`` each.
2. **Upload lag vs checkpoint interval**: the example model (``--d-model``) trains ``--steps``
   steps with ``checkpoint.every_steps`` = each of ``--intervals`` while the background uploader
   follows it (policy: the newest committed checkpoint whenever it is free); from the run's
   events: checkpoints committed and uploaded, the checkpoint interval in seconds, and the lag at
   each publication (steps the newest committed checkpoint was ahead, seconds since its commit).

    .venv/bin/python bench/remote_fetch.py [--params 100.7e6] [--repeats 3] [--intervals 2,5,10,20] [--steps 60]
    (smoke: --params 5e6 --repeats 1 --steps 40 --intervals 10)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from checkpoint import build_state, make_parts  # noqa: E402  (bench/checkpoint.py: the same state)

from tasks.remote import remote_checkpoints  # noqa: E402
from tasks.remote.dvc_version import version_checkpoint  # noqa: E402
from tasks.run_resources import RunResources  # noqa: E402
from training.checkpointing.store import CheckpointStore  # noqa: E402
from training.config import RunConfig, load_config  # noqa: E402
from training.events import read_events  # noqa: E402
from training.rundir import open_run  # noqa: E402


def dvc_repo(path: Path) -> Path:
    """A machine: a git + DVC repository that ignores runs/ but its .dvc files."""
    from dvc.repo import Repo

    path.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    (path / ".gitignore").write_text("runs/**\n!runs/**/\n!runs/*/checkpoints/*.dvc\n!runs/*/checkpoints/.gitignore\n")
    Repo.init(str(path)).close()
    return path


def config(machine: Path, remote: Path, name: str, extra: list[str]) -> RunConfig:
    return load_config(
        None,
        [
            f"runs_dir={machine / 'runs'}",
            f"run_name={name}",
            f"data.prepared_dir={machine / 'data'}",
            "tracking.mlflow=false",
            "tracking.dvc=true",
            f"tracking.dvc_remote={remote}",
            *extra,
        ],
    )


# ---------------------------------------------------------------------------------- T_fetch
def upload_big_state(tmp: Path, params: float) -> tuple[RunConfig, Path, dict[str, Any]]:
    """Machine A: commit the big state at step 100 and upload it; returns the config, the remote
    and what the upload did."""
    remote = tmp / "remote"
    cfg = config(dvc_repo(tmp / "a"), remote, "big", [])  # no data here: only the structure is checked
    run_a = open_run(cfg)
    model, opt, _ = build_state(params)
    store = CheckpointStore(run_a, cfg.checkpoint, cfg.fingerprint())
    store.save(100, make_parts(model, opt, 100), blocking=True)
    t0 = time.perf_counter()
    result = version_checkpoint(None, run_a / "checkpoints" / "step-000000100", str(remote)).as_dict()
    result["upload_wall_s"] = time.perf_counter() - t0
    return cfg, remote, result


def remote_objects(cfg: RunConfig, run_dir: Path) -> list[tuple[str, str]]:
    """(object path in the remote, file name) of every file of the uploaded checkpoint."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.tree import Tree

    remote = remote_checkpoints.open_remote(cfg, run_dir)
    entry = remote.read_index().checkpoints[-1]
    tree = Tree.load(remote.odb, HashInfo("md5", entry.dvc_md5))
    return [(remote.odb.oid_to_path(hi.value), "/".join(key)) for key, _, hi in tree]


def raw_copy(objects: list[tuple[str, str]], dest: Path) -> float:
    """The baseline: copy the checkpoint's object files out of the remote, nothing else; seconds."""
    os.sync()  # neither side pays for the other's dirty pages (1.2 GB written each time)
    t0 = time.perf_counter()
    dest.mkdir(parents=True)
    for src, name in objects:
        shutil.copyfile(src, dest / name)
    return time.perf_counter() - t0


def timed_fetch(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    os.sync()
    got = remote_checkpoints.fetch_newest(cfg, run_dir, say=lambda m: None)
    assert got is not None and got["step"] == 100, got
    return got


def fetch_bench(tmp: Path, params: float, repeats: int) -> dict[str, Any]:
    """Fetch and raw copy, alternating which goes first, ``repeats`` times each."""
    cfg, remote, up = upload_big_state(tmp, params)
    cfg_b = config(dvc_repo(tmp / "b"), remote, "big", [])
    run_b = open_run(cfg_b)
    objects = remote_objects(cfg_b, run_b)
    out: dict[str, Any] = {"fetch_s": [], "copy_s": [], "parts": [], "upload": up}
    for i in range(repeats):
        for which in ("fetch", "copy") if i % 2 == 0 else ("copy", "fetch"):
            if which == "copy":
                out["copy_s"].append(raw_copy(objects, tmp / f"raw-{i}"))
                shutil.rmtree(tmp / f"raw-{i}")
                continue
            got = timed_fetch(cfg_b, run_b)
            out["fetch_s"].append(got["fetch_s"])
            out["parts"].append((got["download_s"], got["verify_s"]))
            out["bytes"] = got["bytes"]
    return out


# ---------------------------------------------------------------------------------- upload lag
def lag_run(tmp: Path, interval: int, steps: int, d_model: int) -> dict[str, Any]:
    """Train ``steps`` steps checkpointing every ``interval`` while the uploader follows."""
    from training.datapipe.corpus import prepare

    machine = dvc_repo(tmp / f"lag-{interval}")
    extra = [
        f"train.total_steps={steps}",
        f"train.chunk_steps={steps}",
        f"checkpoint.every_steps={interval}",
        "checkpoint.keep_last=3",
        f"task_args.d_model={d_model}",
        "task_args.n_layer=4",
    ]
    cfg = config(machine, tmp / f"remote-{interval}", "lag", extra)
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg).resolve()
    resources = RunResources(cfg, run_dir)
    resources.follow_uploads()
    cmd = [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(steps)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    resources.close()  # drains: the newest committed checkpoint is uploaded
    saved = read_events(run_dir, "checkpoint_saved")
    published = read_events(run_dir, "checkpoint_published")
    gaps = [b["time"] - a["time"] for a, b in zip(saved, saved[1:], strict=False)]
    return {
        "interval": interval,
        "interval_s": statistics.median(gaps) if gaps else None,
        "committed": len(saved),
        "uploaded": len(published),
        "bytes": CheckpointStore(run_dir).latest_valid(record=False).bytes,
        "lag_steps": [e["upload_lag_steps"] for e in published],
        "lag_s": [e["upload_lag_s"] for e in published],
        "upload_s": [e["upload_s"] for e in published],
    }


# ---------------------------------------------------------------------------------- report
def report(fetch: dict[str, Any], lags: list[dict[str, Any]]) -> None:
    gb = fetch["bytes"] / 1e9
    f, c = statistics.median(fetch["fetch_s"]), statistics.median(fetch["copy_s"])
    up = fetch["upload"]
    print(
        f"state: {gb:.3f} GB; upload (dvc add {up['add_s']:.2f} s + push {up['push_s']:.2f} s + index): "
        f"{up['upload_wall_s']:.2f} s"
    )
    print("| measurement | median (best) | GB/s | baseline: raw copy of the same objects, median (best) | ratio |")
    print("|---|---|---|---|---|")
    print(
        f"| T_fetch (index, copy, verify, install) | {f:.2f} s ({min(fetch['fetch_s']):.2f} s) | {gb / f:.2f} "
        f"| {c:.2f} s ({min(fetch['copy_s']):.2f} s), {gb / c:.2f} GB/s | {f / c:.2f}x |"
    )
    each = f"T_fetch {[round(x, 3) for x in fetch['fetch_s']]} s, raw copy {[round(x, 3) for x in fetch['copy_s']]} s"
    print(f"each repeat: {each}; of which download / verify {fetch['parts']} s")
    if not lags:
        return
    print()
    print(
        "| every_steps | interval s | ckpt MB | committed | uploaded | lag steps median / max "
        "| lag s median / max | upload s median |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in lags:
        print(
            f"| {r['interval']} | {r['interval_s']:.2f} | {r['bytes'] / 1e6:.1f} | {r['committed']} | {r['uploaded']} "
            f"| {statistics.median(r['lag_steps']):g} / {max(r['lag_steps'])} "
            f"| {statistics.median(r['lag_s']):.2f} / {max(r['lag_s']):.2f} | {statistics.median(r['upload_s']):.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100.7e6, help="parameters of the T_fetch state")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--intervals", default="2,5,10,20", help="checkpoint.every_steps values for the lag runs")
    ap.add_argument("--steps", type=int, default=60, help="steps of each lag run")
    ap.add_argument("--d-model", type=int, default=256, help="width of the example model in the lag runs")
    ap.add_argument("--tmp", default=None, help="scratch directory (default: a temporary one, removed)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="convoy-remote-bench-") as d:
        tmp = Path(d)
        print(f"T_fetch: {args.params:.3g} params, {args.repeats} repeat(s)", flush=True)
        fetch = fetch_bench(tmp / "fetch", args.params, args.repeats)
        shutil.rmtree(tmp / "fetch")
        lags = []
        for interval in (int(x) for x in args.intervals.split(",") if x):
            print(f"upload lag: every_steps={interval}", flush=True)
            lags.append(lag_run(tmp, interval, args.steps, args.d_model))
        report(fetch, lags)


if __name__ == "__main__":
    main()
