"""A model the template did not write, transformers' Llama, trained by the template and by hand
on the same batches: `hf` (one device) and `hf_ddp` (2 CPU processes under DDP)."""

from __future__ import annotations

import torch

from benchmarks.against_plain import plain_loop
from benchmarks.launched import launched_summary, plain_ddp, plain_optimizer
from benchmarks.workload import SGD_CONSTANT, compose_config, template_speed
from src.components.data import build_data
from src.components.model_contract import build_model

HF_BATCH_SIZE = 32
# A 2-layer Llama, 128 wide, over 128-token sequences of 256 ids.
HF_WORKLOAD = (
    "model=hf_causal_lm",
    "model.sizes.hidden_size=128",
    "model.sizes.intermediate_size=256",
    "data.seq_len=128",
    "data.vocab_size=256",
    "data.num_samples=8192",
    f"trainer.batch_size={HF_BATCH_SIZE}",
    *SGD_CONSTANT,
    "logger=none",
)


def template_hf(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=HF_WORKLOAD)


def plain_hf(steps: int) -> float:
    """The same Llama (transformers' class, built by the same config) in the hand-written loop,
    SGD at the same rate."""
    cfg = compose_config(*HF_WORKLOAD)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    optimizer = plain_optimizer(cfg.optimizer, model.parameters())
    return plain_loop(steps, model, optimizer, data, HF_BATCH_SIZE, cfg.seed)


def template_hf_ddp(steps: int) -> float:
    return launched_summary(steps, "ddp", workload=HF_WORKLOAD)["samples_per_sec"]


def plain_hf_ddp(steps: int) -> float:
    return plain_ddp(steps, workload=HF_WORKLOAD)
