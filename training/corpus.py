"""``convoy prepare``: the training corpus, deterministic and with a known entropy floor.

The synthetic source is an order-2 Markov chain over a 32-symbol alphabet whose transition rows
are drawn from a seeded Dirichlet.  Its entropy rate (bits/char) is computed from the chain, so
the example's loss has a known floor: a model can approach it, never beat it.  Alternatively a
local text file is copied in.  The last ``val_fraction`` of the text is the validation split.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from training.config import DataConfig, DataMissing
from training.fsutil import atomic_write_bytes, atomic_write_json

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;\n!"
CORPUS_FILE = "corpus.txt"
META_FILE = "corpus.json"


def synthetic_text(n_chars: int, seed: int) -> tuple[str, float]:
    """Text from a seeded order-2 Markov chain and the chain's entropy rate in bits/char."""
    rng = np.random.default_rng(seed)
    k = len(ALPHABET)
    probs = rng.dirichlet(np.full(k, 0.15), size=k * k)  # row per (prev2, prev1) state
    cum = np.cumsum(probs, axis=1)
    draws = rng.random(n_chars)
    out = np.empty(n_chars, dtype=np.int64)
    a, b = 0, 1
    counts = np.zeros(k * k)
    for i in range(n_chars):
        s = a * k + b
        counts[s] += 1
        c = min(int(np.searchsorted(cum[s], draws[i])), k - 1)
        out[i] = c
        a, b = b, c
    with np.errstate(divide="ignore", invalid="ignore"):
        row_h = -np.nansum(np.where(probs > 0, probs * np.log2(probs), 0.0), axis=1)
    entropy = float((counts / counts.sum()) @ row_h)
    return "".join(ALPHABET[i] for i in out), entropy


def prepare(data: DataConfig, seed: int) -> Path:
    """Write ``<prepared_dir>/corpus.txt`` + ``corpus.json``; idempotent for the same settings."""
    out_dir = Path(data.prepared_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / META_FILE
    want = {"source": data.source, "path": data.path, "chars": data.synthetic_chars, "seed": seed}
    if meta_path.exists() and (out_dir / CORPUS_FILE).exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == want:
            return out_dir / CORPUS_FILE
    if data.source == "file":
        assert data.path is not None
        text = Path(data.path).read_text(errors="replace")
        entropy = None
    else:
        text, entropy = synthetic_text(data.synthetic_chars, seed)
    raw = text.encode()
    atomic_write_bytes(out_dir / CORPUS_FILE, raw)
    atomic_write_json(
        meta_path,
        {
            "settings": want,
            "bytes": len(raw),
            "entropy_floor_bits_per_char": entropy,
            "entropy_floor_nats_per_char": entropy * math.log(2) if entropy else None,
        },
    )
    return out_dir / CORPUS_FILE


def load_corpus(data: DataConfig) -> bytes:
    path = Path(data.prepared_dir) / CORPUS_FILE
    if not path.exists():
        raise DataMissing(f"data file {path} not found; run `convoy prepare` first (or check data.prepared_dir)")
    return path.read_bytes()
