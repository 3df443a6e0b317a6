"""Outputs of the DVC pipeline: the final model, train metrics, loss curve, and its evaluation.

``python -m training.evaluate export [PARAMS] [-S k=v]`` (end of the ``train`` stage):
  * ``models/model.safetensors`` — the model tensors of the newest *verified* checkpoint, with
    step, state digest and config fingerprint in the safetensors metadata (no optimizer, no RNG);
  * ``metrics/train.json`` — numbers a person compares: final step, final loss, resumes,
    failures, steps lost (``dvc metrics show`` stays narrow);
  * ``reports/train-info.json`` — what identifies the result but is no metric: state digest,
    config fingerprint, whether a resume was non-deterministic;
  * ``plots/loss.csv`` — step,loss,lr,grad_norm,val_loss from ``metrics.jsonl`` (one row per
    step; val_loss only at the ``train.eval_every`` steps, empty elsewhere);
  * ``plots/timeline.png`` — loss vs step with a marker at each failure and resume (the audit's
    picture, as a DVC image plot).
``python -m training.evaluate evaluate [PARAMS] [-S k=v]`` (``evaluate`` stage):
  * ``metrics/eval.json`` — validation loss (nats/token) of ``models/model.safetensors``.

Exit codes: 0 ok, 78 configuration/data error (one line on stderr).  Never unpickles anything.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from training.checkpointing import sharded
from training.checkpointing.safetensors_io import write_file
from training.checkpointing.store import CheckpointStore
from training.config import ConfigError, RunConfig, load_config
from training.datapipe.batch import batch_len
from training.event_records import EventLog
from training.events import EXIT_CONFIG
from training.fsutil import atomic_replace, atomic_write_bytes
from training.run_identity import RunInfo
from training.rundir import continues, describe_change, keyed_config, recorded_trajectories, run_info
from training.tracking.metrics import metric_rows
from training.tracking.resume_audit import analyse

MODEL_PATH = Path("models/model.safetensors")
TRAIN_METRICS = Path("metrics/train.json")
TRAIN_INFO = Path("reports/train-info.json")
EVAL_METRICS = Path("metrics/eval.json")
LOSS_PLOT = Path("plots/loss.csv")
TIMELINE_PLOT = Path("plots/timeline.png")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


def export_final_model(
    run_dir: str | Path, out_path: str | Path = MODEL_PATH, weights: str = "model"
) -> dict[str, Any]:
    """Write the model tensors of the run's newest valid checkpoint to ``out_path`` (safetensors);
    ``weights="ema"``: the EMA's average of them (``train.ema_decay``), same names and shapes.

    Tied/shared tensors are written as separate copies (safetensors forbids aliasing); loading
    with ``load_state_dict`` restores the tie.  Written with convoy's own writer (sorted header —
    the reference writer orders metadata by a randomised hash map), so the file is a deterministic
    function of the state and DVC sees an unchanged model as unchanged.
    """
    loaded = CheckpointStore(run_dir).load_latest()
    if loaded is None:
        raise ConfigError(f"{run_dir}: no valid checkpoint to export; train first (`convoy train`)")
    checkpoint, parts = loaded
    if weights == "ema":
        ema = (parts["state"].get("extra") or {}).get("ema")
        if ema is None:
            raise ConfigError(f"{checkpoint.path}: holds no EMA of the weights (train.ema_decay was not set)")
        model = ema["weights"]
    elif sharded.LAYOUT in parts:  # every rank's shard, read into whole tensors (no process group)
        model = sharded.full_model(checkpoint.path, parts[sharded.LAYOUT])
    else:
        model = parts["state"]["model"]
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in sorted(model.items())}
    meta = {
        "step": str(checkpoint.step),
        "digest": checkpoint.digest,
        "fingerprint": str(checkpoint.manifest.get("fingerprint", "")),
        "checkpoint": checkpoint.path.name,
        "format": "convoy-model-1",
        **({"weights": "ema"} if weights == "ema" else {}),
    }
    with atomic_replace(Path(out_path)) as tmp:
        write_file(tmp, tensors, meta)
    return {
        "path": str(out_path),
        "step": checkpoint.step,
        "digest": checkpoint.digest,
        "fingerprint": meta["fingerprint"],
        "weights": weights,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
    }


def load_model_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 - safe_open has no __iter__


def write_loss_plot(run_dir: str | Path, out_path: str | Path = LOSS_PLOT) -> int:
    cols = ("loss", "lr", "grad_norm", "val_loss")
    lines = [",".join(("step", *cols))]
    rows = metric_rows(run_dir)
    for step, m in rows:
        lines.append(",".join([str(step), *(repr(float(m[c])) if c in m else "" for c in cols)]))
    _atomic_write(Path(out_path), ("\n".join(lines) + "\n").encode())
    return len(rows)


def train_metrics(config: RunConfig, run_dir: str | Path, export: dict[str, Any]) -> dict[str, Any]:

    rows = metric_rows(run_dir)
    tail = [m["loss"] for _, m in rows[-20:] if "loss" in m]
    audit = analyse(EventLog.read(run_dir))
    return {
        "final_step": export["step"],
        "total_steps": config.train.total_steps,
        "final_loss": rows[-1][1].get("loss") if rows else None,
        "final_loss_avg20": sum(tail) / len(tail) if tail else None,
        "logged_steps": len(rows),
        "resumes": audit.resumes,
        "failures": audit.failures,
        "steps_lost": audit.steps_lost,
    }


def train_info(config: RunConfig, run_dir: str | Path, export: dict[str, Any]) -> dict[str, Any]:
    """Identity of the result, kept out of the metrics (a hex digest is not a number to compare)."""
    audit = analyse(EventLog.read(run_dir))
    return {
        "step": export["step"],
        "digest": export["digest"],
        "fingerprint": config.fingerprint(),
        "nondeterministic": audit.nondeterministic,
    }


def _check_trained_with(config: RunConfig, run_dir: Path, fingerprint: str) -> None:
    """The exported model must come from these params' trajectory: a pipeline must never record
    params.yaml's values against a model trained with others (the keys that differ are named)."""
    info = run_info(run_dir) or RunInfo()
    if not fingerprint or fingerprint in (config.fingerprint(), *info.accepted_fingerprints):
        return
    old = recorded_trajectories(run_dir, info).get(fingerprint)
    if continues(old, config):  # an earlier release's checkpoint of the same trajectory
        return
    raise ConfigError(
        f"{run_dir}: its newest checkpoint was trained with other settings than the params "
        f"({describe_change(old, config)}); run `convoy train` with these params first"
    )


def export_outputs(
    config: RunConfig,
    run_dir: str | Path | None = None,
    model_path: Path = MODEL_PATH,
    metrics_path: Path = TRAIN_METRICS,
    plot_path: Path = LOSS_PLOT,
    info_path: Path = TRAIN_INFO,
) -> dict[str, Any]:
    run_dir = Path(run_dir) if run_dir is not None else keyed_config(config).run_dir
    export = export_final_model(run_dir, model_path)
    _check_trained_with(config, run_dir, export["fingerprint"])
    if export["step"] != config.train.total_steps:
        raise ConfigError(
            f"{run_dir}: newest valid checkpoint is step {export['step']}, not train.total_steps = "
            f"{config.train.total_steps}; the run is not finished (run `convoy train` again)"
        )
    metrics = train_metrics(config, run_dir, export)
    _atomic_write(Path(metrics_path), (json.dumps(metrics, indent=1, sort_keys=True) + "\n").encode())
    info = train_info(config, run_dir, export)
    _atomic_write(Path(info_path), (json.dumps(info, indent=1, sort_keys=True) + "\n").encode())
    write_loss_plot(run_dir, plot_path)
    write_timeline(config, run_dir, Path(plot_path).with_name(TIMELINE_PLOT.name))
    return {**metrics, **info}


def write_timeline(config: RunConfig, run_dir: str | Path, out_path: Path = TIMELINE_PLOT) -> Path:
    """The audit's timeline picture for ``dvc plots show`` (failures and resumes marked)."""
    from training.tracking.resume_audit import render_timeline

    return render_timeline(run_dir, analyse(EventLog.read(run_dir)), out_path, title=config.run_name)


@torch.no_grad()
def validation_loss(
    config: RunConfig, model_path: str | Path = MODEL_PATH, batch_size: int = 64, max_batches: int = 200
) -> dict[str, Any]:
    """Mean loss (the task's ``loss_fn``) of the exported model over the validation split."""
    from training.state import configure_determinism, seed_everything
    from training.task import build_task

    device = torch.device("cpu")
    configure_determinism(True, device)
    seed_everything(config.train.seed)
    parts = build_task(config, device)
    if parts.val_data is None or len(parts.val_data) == 0:  # type: ignore[arg-type]
        raise ConfigError(f"task {config.task!r} has no validation data (val_data); nothing to evaluate")
    tensors, meta = load_model_file(model_path)
    if meta.get("fingerprint") and meta["fingerprint"] != config.fingerprint():
        raise ConfigError(
            f"{model_path} was trained with config fingerprint {meta['fingerprint']}, params have "
            f"{config.fingerprint()}; re-run the train stage"
        )
    parts.model.load_state_dict(tensors)
    parts.model.eval()
    loader = torch.utils.data.DataLoader(
        parts.val_data, batch_size=batch_size, shuffle=False, collate_fn=parts.collate_fn
    )
    total, n = 0.0, 0
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        size = batch_len(batch)  # dict batches too: the leading dimension of the first tensor
        total += float(parts.loss_fn(parts.model, batch)) * size
        n += size
    val = total / n
    out = {
        "val_loss": val,
        "val_bits_per_token": val / math.log(2),
        "val_samples": n,
        "step": int(meta.get("step", 0)),
    }  # the digest is in the model file's metadata
    floor = _entropy_floor(config)
    if floor is not None:
        out["entropy_floor_nats"] = floor
        out["val_loss_above_floor"] = val - floor
    return out


def _entropy_floor(config: RunConfig) -> float | None:
    from training.datapipe.corpus import entropy_floor

    return entropy_floor(config.data, config.task)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("export", "evaluate"))
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    ap.add_argument("--run-dir", type=Path, default=None, help="run directory (default runs_dir/run_name)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.params, args.overrides)
        if args.command == "export":
            result = export_outputs(cfg, args.run_dir)
        else:
            result = validation_loss(cfg)
            _atomic_write(EVAL_METRICS, (json.dumps(result, indent=1, sort_keys=True) + "\n").encode())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
