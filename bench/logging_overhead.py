"""Cost of metric logging to the training loop: the worker's journal, and MLflow shipped from it.

    python bench/logging_overhead.py [--steps 300] [--block 50] [-S k=v ...]

Trains the example task in this process with the worker's own ``train_step`` logic, in
interleaved blocks (so machine load drifts hit every variant alike), for three variants:

* ``none``          — no logging at all (the baseline);
* ``journal``       — ``StepMetricLogger([JsonlBackend], flush_every=1)`` exactly as the worker logs:
                      one ``metrics.jsonl`` append per step, nothing else (no MLflow in the worker,
                      docs/architecture.md invariant 12);
* ``journal+ship``  — the same, with a :class:`tasks.records.metric_shipping.MetricShipper` in *another
                      process* (as the chunk task runs it) following that journal into MLflow on
                      SQLite while the loop trains: what shipping costs the loop through the CPU it
                      takes on this machine.

Printed: median step time; the time spent *inside* the logging calls per step (what the training
loop waits for) as a % of the step; the wall-clock difference per step against the baseline
(noisy on a loaded machine); and how many values the shipper delivered.  A figure, not an
assertion.  Before invariant 12 (commit 2f106be) the worker logged to MLflow itself: see
bench/RESULTS.md for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


VARIANTS = ("journal", "journal+ship")


def setup(args: argparse.Namespace) -> tuple[Any, str, Any, Callable[[], dict[str, float]]]:
    """The config (a scratch run dir and MLflow store), the task, and one training step as the
    worker takes it, returning its metrics."""
    import torch

    from tasks.records.mlflow_client import client_for
    from training.config import load_config
    from training.datapipe.corpus import prepare
    from training.datapipe.data import Cursor, LoaderSpec, make_loader
    from training.state import configure_determinism, seed_everything
    from training.task import build_task

    tmp = Path(tempfile.mkdtemp(prefix="convoy-bench-log-"))
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    total = args.steps * 3 + 10
    cfg = load_config(
        None,
        [
            f"runs_dir={tmp / 'runs'}",
            f"data.prepared_dir={tmp / 'data'}",
            f"train.total_steps={total}",
            f"train.chunk_steps={total}",
            "tracking.mlflow=true",
            f"tracking.mlflow_uri={uri}",
            "tracking.experiment=bench",
            *args.overrides,
        ],
    )
    prepare(cfg.data, cfg.train.seed)
    client_for(uri).search_experiments()  # schema creation is not part of the figure

    device = torch.device("cpu")
    configure_determinism(cfg.train.deterministic, device)
    seed_everything(cfg.train.seed)
    parts = build_task(cfg, device)
    batches = iter(
        make_loader(parts.train_data, LoaderSpec(cfg.train.batch_size, cfg.train.seed, Cursor(), 0, 1), num_workers=0)
    )

    def step() -> dict[str, float]:
        x = next(batches)
        loss = parts.loss_fn(parts.model, x)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(parts.model.parameters(), cfg.train.grad_clip)
        parts.optimizer.step()
        lr = parts.optimizer.param_groups[0]["lr"]
        parts.scheduler.step()
        return {"loss": float(loss.detach()), "grad_norm": float(gn), "lr": float(lr)}

    return cfg, uri, parts, step


def make_loggers(cfg: Any, uri: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per variant, a run of its own with the worker's logger; for ``journal+ship`` the shipper
    process following its journal (stopped by closing its stdin)."""
    import subprocess

    from tasks.records.mlflow_runs import ensure_mlflow_run
    from training.rundir import open_run
    from training.tracking.metrics import JsonlBackend, StepMetricLogger

    loggers, shippers = {}, {}
    for variant in VARIANTS:
        vcfg = cfg.model_copy(update={"run_name": f"bench-{variant.replace('+', '-')}"})
        run_dir = open_run(vcfg)
        run_id = ensure_mlflow_run(vcfg, run_dir)
        loggers[variant] = StepMetricLogger([JsonlBackend(run_dir / "metrics.jsonl")], run_dir, flush_every=1)
        if variant == "journal+ship":
            cmd = [sys.executable, __file__, "--ship", str(run_dir / "metrics.jsonl"), uri, run_id]
            shippers[variant] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return loggers, shippers


def ship_until_stdin_closes(journal: str, uri: str, run_id: str) -> int:
    """The shipper process: follow ``journal`` into MLflow until stdin closes, print what it sent."""
    from tasks.records.metric_shipping import MetricShipper
    from tasks.records.mlflow_client import client_for

    shipper = MetricShipper(lambda: client_for(uri), run_id, Path(journal), say=lambda _: None).start()
    sys.stdin.read()
    report = shipper.stop(drain_s=60)
    print(f"{report.shipped} {report.waiting}", flush=True)
    return 0


def measure(
    args: argparse.Namespace, cfg: Any, parts: Any, step: Callable[[], dict[str, float]], loggers: dict[str, Any]
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Step times per variant (``none`` first) in interleaved blocks, and the seconds each
    variant spent inside its logger's calls, its closing ``close()`` included."""
    for _ in range(10):  # warm-up (first Adam step imports dynamo, allocations)
        step()
    times: dict[str, list[float]] = {v: [] for v in ("none", *VARIANTS)}
    in_log: dict[str, float] = {v: 0.0 for v in times}
    counters = {v: 0 for v in times}
    done = 0
    while done < args.steps:
        n = min(args.block, args.steps - done)
        for variant in times:
            for _ in range(n):
                t0 = time.perf_counter()
                out = step()
                dt_step = time.perf_counter() - t0
                out.update(step_time_s=dt_step, tokens_per_s=cfg.train.batch_size * parts.tokens_per_sample / dt_step)
                if variant != "none":
                    counters[variant] += 1
                    t1 = time.perf_counter()
                    loggers[variant].log(counters[variant], out)
                    in_log[variant] += time.perf_counter() - t1
                times[variant].append(time.perf_counter() - t0)
        done += n
    for variant in VARIANTS:
        t1 = time.perf_counter()
        loggers[variant].close()
        in_log[variant] += time.perf_counter() - t1  # the worker's close() at chunk end waits too
    return times, in_log


def print_table(
    args: argparse.Namespace,
    cfg: Any,
    parts: Any,
    uri: str,
    measured: tuple[dict[str, list[float]], dict[str, float]],
    shipped: dict[str, str],
) -> None:
    import torch

    times, in_log = measured
    base = statistics.median(times["none"])
    mean_base = statistics.fmean(times["none"])
    print(
        f"convoy logging overhead — {args.steps} steps per variant, blocks of {args.block}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"model: {sum(p.numel() for p in parts.model.parameters()):,} parameters, batch {cfg.train.batch_size}; "
        f"MLflow {uri}"
    )
    print(f"baseline step: median {base * 1e3:.1f} ms, mean {mean_base * 1e3:.1f} ms")
    print(
        f"{'variant':13} {'in-loop ms/step':>16} {'% of step':>10} {'median Δ ms':>12} {'mean Δ ms':>10} {'shipped':>8}"
    )
    for variant in VARIANTS:
        per = in_log[variant] / args.steps
        med = statistics.median(times[variant]) - base
        wall = statistics.fmean(times[variant]) - mean_base
        print(
            f"{variant:13} {per * 1e3:16.3f} {100 * per / base:9.2f}% {med * 1e3:12.2f} {wall * 1e3:10.2f} "
            f"{shipped.get(variant, '-'):>8}"
        )
    print(
        "in-loop = time the training loop spends in StepMetricLogger.log/close; Δ = step time minus the "
        "baseline's (median and mean); shipped = values the shipper process delivered to MLflow."
    )


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--ship":
        return ship_until_stdin_closes(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per variant")
    ap.add_argument("--block", type=int, default=50, help="steps per interleaved block")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg, uri, parts, step = setup(args)
    loggers, shippers = make_loggers(cfg, uri)
    measured = measure(args, cfg, parts, step, loggers)
    shipped = {}
    for variant, proc in shippers.items():
        out, _ = proc.communicate(timeout=120)  # closes its stdin: it drains and reports
        shipped[variant] = out.split()[0] if out.split() else "?"
    print_table(args, cfg, parts, uri, measured, shipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
