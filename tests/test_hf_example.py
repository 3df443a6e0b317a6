"""The Hugging Face example (training/examples/hf_causal_lm.py) trains under convoy, is killed
with SIGKILL inside a gradient-accumulation window and resumes to the same bits as an
uninterrupted run (random-step kills are covered on the plain dict task, tests/test_real_models.py).
Needs the ``hf`` extra (``make install`` has it)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")

from tests.engine_util import (  # noqa: E402 - after the skip
    final_digest,
    kill_group,
    make_run,
    run_worker,
    start_worker,
    wait_for_step,
)
from tests.torchrun_util import finish, losses, torchrun  # noqa: E402
from training.events import read_events  # noqa: E402
from training.tracking.metrics import metric_rows  # noqa: E402

TOTAL = 12
HF = [
    "task=training.examples.hf_causal_lm:build",
    "task_args={}",
    f"train.total_steps={TOTAL}",
    f"train.chunk_steps={TOTAL}",
    "train.batch_size=4",
    "train.grad_accum_steps=2",
    "train.warmup_steps=3",
    "train.eval_every=4",
    "train.eval_samples=8",
    "data.seq_len=32",
    "checkpoint.every_steps=3",
]


@pytest.mark.slow
def test_hf_causal_lm_killed_resumes_bitwise(tmp_path: Path) -> None:
    ref_dir = make_run(tmp_path, "reference", HF)
    run_dir = make_run(tmp_path, "killed", HF)
    offline = {"HF_HUB_OFFLINE": "1"}
    ref = start_worker(ref_dir, TOTAL, offline)  # uninterrupted, alongside the one to kill
    flag = tmp_path / "in-window"
    p = start_worker(run_dir, TOTAL, {**offline, "CONVOY_FAULTS": f"micro_stall=5:2:60:{flag}"})
    deadline = time.time() + 180
    while not flag.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert flag.exists(), p.communicate()[0]  # micro-batch 1 of step 5 done, 2 and the update not
    kill_group(p)
    p.wait()
    code, out = run_worker(run_dir, TOTAL, offline)
    assert code == 0, out
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    # Step 5's window was redone from a whole optimizer step before it: the disk checkpoint of 3, or
    # a memory-tier snapshot (the auto interval follows the load; a loaded machine may not have
    # committed 3's async save at the kill).
    assert 0 < read_events(run_dir, "resumed")[0]["step"] <= 4
    assert final_digest(run_dir) == final_digest(ref_dir)

    rows = metric_rows(ref_dir)
    assert abs(rows[0][1]["loss"] - math.log(256)) < 0.1  # random init, byte vocabulary
    assert [s for s, m in rows if "val_loss" in m] == [4, 8, 12]
    assert "lr/group-1" in rows[0][1]  # weight-decay groups


def test_llama_family_builds_offline_with_ln_vocab_loss(tmp_path: Path) -> None:
    """``task_args.family: llama`` builds from its config in this process (no download) and its
    first loss on a dict batch is about ln(256)."""
    import torch

    from training.config import load_config
    from training.datapipe.corpus import prepare
    from training.state import seed_everything
    from training.task import build_task

    cfg = load_config(
        None, [*HF, "task_args.family=llama", f"data.prepared_dir={tmp_path / 'data'}", "data.synthetic_chars=20000"]
    )
    prepare(cfg.data, cfg.train.seed)
    seed_everything(cfg.train.seed)
    parts = build_task(cfg, torch.device("cpu"))
    assert type(parts.model).__name__ == "LlamaForCausalLM"
    assert len(parts.optimizer.param_groups) == 2 and parts.optimizer.param_groups[1]["weight_decay"] == 0.0
    batch = torch.utils.data.default_collate([parts.train_data[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    with torch.no_grad():
        assert abs(float(parts.loss_fn(parts.model, batch)) - math.log(256)) < 0.1


@pytest.mark.slow
def test_fsdp_llama_with_activation_checkpointing_killed_resumes_bitwise(tmp_path: Path) -> None:
    """``params-fsdp.yaml``'s model, small: a Llama sharded per decoder layer by convoy (FSDP2, 2
    CPU ranks), activation checkpointing per layer, gradient accumulation; every rank SIGKILLed
    at step 7 and resumed ends bitwise where an uninterrupted run ends."""
    import json

    import yaml

    shipped = yaml.safe_load((Path(__file__).parents[1] / "params-fsdp.yaml").read_text())
    assert shipped["train"]["parallel"] == "fsdp" and shipped["task_args"]["activation_checkpointing"] is True
    args = {**shipped["task_args"], "n_layer": 2, "d_model": 64}
    llama = [*HF, f"task_args={json.dumps(args)}", "train.ranks=2"]
    llama += ["train.parallel=fsdp", "train.eval_every=0"]
    ref = make_run(tmp_path, "ref", llama)
    finish(torchrun(ref, TOTAL, 2))
    run = make_run(tmp_path, "killed", llama)
    p = torchrun(run, TOTAL, 2)
    wait_for_step(run, p, 7, timeout=300)
    kill_group(p)
    p.wait()
    out = finish(torchrun(run, TOTAL, 2))
    assert "resumed from step" in out
    assert losses(run) == losses(ref) and final_digest(run) == final_digest(ref)
