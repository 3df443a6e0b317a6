"""Example task: a Hugging Face transformers causal LM (GPT-2 or Llama family) under convoy.

What a real HF training script brings, plugged into :class:`training.task.TaskParts`:
the model built ``from_config`` (random init: nothing is downloaded, no weights, no tokenizer;
``HF_HUB_OFFLINE=1`` is set before transformers is imported), dict batches
``{"input_ids", "attention_mask", "labels"}`` (the model shifts the labels itself), AdamW with the
usual weight-decay groups (no decay on biases, norms and embeddings), a warmup + cosine schedule
(``transformers.get_cosine_schedule_with_warmup``) and, from the config, gradient accumulation
(``train.grad_accum_steps``) and in-loop validation (``train.eval_every``).

Tokens are bytes of the prepared corpus (``convoy prepare``), so the vocabulary is 256 and the
first loss is about ln(256) ≈ 5.55 nats.  Needs the ``hf`` extra: ``pip install -e '.[hf]'``.
``params-hf.yaml`` runs it: ``convoy train params-hf.yaml``.

``task_args`` (all optional): family (gpt2 | llama), n_layer, n_head, d_model, dropout,
activation_checkpointing.  With ``train.parallel: fsdp`` convoy shards each decoder layer, then
the root (``TaskParts.shard_units``); ``params-fsdp.yaml`` trains a Llama that way on 2 ranks.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.utils.data import Dataset

from training.config import ConfigError, RunConfig, format_validation_error
from training.datapipe.corpus import load_corpus
from training.task import TaskParts

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 256  # byte-level ids


class HFArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    family: Literal["gpt2", "llama"] = "gpt2"
    n_layer: int = Field(2, ge=1, le=48)
    n_head: int = Field(4, ge=1)
    d_model: int = Field(64, ge=8)
    #: GPT-2's residual, embedding and attention dropout (Llama: attention dropout).
    dropout: float = Field(0.1, ge=0, lt=1)
    #: Recompute each decoder layer's activations in the backward instead of keeping them
    #: (transformers' gradient checkpointing, non-reentrant): less memory, ~30 % more compute.
    activation_checkpointing: bool = False


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len`` bytes as HF dicts; labels = inputs (the model shifts)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i * self.seq_len : (i + 1) * self.seq_len].long()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def model_config(args: HFArgs, seq_len: int) -> Any:
    """The transformers config of a small model of the chosen family (no hub access)."""
    if args.d_model % args.n_head:
        raise ConfigError(f"task_args.d_model = {args.d_model} is not divisible by n_head = {args.n_head}")
    from transformers import GPT2Config, LlamaConfig

    if args.family == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_positions=seq_len,
            n_embd=args.d_model,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=args.dropout,
            embd_pdrop=args.dropout,
            attn_pdrop=args.dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.d_model,
        intermediate_size=4 * args.d_model,
        num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head,
        num_key_value_heads=args.n_head,
        max_position_embeddings=seq_len,
        attention_dropout=args.dropout,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups as HF's Trainer makes them: decay on weight matrices only."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        lowered = name.lower()
        if p.dim() < 2 or "norm" in lowered or "ln_" in lowered or "bias" in lowered or "wpe" in lowered:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build(config: RunConfig, device: torch.device) -> TaskParts:
    try:
        args = HFArgs(**config.task_args)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "task_args")) from None
    try:
        from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup
    except ImportError:
        raise ConfigError("task training.examples.hf_causal_lm needs transformers: pip install -e '.[hf]'") from None
    seq = config.data.seq_len
    hf_config = model_config(args, seq)
    raw = load_corpus(config.data)
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(tokens) * config.data.val_fraction)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").to(device)
    model.loss_type = "ForCausalLM"  # named, so transformers does not warn about guessing it
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tc = config.train
    optimizer = torch.optim.AdamW(decay_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, tc.warmup_steps, tc.total_steps)

    def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(**batch).loss

    return TaskParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_data=ByteWindows(tokens[: len(tokens) - n_val], seq),
        val_data=ByteWindows(tokens[len(tokens) - n_val :], seq),
        loss_fn=loss_fn,
        tokens_per_sample=seq,
        shard_units=decoder_layers,  # train.parallel: fsdp shards each decoder layer, then the root
    )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (``GPT2Block``, ``LlamaDecoderLayer``...): the classes
    transformers itself never splits across devices (``_no_split_modules``), FSDP2's natural units."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]
