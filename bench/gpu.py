#!/usr/bin/env python
"""GPU checkpoint benchmark: CheckpointStore with the state in device memory, every figure
against a baseline measured in the same run (interleaved, medians over ``--repeats``).

Run from the repository root on a machine with CUDA (``bench/gpu_check.sh`` runs it)::

    .venv/bin/python bench/gpu.py                    # ~100M params + AdamW on cuda:0 (~1.2 GB)
    .venv/bin/python bench/gpu.py --params 2e7       # quick

Without CUDA it prints one line saying so and exits 0 (nothing measured); ``--cpu-smoke`` then runs
every section on the CPU instead, to check the script itself (its figures mean nothing).

* async save stall: ``save(blocking=False)`` of device tensors in steady state (D2H into the
  store's reused pinned buffers, then the persist thread) until the device is free again
  (``torch.cuda.synchronize()``), vs a raw ``copy_(non_blocking=True)`` of the same tensors into
  preallocated pinned buffers + synchronize.  Goal ratio <= 1.2.
* persist: the background persist's GB/s (write + hash + fsync + manifest + rename) vs a raw
  write + fsync of the same bytes from pinned memory.  Informational.
* restore onto the device: ``load()`` (read + verify) + ``load_state_dict`` into the CUDA model
  and optimizer + synchronize, vs a raw read of the same files into a preallocated buffer + one
  H2D copy; warm page cache, and cold where ``drop_caches`` is allowed.  Informational.
* step slowdown: median training step (forward/backward/AdamW on the device, synchronized)
  while a persist runs in the background vs steps with no persist, interleaved.  Goal <= 5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.checkpoint import (  # noqa: E402
    GB,
    drop_caches,
    flat_tensors,
    interleave,
    make_parts,
    raw_readinto,
    raw_views,
    raw_write,
)
from training.checkpointing.store import CheckpointStore  # noqa: E402
from training.config import CheckpointConfig  # noqa: E402

STALL_GOAL = 1.2
SLOWDOWN_GOAL = 0.05


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_timed(fn: Any, *args: Any) -> float:
    """Wall time of ``fn(*args)`` until the device has finished the work it queued."""
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    return time.perf_counter() - t0


def build(params: float, dev: torch.device, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A stack of fp32 Linear layers on ``dev`` after one AdamW step, and its train step."""
    torch.manual_seed(0)
    width = 4096
    while width > 256 and params / (width * width + width) < 4:
        width //= 2
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()
    sync()
    return model, opt, step


@dataclass
class GpuBench:
    """What every section measures and records into: the model on the device, its train step,
    its state's flat tensors, the store under test, the timings and the step of the newest save."""

    dev: torch.device
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    train_step: Callable[[], None]
    tensors: list[torch.Tensor]
    store: CheckpointStore
    repeats: int
    t: dict[str, list[float]] = field(default_factory=dict)
    step: int = 1

    def add(self, name: str, value: float) -> None:
        self.t.setdefault(name, []).append(value)


def build_bench(args: argparse.Namespace, dev: torch.device, tmp: Path) -> tuple[GpuBench, dict[str, Any]]:
    """The model on ``dev`` and an empty store, and ``res`` with what was built (printed too)."""
    gpu = dev.type == "cuda"
    model, opt, train_step = build(args.params, dev, args.batch)
    tensors = flat_tensors(make_parts(model, opt, 0))
    nb = sum(x.numel() * x.element_size() for x in tensors)
    n_params = sum(p.numel() for p in model.parameters())
    res: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(dev) if gpu else "CPU smoke run",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if gpu else None,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "params": n_params,
        "layers": len(model),
        "tensor_bytes": nb,
        "tensor_count": len(tensors),
        "repeats": args.repeats,
        "device_bytes": sum(x.numel() * x.element_size() for x in tensors if x.is_cuda),
    }
    print(
        f"{res['gpu']}, torch {res['torch']} (CUDA {res['cuda']}): {len(model)} x Linear = {n_params / 1e6:.1f}M "
        f"params; state {nb / GB:.3f} GB in {len(tensors)} tensors ({res['device_bytes'] / GB:.3f} GB on the "
        "device)",
        flush=True,
    )
    store = CheckpointStore(tmp / "run", CheckpointConfig(keep_last=1))
    return GpuBench(dev, model, opt, train_step, tensors, store, args.repeats), res


def measure_async_stall(b: GpuBench, res: dict[str, Any]) -> list[torch.Tensor]:
    """Section 1: ``save(blocking=False)`` until the device is free vs a raw ``copy_`` into
    preallocated pinned buffers.  Returns those buffers (section 2 writes them)."""
    print("[1/4] async save stall vs copy_ into pinned buffers ...", flush=True)
    b.store.save(1, make_parts(b.model, b.opt, 1), blocking=False)  # allocates the store's pinned buffers
    b.store.wait()
    pinned = [torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda) for x in b.tensors]

    def raw_copy() -> None:
        for d, s in zip(pinned, b.tensors, strict=True):
            d.copy_(s, non_blocking=s.is_cuda)

    raw_copy()  # first touch outside the timing
    for i in range(b.repeats):
        for kind in interleave(i, ["copy", "save"]):
            if kind == "copy":
                b.add("copy", sync_timed(raw_copy))
                continue
            b.step += 1
            p = make_parts(b.model, b.opt, b.step)
            sync()
            t0 = time.perf_counter()
            b.store.save(b.step, p, blocking=False)
            b.add("save_call", time.perf_counter() - t0)
            sync()
            b.add("stall", time.perf_counter() - t0)
            b.store.wait()
            b.add("persist", b.store.last_persist_s)
            res["checkpoint_bytes"] = b.store.last_committed.bytes
    return pinned


def measure_raw_write(b: GpuBench, pinned: list[torch.Tensor], tmp: Path) -> None:
    """Section 2: the baseline of the background persist, a raw write + fsync from pinned memory."""
    print("[2/4] raw write+fsync of the same bytes ...", flush=True)
    views = raw_views(pinned)
    raw_path = tmp / "raw.bin"
    for _ in range(b.repeats):
        raw_path.unlink(missing_ok=True)
        os.sync()
        t0 = time.perf_counter()
        raw_write(raw_path, views)
        b.add("raw_write", time.perf_counter() - t0)
    raw_path.unlink(missing_ok=True)
    del views


def measure_restore(b: GpuBench, cold: bool, res: dict[str, Any]) -> None:
    """Section 3: ``load()`` + ``load_state_dict`` onto the device vs a raw read of the same files
    + one H2D copy, warm page cache and, with ``cold`` where allowed, cold."""
    print("[3/4] restore onto the device vs raw read + H2D copy ...", flush=True)
    checkpoint = b.store.last_committed
    files = [checkpoint.path / name for name in sorted(checkpoint.manifest["files"])]
    total = sum(f.stat().st_size for f in files)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=b.dev.type == "cuda")
    device_buf = torch.empty(total, dtype=torch.uint8, device=b.dev)
    view = memoryview(host.numpy()).cast("B")

    def raw_restore() -> None:
        off = 0
        for f in files:
            n = f.stat().st_size
            raw_readinto(f, view[off : off + n])
            off += n
        device_buf.copy_(host, non_blocking=True)

    def convoy_restore() -> None:
        _, loaded = b.store.load(checkpoint.path)
        b.model.load_state_dict(loaded["state"]["model"])
        b.opt.load_state_dict(loaded["state"]["optimizer"])

    modes = ["warm"] + (["cold"] if cold and drop_caches() else [])
    res["cold_measured"] = "cold" in modes
    for mode in modes:
        raw_restore()  # warm the page cache and the allocator once
        convoy_restore()
        for i in range(b.repeats):
            for kind in interleave(i, ["raw", "convoy"]):
                if mode == "cold":
                    drop_caches()
                b.add(f"{mode}_{kind}_restore", sync_timed(raw_restore if kind == "raw" else convoy_restore))


def measure_step_slowdown(b: GpuBench, idle_steps: int) -> None:
    """Section 4: training steps while a persist runs in the background vs ``idle_steps`` steps
    with none, interleaved."""
    print("[4/4] step time during a background persist vs no persist ...", flush=True)
    for _ in range(3):
        b.train_step()
    for i in range(b.repeats):
        for kind in interleave(i, ["idle", "persist"]):
            if kind == "idle":
                for _ in range(idle_steps):
                    b.add("step_idle", sync_timed(b.train_step))
                continue
            b.step += 1
            b.store.save(b.step, make_parts(b.model, b.opt, b.step), blocking=False)
            sync()  # the snapshot (the stall, measured above) is not a step
            n = 0
            while b.store.in_flight or n == 0:  # at least one step, however fast the persist
                b.add("step_persist", sync_timed(b.train_step))
                n += 1
            b.add("steps_per_persist", n)
            b.store.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # cpu: --cpu-smoke
    torch.backends.cuda.matmul.allow_tf32 = False  # what train.deterministic sets
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    b, res = build_bench(args, dev, tmp)
    pinned = measure_async_stall(b, res)
    measure_raw_write(b, pinned, tmp)
    measure_restore(b, args.cold, res)
    measure_step_slowdown(b, args.steps)
    res["t"] = b.t
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def report(res: dict[str, Any]) -> tuple[str, list[str]]:
    t = res["t"]

    def med(name: str) -> float:
        return statistics.median(t[name])

    checkpoint_bytes = res["checkpoint_bytes"]
    lines = [
        f"{res['date_utc']}; {res['gpu']}; torch {res['torch']} CUDA {res['cuda']}; {res['cpus']} CPUs; "
        f"{res['params'] / 1e6:.1f}M params + AdamW = {res['tensor_bytes'] / GB:.3f} GB state "
        f"({res['device_bytes'] / GB:.3f} GB on the device), checkpoint {checkpoint_bytes / GB:.3f} GB; "
        f"{res['repeats']} interleaved repeats, medians",
        "",
        "| measurement | convoy | same-run baseline | convoy vs baseline | goal |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    stall = med("stall") / med("copy")
    lines.append(
        f"| async save stall until the device is free (call returns in {med('save_call') * 1e3:.1f} ms) | "
        f"{med('stall') * 1e3:.1f} ms | raw copy_ into pinned: {med('copy') * 1e3:.1f} ms "
        f"({res['tensor_bytes'] / med('copy') / GB:.1f} GB/s) | {stall:.2f}x the time | <= {STALL_GOAL}x |"
    )
    verdicts.append(
        f"GOAL async save stall <= {STALL_GOAL}x raw D2H copy: {stall:.2f}x -> "
        + ("MET" if stall <= STALL_GOAL else "MISSED")
    )
    persist_gbps, raw_gbps = checkpoint_bytes / med("persist"), res["tensor_bytes"] / med("raw_write")
    lines.append(
        f"| background persist | {persist_gbps / GB:.2f} GB/s | raw write+fsync: {raw_gbps / GB:.2f} GB/s | "
        f"{persist_gbps / raw_gbps:.2f}x the GB/s | - |"
    )
    for mode in ("warm", "cold"):
        if f"{mode}_raw_restore" in t:
            c, r = med(f"{mode}_convoy_restore"), med(f"{mode}_raw_restore")
            lines.append(
                f"| restore onto the device, {mode} cache (load + verify + load_state_dict) | "
                f"{c * 1e3:.0f} ms ({checkpoint_bytes / c / GB:.2f} GB/s) | raw read + H2D: {r * 1e3:.0f} ms "
                f"({checkpoint_bytes / r / GB:.2f} GB/s) | {r / c:.2f}x the GB/s | - |"
            )
    slow = med("step_persist") / med("step_idle") - 1
    lines.append(
        f"| training step during a persist ({statistics.median(t['steps_per_persist']):.0f} steps per "
        f"persist) | {med('step_persist') * 1e3:.2f} ms | no persist: {med('step_idle') * 1e3:.2f} ms | "
        f"{slow * 100:+.1f} % step time | <= +{SLOWDOWN_GOAL * 100:.0f} % |"
    )
    verdicts.append(
        f"GOAL step slowdown during a background persist <= {SLOWDOWN_GOAL * 100:.0f} %: "
        f"{slow * 100:+.1f} % -> " + ("MET" if slow <= SLOWDOWN_GOAL else "MISSED")
    )
    if not res["cold_measured"]:
        lines.append("- cold-cache restore not measured (--no-cold, or /proc/sys/vm/drop_caches not writable)")
    return "\n".join(lines), verdicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    ap.add_argument("--batch", type=int, default=1024, help="rows per training step in section 4")
    ap.add_argument("--steps", type=int, default=30, help="idle steps timed per repeat in section 4")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement (median reported)")
    ap.add_argument("--tmp", default=str(ROOT / ".bench-tmp-gpu"), help="scratch dir on the disk checkpoints use")
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="skip the cold-cache restore")
    ap.add_argument("--json", help="write the raw timings here")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="without CUDA: run every section on the CPU (checks the script, measures nothing useful)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench/gpu.py: no CUDA device visible; this benchmark needs CUDA (nothing measured)")
        return 0
    res = run(args)
    table, verdicts = report(res)
    print()
    print(table)
    print()
    print("\n".join(verdicts))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
