"""Example task: a Hugging Face ``datasets`` stream (``IterableDataset``) trained and resumed exactly.

The usual shape of a pre-training corpus: an endless stream, sharded over ranks
(``datasets.distributed.split_dataset_by_node``) and over loader workers (``datasets`` does that
itself from ``torch.utils.data.get_worker_info()``), whose position is its ``state_dict()``.
convoy saves every rank's and every loader worker's position with each checkpoint
(:mod:`training.datapipe.streams`).  The data is generated here from the prepared corpus (``convoy
prepare``): windows of ``seq_len + 1`` bytes in a ``datasets.Dataset``, made a stream with
``.to_iterable_dataset(num_shards=...)`` and ``.repeat(None)``; nothing is downloaded.  The
model is the char GPT of :mod:`training.examples.char_gpt`.

``task_args`` (all optional): shards (stream shards, at least ranks x data.num_workers), d_model,
n_head, n_layer, dropout, and shuffle_buffer (> 0 adds ``.shuffle(buffer_size=...)``, which convoy
refuses: the buffer's contents are not in the stream's state, so a resume would train other
samples).  Needs the ``hf`` extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.config import ConfigError, RunConfig, format_validation_error
from training.datapipe.corpus import load_corpus
from training.datapipe.streams import rank_and_world
from training.examples.char_gpt import VOCAB, CharGPT, CharGPTArgs, warmup_cosine
from training.task import TaskParts


class StreamArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shards: int = Field(4, ge=1)
    n_layer: int = Field(1, ge=1, le=48)
    n_head: int = Field(2, ge=1)
    d_model: int = Field(32, ge=8)
    dropout: float = Field(0.1, ge=0, lt=1)
    shuffle_buffer: int = Field(0, ge=0)


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Sample ids and (input, target) byte windows as tensors."""
    windows = torch.tensor([s["window"] for s in samples], dtype=torch.long)
    return {"id": torch.tensor([s["id"] for s in samples]), "x": windows[:, :-1], "y": windows[:, 1:]}


def stream(config: RunConfig, args: StreamArgs) -> Any:
    """This rank's endless shard of the corpus windows."""
    try:
        from datasets import Dataset
        from datasets.distributed import split_dataset_by_node
    except ImportError:
        raise ConfigError("task training.examples.hf_stream needs datasets: pip install -e '.[hf]'") from None
    raw = load_corpus(config.data)
    n_val = int(len(raw) * config.data.val_fraction)
    train, seq = raw[: len(raw) - n_val], config.data.seq_len
    n = (len(train) - 1) // seq
    table = Dataset.from_dict(
        {"id": list(range(n)), "window": [list(train[i * seq : i * seq + seq + 1]) for i in range(n)]}
    )
    ds = table.to_iterable_dataset(num_shards=args.shards).repeat(None)
    if args.shuffle_buffer:
        ds = ds.shuffle(seed=config.train.seed, buffer_size=args.shuffle_buffer)
    rank, world = rank_and_world()
    return split_dataset_by_node(ds, rank=rank, world_size=world)


def build(config: RunConfig, device: torch.device) -> TaskParts:
    try:
        args = StreamArgs(**config.task_args)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "task_args")) from None
    seq = config.data.seq_len
    model = CharGPT(
        CharGPTArgs(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, dropout=args.dropout), seq
    )
    model = model.to(device)
    tc = config.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(tc.warmup_steps, tc.total_steps))

    def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch["x"]).reshape(-1, VOCAB), batch["y"].reshape(-1))

    return TaskParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_data=stream(config, args),
        loss_fn=loss_fn,
        tokens_per_sample=seq,
        collate_fn=collate,
    )
