"""Built-in example task: a small character-level GPT with dropout on the prepared corpus.

Dropout makes the RNG part of the trajectory, so this task actually exercises exact resume.
``task_args`` (all optional): n_layer, n_head, d_model, dropout, noise (test-only: adds unseeded
noise to the loss to demonstrate non-determinism detection).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from training.config import ConfigError, RunConfig, format_validation_error
from training.datapipe.corpus import load_corpus
from training.datapipe.data import TokenWindows
from training.task import TaskParts

VOCAB = 256  # bytes


class CharGPTArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_layer: int = Field(2, ge=1, le=48)
    n_head: int = Field(4, ge=1)
    d_model: int = Field(64, ge=8)
    dropout: float = Field(0.1, ge=0, lt=1)
    #: Test-only: add unseeded noise to the loss (a deliberately non-deterministic task).
    noise: bool = False


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, args: CharGPTArgs, seq_len: int) -> None:
        super().__init__()
        d = args.d_model
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(seq_len, d)
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(Block(d, args.n_head, args.dropout) for _ in range(args.n_layer))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: the checkpoint must cope with shared tensors
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style N(0, 0.02) for linear and embedding weights, zero biases.

    Why: PyTorch's default embedding init is N(0, 1), and with the head tied to the embedding the
    first logits have a standard deviation of about sqrt(d_model), so the first loss was ~38
    instead of ln(256) ≈ 5.5 and every loss chart was flattened by it."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def warmup_cosine(warmup: int, total: int):
    """LR multiplier as a pure function of the global step (so resume needs only the step)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build(config: RunConfig, device: torch.device) -> TaskParts:
    try:
        args = CharGPTArgs(**config.task_args)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "task_args")) from None
    if args.d_model % args.n_head:
        raise ConfigError(f"task_args.d_model = {args.d_model} is not divisible by n_head = {args.n_head}")
    raw = load_corpus(config.data)
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(tokens) * config.data.val_fraction)
    train_tokens, val_tokens = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    seq = config.data.seq_len
    model = CharGPT(args, seq).to(device)
    tc = config.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(tc.warmup_steps, tc.total_steps))

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = m(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if args.noise:  # deliberately unseeded: differs on every process start
            # Uniform in [0, 1) from 32 random bits: at a loss near 5 a float32 tells ~2 million
            # such values apart, so a replay repeats a step's noise about once in 2 million steps.
            # (1e-3 times 16 bits gave ~2000 distinct float32 values: CI once saw step 1 repeat.)
            # A constant added to the loss leaves the gradients, hence the trajectory, alone.
            loss = loss + int.from_bytes(os.urandom(4), "little") / 2**32
        return loss

    return TaskParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_data=TokenWindows(train_tokens, seq),
        val_data=TokenWindows(val_tokens, seq),
        loss_fn=loss_fn,
        tokens_per_sample=seq,
        shard_units=(Block,),  # train.parallel: fsdp shards each block, then the root (embeddings, head)
    )
