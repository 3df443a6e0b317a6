"""Checkpoint save stall, background persist and restore time at 1 and 2 ranks (gloo on CPU).

For each world size and checkpoint format (``replicated``: rank 0 writes model + optimizer;
``sharded``: every rank writes its DCP shards) a real worker (torchrun for 2 ranks) trains the
example model, saving every ``--every`` steps; the stall (time the training loop was held up)
and the persist time come from the worker's ``checkpoint_saved`` events.  Then a second worker
resumes from the final checkpoint and its ``resumed`` event gives the verified restore time.
Medians over the saves of one run; the 1-rank replicated figure is the baseline of the ratios.

    .venv/bin/python bench/ranks.py [--d-model 256 --layers 4 --steps 60 --every 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from training.checkpointing.store import CheckpointStore
from training.config import load_config
from training.datapipe.corpus import prepare
from training.events import read_events
from training.rundir import open_run


def launch(run_dir: Path, until: int, ranks: int) -> None:
    tail = ["-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until)]
    cmd = (
        [sys.executable, *tail]
        if ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *tail]
    )
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"worker failed ({ranks} ranks): {p.stdout[-2000:]}{p.stderr[-2000:]}")


def one(root: Path, ranks: int, fmt: str, args: argparse.Namespace) -> dict:
    name = f"{fmt}-{ranks}"
    total = args.steps + args.every
    cfg = load_config(
        None,
        [
            f"runs_dir={root / 'runs'}",
            f"data.prepared_dir={root / 'data'}",
            f"run_name={name}",
            f"train.total_steps={total}",
            f"train.chunk_steps={total}",
            f"train.ranks={ranks}",
            "train.batch_size=16",
            f"task_args.d_model={args.d_model}",
            f"task_args.n_layer={args.layers}",
            "task_args.n_head=4",
            "data.seq_len=64",
            "data.synthetic_chars=200000",
            f"checkpoint.every_steps={args.every}",
            f"checkpoint.format={fmt}",
            "checkpoint.keep_last=2",
            "tracking.mlflow=false",
        ],
    )
    prepare(cfg.data, cfg.train.seed)
    run_dir = open_run(cfg)
    launch(run_dir, args.steps, ranks)
    saves = [e for e in read_events(run_dir, "checkpoint_saved") if not e.get("blocking")]
    final = [e for e in read_events(run_dir, "checkpoint_saved") if e.get("blocking")]
    launch(run_dir, total, ranks)  # resume from step args.steps
    resumed = [e for e in read_events(run_dir, "resumed") if e.get("step") == args.steps]
    newest = CheckpointStore(run_dir).latest_valid(record=False)
    return {
        "ranks": ranks,
        "format": fmt,
        "checkpoint_mb": newest.bytes / 1e6 if newest else float("nan"),
        "stall_ms": 1000 * statistics.median(e["stall_s"] for e in saves[1:] or saves),
        "persist_ms": 1000 * statistics.median(e["persist_s"] for e in saves[1:] or saves),
        "blocking_ms": 1000 * final[0]["stall_s"] if final else float("nan"),
        "restore_ms": 1000 * max(e["load_s"] for e in resumed) if resumed else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="convoy-ranks-"))
    rows = [one(root, ranks, fmt, args) for fmt in ("replicated", "sharded") for ranks in (1, 2)]
    base = rows[0]
    print(
        f"\n{'format':>10} {'ranks':>5} {'ckpt MB':>8} {'stall ms':>9} {'persist ms':>10} {'final save ms':>13} "
        f"{'restore ms':>10} {'stall vs 1-rank repl.':>21} {'restore vs 1-rank repl.':>23}"
    )
    for r in rows:
        print(
            f"{r['format']:>10} {r['ranks']:>5} {r['checkpoint_mb']:>8.1f} {r['stall_ms']:>9.1f} "
            f"{r['persist_ms']:>10.1f} {r['blocking_ms']:>13.1f} {r['restore_ms']:>10.1f} "
            f"{r['stall_ms'] / base['stall_ms']:>20.2f}x {r['restore_ms'] / base['restore_ms']:>22.2f}x"
        )


if __name__ == "__main__":
    main()
