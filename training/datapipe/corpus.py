"""``convoy prepare``: the training corpus, deterministic and with a known entropy floor.

The synthetic source is an order-2 Markov chain over a 32-symbol alphabet built in two layers:
a sparse "which letter follows which" table ``P1(c | b)`` (rows from a seeded Dirichlet with
concentration :data:`BIGRAM_ALPHA`), and per pair ``(a, b)`` a row ``P(c | a, b)`` drawn around
``P1(. | b)`` (Dirichlet with mean ``P1(. | b)`` and concentration :data:`PAIR_KAPPA`).

Why two layers: in a chain whose pair rows are drawn independently, the previous character
alone says almost nothing (averaged over the character before it, every row is near uniform),
so a small model sees no signal until it attends to both at once and its loss sat at the
unigram entropy (ln 32) for the whole demo.  Here the previous character explains most of the
next one and the pair refines it, so the loss falls in stages: the unigram, then the bigram,
then towards the floor.

The floor is the chain's entropy rate, computed exactly from its definition: the stationary
distribution of the pair chain (power iteration) weighting each pair row's entropy.  A model
can approach it, never beat it.  Alternatively a local text file is copied in (no floor).  The
last ``val_fraction`` of the text is the validation split.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from training.config import SYNTHETIC_GENERATOR, DataConfig, DataMissing
from training.fsutil import atomic_write_bytes, atomic_write_json

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;\n!"
CORPUS_FILE = "corpus.txt"
META_FILE = "corpus.json"
#: Bumped when the generator changes: ``convoy prepare`` rewrites a corpus of an older one, and
#: the config fingerprint of a synthetic run includes it.
GENERATOR = SYNTHETIC_GENERATOR
#: Sparsity of the bigram rows (smaller: fewer likely successors per character).
BIGRAM_ALPHA = 0.15
#: How closely each pair row follows its bigram row (smaller: the pair matters more).
PAIR_KAPPA = 4.0
#: Added to every pair row's Dirichlet concentration: no successor is left out entirely.
PAIR_EPS = 1e-3
#: Weight of a uniform row mixed into every pair row, so every transition has probability > 0:
#: the pair chain is irreducible and aperiodic, its stationary distribution unique.
UNIFORM_MIX = 1e-4


def chain(seed: int) -> np.ndarray:
    """``P[a * k + b, c]`` = probability of ``c`` after ``a b`` (rows sum to 1)."""
    rng = np.random.default_rng(seed)
    k = len(ALPHABET)
    bigram = rng.dirichlet(np.full(k, BIGRAM_ALPHA), size=k)
    pairs = np.stack([rng.dirichlet(PAIR_KAPPA * bigram[s % k] + PAIR_EPS) for s in range(k * k)])
    return (1 - UNIFORM_MIX) * pairs + UNIFORM_MIX / k


def entropy_rate(probs: np.ndarray, tol: float = 1e-13, max_iter: int = 100_000) -> float:
    """Entropy rate (nats/char) of the order-2 chain ``probs``: sum over pair states of the
    stationary probability times the row's entropy.  The stationary distribution comes from
    power iteration on the pair chain ``(a, b) -> (b, c)``."""
    k = probs.shape[1]
    trans = probs.reshape(k, k, k)  # [a, b, c]
    pi = np.full((k, k), 1.0 / (k * k))  # [a, b]
    for _ in range(max_iter):
        nxt = np.einsum("ab,abc->bc", pi, trans)
        if np.abs(nxt - pi).sum() < tol:
            pi = nxt
            break
        pi = nxt
    row_h = -(probs * np.log(probs)).sum(axis=1)
    return float(pi.reshape(-1) @ row_h)


def synthetic_text(n_chars: int, seed: int) -> tuple[str, float]:
    """Text drawn from the seeded chain and the chain's entropy rate in nats/char."""
    probs = chain(seed)
    k = len(ALPHABET)
    cum = np.cumsum(probs, axis=1)
    draws = np.random.default_rng([seed, 1]).random(n_chars)
    out = np.empty(n_chars, dtype=np.int64)
    a, b = 0, 1
    for i in range(n_chars):
        c = min(int(np.searchsorted(cum[a * k + b], draws[i])), k - 1)
        out[i] = c
        a, b = b, c
    return "".join(ALPHABET[i] for i in out), entropy_rate(probs)


def prepare(data: DataConfig, seed: int) -> Path:
    """Write ``<prepared_dir>/corpus.txt`` + ``corpus.json``; idempotent for the same settings."""
    out_dir = Path(data.prepared_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / META_FILE
    want = {"source": data.source, "path": data.path, "chars": data.synthetic_chars, "seed": seed}
    if data.source == "synthetic":
        want["generator"] = GENERATOR
    if meta_path.exists() and (out_dir / CORPUS_FILE).exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == want:
            return out_dir / CORPUS_FILE
    if data.source == "file":
        assert data.path is not None
        text = Path(data.path).read_text(errors="replace")
        floor = None
    else:
        text, floor = synthetic_text(data.synthetic_chars, seed)
    raw = text.encode()
    atomic_write_bytes(out_dir / CORPUS_FILE, raw)
    atomic_write_json(
        meta_path,
        {
            "settings": want,
            "bytes": len(raw),
            "entropy_floor_nats_per_char": floor,
            "entropy_floor_bits_per_char": floor / math.log(2) if floor is not None else None,
        },
    )
    return out_dir / CORPUS_FILE


#: The built-in tasks whose loss is nats per character of the prepared corpus: the floor is theirs.
CORPUS_TASKS = ("training.examples.char_gpt:build", "training.examples.hf_causal_lm:build")


def entropy_floor(data: DataConfig, task: str) -> float | None:
    """The prepared corpus's entropy floor in nats/char for a ``task`` that trains on it (None: a
    task of another loss, whatever its working directory holds; not prepared here; or a file
    corpus, whose floor nobody knows)."""
    if task not in CORPUS_TASKS:
        return None
    try:
        meta = json.loads((Path(data.prepared_dir) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    floor = meta.get("entropy_floor_nats_per_char")
    return float(floor) if floor is not None else None


def load_corpus(data: DataConfig) -> bytes:
    path = Path(data.prepared_dir) / CORPUS_FILE
    if not path.exists():
        raise DataMissing(f"data file {path} not found; run `convoy prepare` first (or check data.prepared_dir)")
    return path.read_bytes()
