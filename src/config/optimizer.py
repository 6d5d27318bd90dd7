"""Schemas of `conf/optimizer/`: the optimizer, its learning-rate schedule and parameter
groups."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from src.config.base import choices

Schedule = choices("Schedule", "constant cosine", __name__)


@dataclass
class OptimizerConfig:
    """`_target_` builds the optimizer (`_partial_`: given the model's parameter groups later)
    from every setting but `OWN_KEYS`: the name, the learning-rate schedule's and the groups'."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    decay_1d: bool = True
    """Weight decay on tensors of fewer than 2 dimensions too (biases, norms' scales and
    shifts); false gives them a parameter group of their own without decay, as GPT-2 and nanoGPT
    train."""
    name: str = MISSING
    """Labels the optimizer: a checkpoint resumes only under the one it was trained with."""
    schedule: Schedule = Schedule.cosine
    """constant, or cosine (linear warm-up, then cosine decay to min_lr_ratio * lr)."""
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    schedule_steps: int | None = None
    """Steps the cosine decays over (later steps keep its final rate); None: trainer.max_steps.
    Resuming with another trainer.max_steps needs it set, to keep or to stretch the schedule."""


OWN_KEYS = ("name", "decay_1d", "schedule", "warmup_steps", "min_lr_ratio", "schedule_steps")


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    name: str = "sgd"


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "src.components.optimizer.adamw"
    weight_decay: float = 0.01
    decay_1d: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    name: str = "adamw"
