#!/usr/bin/env python
"""Checkpoint I/O benchmark: training.checkpointing.store.CheckpointStore against same-run raw baselines.

Run from the repository root::

    .venv/bin/python bench/checkpoint.py                 # ~100M params + AdamW (~1.2 GB)
    .venv/bin/python bench/checkpoint.py --params 5e6    # quick smoke run

A stack of fp32 ``nn.Linear`` layers gets one AdamW step (so ``exp_avg``/``exp_avg_sq`` exist);
its state is saved through the store exactly as the worker does (parts ``state`` + ``rank-0``).
Each figure is measured beside a baseline doing the same bytes the plainest way, interleaved
(baseline, subject, baseline, subject, ...) so disk drift hits both; medians over ``--repeats``.

* async stall: ``save(blocking=False)`` in steady state (buffers already allocated) vs
  ``copy_`` of the same tensors into preallocated buffers.  Goal ratio <= 1.2.
* sync save: ``save(blocking=True)`` (write + hash + fsync + manifest + rename) vs one raw
  ``write`` + ``fsync`` of the same bytes.  Goal GB/s ratio >= 0.8.
* restore: ``load()`` (read + xxh3-128 verify + frombuffer tensors) vs raw ``readinto`` of the
  same files into a preallocated buffer (and, for reference, into a fresh uninitialised buffer), warm
  page cache and cold (``drop_caches``, needs root).  ``load_state_dict`` and the first optimizer step
  after the restore are reported separately.  Goal GB/s ratio >= 0.8.
* verify: ``verify()`` vs ``xxh3_128`` over an in-memory buffer (informational).

``--hazards`` checks two restore hazards (file pinned after retention, in-place writes showing through);
``--fresh-process N`` times N resumes in a new process (the restarted-worker case).
Temporary files go to ``--tmp`` (default ``<repo>/.bench-tmp``, removed at the end).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import xxhash  # noqa: E402

from training.checkpointing.codec import split_tree  # noqa: E402
from training.checkpointing.store import CheckpointStore  # noqa: E402
from training.config import CheckpointConfig  # noqa: E402
from training.state import capture_rng  # noqa: E402

GB = 1e9


# ---------------------------------------------------------------------------- helpers
def med(xs: list[float]) -> float:
    return statistics.median(xs)


LAST_CPU = [0.0]  # process CPU seconds (all threads) of the latest timed() call


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    LAST_CPU[0] = time.process_time() - c0
    return time.perf_counter() - t0, out


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B") for t in tensors if t.numel()]


def raw_write(path: Path, views: list[memoryview]) -> int:
    n = 0
    with open(path, "wb", buffering=0) as f:
        for v in views:
            done = 0
            while done < len(v):
                done += f.write(v[done:])
            n += done
        os.fsync(f.fileno())
    return n


def raw_readinto(path: Path, view: memoryview) -> int:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return got


# ---------------------------------------------------------------------------- model
def build_state(params: float, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    torch.manual_seed(seed)
    width = 2048
    while width > 64 and params / (width * width + width) < 4:
        width //= 2
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, width


def make_parts(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The shape TrainState.checkpoint_parts(rank=0) produces."""
    return {
        "rank-0": {"rng": capture_rng(), "step": step},
        "state": {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": None,
            "scaler": {"scale": 1.0, "growth_tracker": 0},
            "step": step,
            "tokens_seen": 0,
            "cursor": {"epoch": 0, "offset": 0},
        },
    }


def flat_tensors(parts: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for part in sorted(parts):
        _, flat = split_tree(parts[part])
        out.extend(flat[k] for k in sorted(flat))
    return out


# ---------------------------------------------------------------------------- fresh-process resume
def resume_child(ckpt: str, params: float) -> None:
    """What a restarted worker pays: fresh process, model built (params touched), optimizer with no
    state; time load + load_state_dict + the first optimizer step.  Prints one JSON line."""
    torch.manual_seed(0)
    width = 2048
    while width > 64 and params / (width * width + width) < 4:
        width //= 2
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width) for _ in range(max(1, round(params / (width * width + width))))]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warm = torch.nn.Linear(2, 2)  # pay the one-off optimizer import cost (torch._dynamo) outside the timing
    w_opt = torch.optim.AdamW(warm.parameters())
    warm(torch.ones(1, 2)).sum().backward()
    w_opt.step()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    store = CheckpointStore(Path(ckpt).parent.parent)
    out: dict[str, float] = {}
    out["load"], (_c, loaded) = timed(store.load, Path(ckpt))
    out["load_cpu"] = LAST_CPU[0]
    s = loaded["state"]
    out["lsd_model"] = timed(model.load_state_dict, s["model"])[0]
    out["lsd_opt"] = timed(opt.load_state_dict, s["optimizer"])[0]
    del loaded, s
    out["first_step"] = timed(opt.step)[0]
    out["total"] = out["load"] + out["lsd_model"] + out["lsd_opt"] + out["first_step"]
    out["rss_gb"] = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GB
    gc.collect()
    out["files_still_mapped"] = sum(ckpt in ln for ln in Path("/proc/self/maps").read_text().splitlines())
    print(json.dumps(out))


def fresh_process_resumes(T: Timings, args: argparse.Namespace, ckpt: Path, cold_ok: bool) -> None:
    variant = "load"  # in the keys (fp_warm_load_total...), as in RESULTS.md
    for mode in ["warm", "cold"] if cold_ok else ["warm"]:
        for _ in range(args.fresh_process):
            if mode == "cold":
                drop_caches()
            else:
                for f in ckpt.iterdir():  # make sure it is cached
                    raw_readinto(f, memoryview(bytearray(f.stat().st_size)))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(ckpt), "--params", str(args.params)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            for k, v in r.items():
                T.add(f"fp_{mode}_{variant}_{k}", v)


def check_restore_hazards(tmp: Path) -> dict[str, Any]:
    """Does a restored state keep the checkpoint file alive (deleted but still mapped after retention),
    and do in-place writes to the file show through into the restored tensors?  Small model."""
    model, opt, _ = build_state(2e6, seed=1)
    store = CheckpointStore(tmp / "hazards", CheckpointConfig(keep_last=1))
    store.save(1, make_parts(model, opt, 1), blocking=True)
    _checkpoint, loaded = store.load(store.last_committed.path)
    model.load_state_dict(loaded["state"]["model"])
    opt.load_state_dict(loaded["state"]["optimizer"])
    del loaded, _checkpoint
    gc.collect()
    store.save(2, make_parts(model, opt, 2), blocking=True)  # keep_last=1: retention deletes step 1
    pinned = [
        ln.split()[-2]
        for ln in Path("/proc/self/maps").read_text().splitlines()
        if ln.endswith("(deleted)") and str(tmp / "hazards") in ln
    ]
    _checkpoint, loaded = store.load(store.last_committed.path)
    t = loaded["state"]["optimizer"]["state"][0]["exp_avg"]
    before = t.reshape(-1)[0].item()
    f = store.last_committed.path / "state.safetensors"
    with open(f, "r+b") as fh:  # a corruption injected after the (verified) restore
        fh.write(b"\0" * f.stat().st_size)
    after = t.reshape(-1)[0].item()
    opt.state.clear()
    del loaded, _checkpoint, t
    gc.collect()
    return {
        "deleted_files_still_mapped": pinned,
        "inplace_write_visible": before != after,
        "exp_avg0_before": before,
        "exp_avg0_after": after,
    }


# ---------------------------------------------------------------------------- benchmark
class Timings:
    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}
        self.nbytes: dict[str, int] = {}
        self.load: dict[str, float] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float, nbytes: int = 0, cpu: bool = False) -> None:
        """Record one timing; ``cpu``: also the process CPU time of the timed() call just made."""
        self.t.setdefault(name, []).append(seconds)
        if cpu:
            self.cpu.setdefault(name, []).append(LAST_CPU[0])
        if nbytes:
            self.nbytes[name] = nbytes

    def med(self, name: str) -> float:
        return med(self.t[name])

    def best(self, name: str) -> float:
        return min(self.t[name])

    def gbps(self, name: str, best: bool = False) -> float:
        return self.nbytes[name] / (self.best(name) if best else self.med(name)) / GB


def interleave(i: int, items: list[Any]) -> list[Any]:
    """Alternate the order each repeat so drift and warm-up do not favour one side."""
    return items if i % 2 == 0 else items[::-1]


@dataclass
class Bench:
    """What every section measures and records into: the model and optimizer, their flat tensors
    (``nbytes`` in all), the store under test, the timings and the step of the newest save."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    tensors: list[torch.Tensor]
    nbytes: int
    store: CheckpointStore
    timings: Timings
    repeats: int
    step: int = 1

    def retire_all(self) -> None:
        """Delete every checkpoint, so each save writes as much as the one before (timed apart:
        retention's own cost stays out of the save figures)."""
        for _step, p in self.store.step_dirs():
            self.timings.add("retention_rmtree", timed(lambda p=p: shutil.rmtree(p))[0])


def build_bench(args: argparse.Namespace, tmp: Path, res: dict[str, Any]) -> Bench:
    """The model after one AdamW step, its state's tensors and an empty store; the sizes go to ``res``."""
    t_build, (model, opt, width) = timed(lambda: build_state(args.params))
    n_params = sum(p.numel() for p in model.parameters())
    tensors = flat_tensors(make_parts(model, opt, 0))
    nb = sum(t.numel() * t.element_size() for t in tensors)
    res.update(
        params=n_params,
        width=width,
        layers=len(model),
        tensor_count=len(tensors),
        tensor_bytes=nb,
        build_s=t_build,
        repeats=args.repeats,
        torch_threads=torch.get_num_threads(),
    )
    print(
        f"model: {len(model)} x Linear({width},{width}) = {n_params / 1e6:.1f}M params; "
        f"state {len(tensors)} tensors, {nb / GB:.3f} GB; built in {t_build:.1f}s; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    store = CheckpointStore(tmp / "run", CheckpointConfig(keep_last=10**6))
    return Bench(model, opt, tensors, nb, store, Timings(), args.repeats)


def measure_async_stall(b: Bench, res: dict[str, Any]) -> None:
    """Section 1: the steady-state stall of ``save(blocking=False)`` vs ``copy_`` of the same
    tensors into preallocated buffers (the first save allocates the store's buffers: apart)."""
    timings = b.timings
    timings.load["async"] = os.getloadavg()[0]
    print("[1/4] async save stall vs copy_ into preallocated buffers ...", flush=True)
    first_stall = b.store.save(1, make_parts(b.model, b.opt, 1), blocking=False)  # allocates the buffers
    b.store.wait()
    res["first_async"] = dict(stall_s=first_stall, persist_s=b.store.last_persist_s)
    bufs = [torch.empty_like(t) for t in b.tensors]
    copy_all(bufs, b.tensors)  # first touch outside the timing
    for i in range(b.repeats):
        b.retire_all()
        os.sync()
        for kind in interleave(i, ["copy", "save"]):
            if kind == "copy":
                timings.add("copy", timed(copy_all, bufs, b.tensors)[0], b.nbytes, cpu=True)
                continue
            b.step += 1
            dt, p = timed(make_parts, b.model, b.opt, b.step)
            timings.add("parts_build", dt)
            timings.add("stall", timed(b.store.save, b.step, p, False)[1], cpu=True)
            b.store.wait()
            timings.add("persist", b.store.last_persist_s, b.store.last_committed.bytes)
    del bufs
    gc.collect()


def measure_sync_save(b: Bench, tmp: Path, res: dict[str, Any]) -> Path:
    """Section 2: ``save(blocking=True)`` vs one raw write + fsync of the same bytes.  Returns the
    path of the checkpoint saved last, the one the restore and verify sections read."""
    b.timings.load["sync"] = os.getloadavg()[0]
    print("[2/4] sync save vs raw write+fsync ...", flush=True)
    views = raw_views(b.tensors)
    raw_path = tmp / "raw.bin"
    for i in range(b.repeats):
        for kind in interleave(i, ["raw", "save"]):
            b.retire_all()
            raw_path.unlink(missing_ok=True)
            os.sync()
            if kind == "raw":
                b.timings.add("raw_write", timed(raw_write, raw_path, views)[0], b.nbytes, cpu=True)
                continue
            b.step += 1
            p = make_parts(b.model, b.opt, b.step)
            dt, _ = timed(b.store.save, b.step, p, True)
            b.timings.add(f"sync_{kind}", dt, b.store.last_committed.bytes, cpu=True)
    raw_path.unlink(missing_ok=True)
    b.retire_all()
    b.step += 1
    b.store.save(b.step, make_parts(b.model, b.opt, b.step), blocking=True)  # the checkpoint the restore reads
    checkpoint = b.store.last_committed
    res["checkpoint_bytes"] = checkpoint.bytes
    del views
    return checkpoint.path


class CheckpointFiles:
    """The files of the checkpoint the restore and verify sections read, and the raw baseline's
    reads of them: into one preallocated buffer, or into fresh uninitialised ones."""

    def __init__(self, path: Path) -> None:
        self.files = sorted(path.iterdir())
        self.sizes = {f: f.stat().st_size for f in self.files}
        self.data_files = [f for f in self.files if f.name != "manifest.json"]  # what load() reads
        self.data_bytes = sum(self.sizes[f] for f in self.data_files)
        self.pre = torch.empty(max(self.sizes.values()), dtype=torch.uint8)
        self.pre.fill_(0)  # first touch outside the timing
        self.pre_view = memoryview(self.pre.numpy()).cast("B")

    def read_pre(self) -> int:
        return sum(raw_readinto(f, self.pre_view[: self.sizes[f]]) for f in self.data_files)

    def read_fresh(self) -> int:
        """Into uninitialised memory: the allocation floor any fresh restore pays."""
        return sum(
            raw_readinto(f, memoryview(torch.empty(self.sizes[f], dtype=torch.uint8).numpy()).cast("B"))
            for f in self.data_files
        )


def measure_restore(
    b: Bench, path: Path, files: CheckpointFiles, args: argparse.Namespace, res: dict[str, Any]
) -> bool:
    """Section 3: ``load()`` and the rest of a resume vs raw reads of the same files, warm page
    cache and, where ``drop_caches`` is allowed, cold.  Returns whether cold was measured."""
    print("[3/4] restore vs raw read ...", flush=True)
    timings = b.timings
    for p in b.model.parameters():
        p.grad = torch.zeros_like(p)  # so one optimizer step after the restore touches all its state
    cold_ok = not args.no_cold and drop_caches()
    res["cold_available"] = cold_ok
    res["cold_skipped"] = args.no_cold
    for mode in ["warm", "cold"] if cold_ok else ["warm"]:
        timings.load[mode] = os.getloadavg()[0]
        files.read_pre()  # warm: everything cached; cold: dropped again before each measurement
        for i in range(b.repeats):
            for kind in interleave(i, ["raw_pre", "raw_fresh", "load"]):
                gc.collect()
                if mode == "cold":
                    drop_caches()
                if kind == "raw_pre":
                    timings.add(f"{mode}_raw_pre", timed(files.read_pre)[0], files.data_bytes, cpu=True)
                elif kind == "raw_fresh":
                    timings.add(f"{mode}_raw_fresh", timed(files.read_fresh)[0], files.data_bytes, cpu=True)
                else:
                    time_resume(b, path, f"{mode}_{kind}", files.data_bytes)
    for p in b.model.parameters():
        p.grad = None
    gc.collect()
    return cold_ok


def time_resume(b: Bench, path: Path, name: str, data_bytes: int) -> None:
    """One resume in this process: ``load()``, both ``load_state_dict`` and the first optimizer step."""
    timings = b.timings
    dt, (_c, loaded) = timed(b.store.load, path)
    timings.add(name, dt, data_bytes, cpu=True)
    s = loaded["state"]
    lm = timed(b.model.load_state_dict, s["model"])[0]
    lo = timed(b.opt.load_state_dict, s["optimizer"])[0]
    ls = timed(b.opt.step)[0]
    timings.add(f"{name}_lsd_model", lm)
    timings.add(f"{name}_lsd_opt", lo)
    timings.add(f"{name}_first_step", ls)
    timings.add(f"{name}_resume", dt + lm + lo + ls)
    del loaded, s, _c
    b.opt.state.clear()  # drop every reference to the loaded buffer (a mapping would pin the cache)


def measure_verify(b: Bench, path: Path, files: CheckpointFiles) -> None:
    """Section 4: ``verify()`` vs ``xxh3_128`` over the largest file already in memory."""
    b.timings.load["verify"] = os.getloadavg()[0]
    print("[4/4] verify vs xxh3_128 over an in-memory buffer ...", flush=True)
    big = max(files.data_files, key=lambda f: files.sizes[f])
    raw_readinto(big, files.pre_view[: files.sizes[big]])
    hv = files.pre_view[: files.sizes[big]]
    verify_bytes = sum(files.sizes.values())
    files.read_pre()  # warm
    for i in range(b.repeats):
        for kind in interleave(i, ["xxh3", "verify"]):
            if kind == "xxh3":
                b.timings.add("xxh3", timed(lambda: xxhash.xxh3_128(hv).hexdigest())[0], files.sizes[big])
            else:
                b.timings.add("verify", timed(lambda: b.store.verify(path))[0], verify_bytes)


def machine_info() -> dict[str, Any]:
    return dict(
        cpus=os.cpu_count(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        xxhash=xxhash.VERSION,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    res: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    b = build_bench(args, tmp, res)
    measure_async_stall(b, res)
    path = measure_sync_save(b, tmp, res)
    files = CheckpointFiles(path)
    cold_ok = measure_restore(b, path, files, args, res)
    if args.fresh_process:
        print("[3b] resume in a fresh process ...", flush=True)
        fresh_process_resumes(b.timings, args, path, cold_ok)
    measure_verify(b, path, files)
    if args.hazards:
        res["hazards"] = check_restore_hazards(tmp)
    timings = b.timings
    res["t"], res["nbytes"], res["loadavg"], res["cpu"] = timings.t, timings.nbytes, timings.load, timings.cpu
    res["machine"] = machine_info()
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


class Report:
    """The Markdown report of one run's ``res``: its lines, and the cell formats they share."""

    def __init__(self, res: dict[str, Any]) -> None:
        self.res = res
        self.timings = Timings()
        self.timings.t, self.timings.nbytes = res["t"], res["nbytes"]
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def ms(self, name: str) -> str:
        return f"{self.timings.med(name) * 1e3:.0f} / {self.timings.best(name) * 1e3:.0f} ms"

    def bw(self, name: str) -> str:
        return f"{self.timings.gbps(name):.2f} / {self.timings.gbps(name, best=True):.2f} GB/s"

    def row(self, name: str, subj: str, base: str, r_med: float, r_best: float, goal: str, ok: bool | None) -> None:
        mark = "" if ok is None else (" met" if ok else " **missed**")
        self.add(f"| {name} | {subj} | {base} | {r_med:.2f}x ({r_best:.2f}x) | {goal}{mark} |")

    def gbps_row(self, name: str, subj: str, base: str, label: str, goal: str, at_least: float | None) -> None:
        """A row comparing the GB/s of timing ``subj`` with baseline ``base``; ``at_least``: the goal ratio."""
        T = self.timings
        r = T.gbps(subj) / T.gbps(base)
        ok = None if at_least is None else r >= at_least
        self.row(name, self.bw(subj), f"{label}: {self.bw(base)}", r, T.gbps(subj, True) / T.gbps(base, True), goal, ok)

    def header(self) -> None:
        res = self.res
        self.add(
            f"{res['date_utc']}; {res['machine']['cpus']} CPUs, {res['machine']['platform']}, torch "
            f"{res['machine']['torch']} ({res['torch_threads']} intra-op threads), xxhash {res['machine']['xxhash']}"
        )
        self.add(
            f"{res['params'] / 1e6:.1f}M params ({res['layers']} x Linear {res['width']}) + AdamW state = "
            f"{res['tensor_bytes'] / GB:.3f} GB in {res['tensor_count']} tensors; checkpoint "
            f"{res['checkpoint_bytes'] / GB:.3f} GB; {res['repeats']} interleaved repeats; "
            f"1-min load average at each section: " + ", ".join(f"{k} {v:.1f}" for k, v in res["loadavg"].items())
        )
        self.add("")

    def ratio_table(self) -> None:
        """Each figure against its same-run baseline, with the goal met or missed."""
        T = self.timings
        self.add(
            "| measurement | convoy store (median / best) | same-run baseline (median / best) | ratio median (best) "
            "| goal |"
        )
        self.add("|---|---|---|---|---|")
        r = T.med("stall") / T.med("copy")
        self.row(
            "async save stall, steady state",
            self.ms("stall"),
            f"copy_ into preallocated: {self.ms('copy')}",
            r,
            T.best("stall") / T.best("copy"),
            "<= 1.2x",
            r <= 1.2,
        )
        self.gbps_row(
            "sync save (snapshot+write+hash+fsync+manifest+rename)",
            "sync_save",
            "raw_write",
            "raw write+fsync",
            ">= 0.8x",
            0.8,
        )
        for mode in ("warm", "cold"):
            if f"{mode}_load" not in T.t:
                continue
            self.gbps_row(
                f"restore `load()` ({mode} cache)",
                f"{mode}_load",
                f"{mode}_raw_pre",
                "raw readinto preallocated",
                ">= 0.8x",
                0.8,
            )
            self.gbps_row(
                f"restore `load()` ({mode}) vs fresh buffer",
                f"{mode}_load",
                f"{mode}_raw_fresh",
                "raw read into new torch.empty",
                "(info)",
                None,
            )
        self.gbps_row("`verify()` (warm cache)", "verify", "xxh3", "xxh3_128 in memory", "(info)", None)
        self.add("")

    def cpu_table(self) -> None:
        cpu = self.res.get("cpu", {})
        if not cpu:
            return
        self.add("Process CPU seconds (all threads, median) - less sensitive than wall time to other load on the box:")
        self.add("")
        self.add("| operation | CPU s | wall s |")
        self.add("|---|---|---|")
        for name in cpu:
            self.add(f"| {name} | {med(cpu[name]):.2f} | {self.timings.med(name):.2f} |")
        self.add("")

    def save_and_resume_notes(self) -> None:
        T, ms = self.timings, self.ms
        fa = self.res["first_async"]
        self.add(
            f"- first async save (allocates the snapshot buffers): stall {fa['stall_s']:.2f} s, persist "
            f"{fa['persist_s']:.2f} s"
        )
        self.add(
            f"- steady async: background persist {ms('persist')} ({self.bw('persist')}); caller-side parts build "
            f"(state_dict + RNG capture) {T.med('parts_build') * 1e3:.1f} ms"
        )
        if "retention_rmtree" in T.t:
            self.add(
                f"- retention delete (rmtree) of one checkpoint: {ms('retention_rmtree')} (outside the save timings)"
            )
        for mode in ("warm", "cold"):
            n = f"{mode}_load"
            if n in T.t:
                self.add(
                    f"- resume ({mode}, load): load {ms(n)}, model.load_state_dict {ms(n + '_lsd_model')}, "
                    f"optimizer.load_state_dict {ms(n + '_lsd_opt')}, first optimizer.step {ms(n + '_first_step')}; "
                    f"total {ms(n + '_resume')}"
                )

    def fresh_process_table(self) -> None:
        T, ms = self.timings, self.ms
        fp = [n for n in T.t if n.startswith("fp_") and n.endswith("_total")]
        if not fp:
            return
        self.add("")
        self.add("Resume in a fresh process (model built, optimizer without state; median / best):")
        self.add("")
        self.add(
            "| cache, variant | load() | load CPU s | model.load_state_dict | first optimizer.step | total "
            "| RSS after | files still mapped |"
        )
        self.add("|---|---|---|---|---|---|---|---|")
        for n in fp:
            b = n.removesuffix("_total")
            self.add(
                f"| {b.removeprefix('fp_').replace('_', ' ', 1)} | {ms(b + '_load')} | "
                f"{T.med(b + '_load_cpu'):.2f} | {ms(b + '_lsd_model')} | {ms(b + '_first_step')} | {ms(n)} | "
                f"{T.med(b + '_rss_gb'):.2f} GB | {T.med(b + '_files_still_mapped'):.0f} |"
            )

    def hazard_and_cold_notes(self) -> None:
        res = self.res
        hz = res.get("hazards")
        if hz:
            self.add("")
            self.add(
                f"- restore hazards (2M-param check): files deleted by retention but still mapped by the restored "
                f"state: {len(hz['deleted_files_still_mapped'])} {hz['deleted_files_still_mapped']}; in-place "
                f"overwrite of the file after load() visible in the restored optimizer state: "
                f"{hz['inplace_write_visible']} (exp_avg[0] {hz['exp_avg0_before']:.3g} -> {hz['exp_avg0_after']:.3g})"
            )
        if not res["cold_available"]:
            self.add(
                "- cold-cache restore not measured: "
                + ("--no-cold" if res.get("cold_skipped") else "/proc/sys/vm/drop_caches is not writable")
            )


def report(res: dict[str, Any]) -> str:
    out = Report(res)
    out.header()
    out.ratio_table()
    out.cpu_table()
    out.save_and_resume_notes()
    out.fresh_process_table()
    out.hazard_and_cold_notes()
    return "\n".join(out.lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement (median reported)")
    ap.add_argument("--tmp", default=str(ROOT / ".bench-tmp"), help="scratch dir on the same disk as the repo")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    ap.add_argument(
        "--hazards",
        action="store_true",
        help="also check two restore hazards (file pinned after retention, in-place writes showing through)",
    )
    ap.add_argument(
        "--no-cold",
        action="store_true",
        help="skip cold-cache restore (it drops the whole machine's page cache, needs root)",
    )
    ap.add_argument(
        "--fresh-process",
        type=int,
        default=0,
        metavar="N",
        help="also time N resumes in a fresh process (the restarted-worker case)",
    )
    ap.add_argument("--json", help="write all raw timings here")
    ap.add_argument("--child", metavar="CKPT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        resume_child(args.child, args.params)
        return
    res = run(args)
    print()
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
