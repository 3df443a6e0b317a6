"""Cost of per-sample seeding (invariant 9) on a CNN-style pipeline, against the same loader without it.

    python bench/loader_overhead.py [--side 32] [--batch 64] [--batches 40] [--repeats 20]
        [--workers 0 2] [--pipelines torch+numpy torch torch-declared] [--steps loader cnn]
    valgrind --tool=callgrind --dump-before=math_lgamma \
        python bench/loader_overhead.py --work --pipelines torch+numpy torch   # instructions

The dataset is what a vision task does in ``__getitem__``: a uint8 image to float, a random flip
and a random crop (padding 4) from torch's global RNG, and a brightness jitter.  Both sides read
the same samples in the same order (convoy's ``ResumableBatchSampler``):

* ``baseline`` — a plain ``DataLoader`` over the dataset with the sampler's index batches;
* ``seeded``   — ``training.datapipe.data.make_loader``: each sample fetched under its seed (its global
  position): torch's CPU generator seeded before every sample, numpy's and python's when the
  sample draws from them (``training/datapipe/sample_rng.py``), and, in the training process, the
  trainer's generators saved and restored around each batch.

Three pipelines: ``torch+numpy`` draws flip/crop from torch and the brightness from numpy, with
the default ``sample_rngs`` (all three); ``torch`` draws everything from torch (torchvision-style
transforms), with the default ``sample_rngs``; ``torch-declared`` is that pipeline declaring
``sample_rngs=("torch",)``.

Blocks alternate (machine-load drifts hit both sides alike); printed: median samples/s per side
and the ratio seeded / baseline per worker count (goal >= 0.97, i.e. at most 3 % slower), and the
CPU time per sample of the main process and its loader workers on each side over all blocks with
their ratio baseline / seeded (on a loaded machine the wall-clock ratio swings by +-10 %; the CPU
ratio is what the seeding costs, and what the throughput ratio is on an idle one), then,
with ``--steps cnn``, the same with a small CNN's forward/backward consuming each batch (what a
training run sees: with loader workers the fetch overlaps the step), and the per-sample cost of
the seeding itself.  A figure, not an assertion.
"""

from __future__ import annotations

import argparse
import itertools
import math
import pickle
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.datapipe.data import Cursor, LoaderSpec, ResumableBatchSampler, make_loader, sample_seed  # noqa: E402
from training.datapipe.sample_rng import HOST_RNGS, seed_host_rngs  # noqa: E402

#: pipeline name -> (whether the brightness is drawn from torch instead of numpy, sample_rngs)
PIPELINES: dict[str, tuple[bool, tuple[str, ...]]] = {
    "torch+numpy": (False, HOST_RNGS),
    "torch": (True, HOST_RNGS),
    "torch-declared": (True, ("torch",)),
}


class Images(Dataset):
    """CIFAR-shaped images with flip, crop and brightness drawn per fetch; ``torch_only``: the
    brightness from torch too (a torchvision-style pipeline)."""

    def __init__(self, n: int, side: int, torch_only: bool = False, rngs: tuple[str, ...] = HOST_RNGS) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = (torch.rand(n, 3, side, side, generator=g) * 255).to(torch.uint8)
        self.side, self.torch_only, self.rngs = side, torch_only, rngs

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.images[i].float() / 255
        if torch.rand(1).item() < 0.5:
            img = img.flip(-1)
        top, left = torch.randint(0, 9, (2,)).tolist()
        img = F.pad(img, (4, 4, 4, 4))[:, top : top + self.side, left : left + self.side]
        jitter = torch.rand(1).item() if self.torch_only else np.random.uniform(0, 1)
        return img * float(1 + 0.2 * (2 * jitter - 1)), i % 10


def loaders(ds: Images, batch: int, workers: int) -> dict[str, DataLoader]:
    spec = LoaderSpec(batch, seed=1, start=Cursor())
    plain = DataLoader(
        ds,
        batch_sampler=ResumableBatchSampler(len(ds), spec),
        num_workers=workers,
        generator=torch.Generator().manual_seed(1),
        prefetch_factor=2 if workers else None,
    )
    return {"baseline": plain, "seeded": make_loader(ds, spec, num_workers=workers, sample_rngs=ds.rngs)}


def cnn() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(256, 10),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


class Block(NamedTuple):
    """One timed block: samples, wall seconds, and CPU seconds of the main process and its
    loader workers together (what the fetch costs, whatever else the machine runs)."""

    samples: int
    wall_s: float
    cpu_s: float


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of this process (all threads) and of ``pids`` (Linux schedstat: nanoseconds)."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as f:  # the worker's main thread: it runs the fetch
            total += int(f.read().split()[0]) / 1e9
    return total


def block(loader: DataLoader, batches: int, step: Any) -> Block:
    """``batches`` batches timed (the loader's start-up and first batch left out)."""
    it = iter(loader)
    next(it)
    pids = [w.pid for w in getattr(it, "_workers", [])]
    n, t0, c0 = 0, time.perf_counter(), cpu_seconds(pids)
    for x, y in itertools.islice(it, batches):
        if step is not None:
            step(x, y)
        n += len(y)
    return Block(n, time.perf_counter() - t0, cpu_seconds(pids) - c0)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def measure(args: argparse.Namespace, workers: int, with_step: bool, pipeline: str) -> dict[str, list[Block]]:
    ds = Images(args.batch * 50, args.side, *PIPELINES[pipeline])
    out: dict[str, list[Block]] = {"baseline": [], "seeded": []}
    model, opt = cnn()
    step = train_step(model, opt) if with_step else None
    for r in range(args.repeats):
        pair = loaders(ds, args.batch, workers)
        for name in ("baseline", "seeded") if r % 2 == 0 else ("seeded", "baseline"):
            out[name].append(block(pair[name], args.batches, step))
    return out


def worker_work(args: argparse.Namespace) -> None:
    """What a loader worker does for 4 batches (unpickle the batch, fetch, collate, pickle), once
    per pipeline x {plain, default, declared}, each region between two ``math.lgamma`` calls: run
    under ``valgrind --tool=callgrind --dump-before=math_lgamma`` for instruction counts, which
    the machine's load does not move (a dump per region, in the order printed)."""
    from training.datapipe.sample_rng import SeededSamples

    sampler = ResumableBatchSampler(args.batch * 50, LoaderSpec(args.batch, seed=1, start=Cursor()))
    batches = list(itertools.islice(sampler.keyed(), 8))
    regions = []
    for pipeline in args.pipelines:
        ds = Images(args.batch * 50, args.side, PIPELINES[pipeline][0])
        declared = ("torch",) if PIPELINES[pipeline][0] else ("torch", "numpy")
        for name, rngs in (("plain", None), ("default", HOST_RNGS), ("declared", declared)):
            seeded = SeededSamples(ds, rngs) if rngs else None

            def work(j: int, ds: Images = ds, seeded: SeededSamples | None = seeded) -> None:
                b = pickle.loads(pickle.dumps(batches[j]))
                samples = seeded._fetch(b.indices, b.seeds()) if seeded else [ds[i] for i in b.indices]
                pickle.dumps(default_collate(samples))

            regions.append((f"{pipeline} {name}", work))
    for _, work in regions:  # warm up (and let the first samples promote what they draw from)
        work(4), work(5)
    print("regions:", [name for name, _ in regions], flush=True)
    for _, work in regions:
        math.lgamma(2.0)
        for j in range(4):
            work(j)
    math.lgamma(2.0)


def seeding_cost_us(rngs: tuple[str, ...]) -> float:
    n = 20000
    return timeit.timeit(lambda: seed_host_rngs(sample_seed(1, 2, 12345), rngs), number=n) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--pipelines", nargs="+", choices=list(PIPELINES), default=list(PIPELINES))
    ap.add_argument("--steps", nargs="+", choices=["loader", "cnn"], default=["loader", "cnn"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", action="store_true", help="the instruction-count regions (worker_work)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.work:
        worker_work(args)
        return
    print(f"images 3x{args.side}x{args.side}, batch {args.batch}, {args.batches} batches x {args.repeats} blocks")
    for pipeline, step, workers in itertools.product(args.pipelines, args.steps, args.workers):
        m = measure(args, workers, step == "cnn", pipeline)
        base, seeded = (statistics.median(b.samples / b.wall_s for b in m[k]) for k in ("baseline", "seeded"))
        # CPU per sample over all blocks: the fetch's cost, which the machine's load hardly moves.
        cpu = {k: sum(b.cpu_s for b in m[k]) / sum(b.samples for b in m[k]) * 1e6 for k in m}
        label = f"{pipeline}, {'+ CNN step' if step == 'cnn' else 'loader only'}, w{workers}"
        verdict = "met" if seeded / base >= 0.97 else "NOT met"
        print(
            f"{label:36s} baseline {base:8.0f} samples/s  seeded {seeded:8.0f} samples/s  "
            f"ratio {seeded / base:.3f} (goal >= 0.97: {verdict})  "
            f"cpu/sample {cpu['baseline']:.1f} / {cpu['seeded']:.1f} us = {cpu['baseline'] / cpu['seeded']:.3f}",
            flush=True,
        )
    for rngs in (HOST_RNGS, ("torch", "numpy"), ("torch",)):
        print(f"seeding one sample eagerly (sample_seed + {'/'.join(rngs)} seeds): {seeding_cost_us(rngs):.1f} us")


if __name__ == "__main__":
    main()
