"""Schemas of `conf/optimizer/`: the optimizer, its learning-rate schedule and parameter
groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from src.config.base import choices

# The schedules the template computes; `schedule` may name a torch.optim.lr_scheduler class too.
SCHEDULES = ("constant", "linear", "cosine", "wsd")
DecayShape = choices("DecayShape", "linear cosine 1-sqrt", __name__)


@dataclass
class OptimizerConfig:
    """`_target_` builds the optimizer (`_partial_`: given the model's parameter groups later)
    from every setting but `OWN_KEYS`: the name, the learning-rate schedule's and the groups'.
    Any optimizer class (torch.optim's or one's own) takes `params` first, as torch.optim's do;
    `optimizer._target_=torch.optim.Adagrad` on the command line leaves out the option's own
    settings that it does not take (sgd's `momentum`)."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    decay_1d: bool = True
    """Weight decay on tensors of fewer than 2 dimensions too (biases, norms' scales and
    shifts); false gives them a parameter group of their own without decay, as GPT-2 and nanoGPT
    train."""
    block_matrices_apart: bool = False
    """The 2-D weight matrices of the model's blocks in a parameter group of their own, first,
    marked `block_matrices` (optimizer=muon's: Muon steps them, AdamW the rest); a model whose
    blocks hold none is refused."""
    name: str = MISSING
    """Labels the optimizer: a checkpoint resumes only under the one it was trained with."""
    schedule: str = "cosine"
    """After a linear warm-up over `warmup_steps`: constant; linear or cosine, a decay to
    min_lr_ratio * lr over `schedule_steps`; or wsd (warm-up, stable, decay): lr until the last
    `decay_fraction` of `schedule_steps`, then a `decay_shape` decay to min_lr_ratio * lr. Or a
    learning-rate scheduler class by its path (torch.optim.lr_scheduler.StepLR, or one's own
    LRScheduler) with `schedule_args`: its curve over the steps is the whole schedule (its own
    warm-up if any; `warmup_steps`, `min_lr_ratio` and `schedule_steps` are the template's
    schedules')."""
    schedule_args: dict[str, Any] = field(default_factory=dict)
    """The scheduler class's arguments but the optimizer
    (`+optimizer.schedule_args.step_size=10`)."""
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    schedule_steps: int | None = None
    """Steps the schedule decays over (later steps keep its final rate); None: trainer.max_steps.
    Resuming with another trainer.max_steps needs it set, to keep or to stretch the schedule."""
    decay_fraction: float = 0.2
    """wsd: the fraction of `schedule_steps` that the decay takes, in (0, 1]; it starts after
    the warm-up at the earliest."""
    decay_shape: DecayShape = DecayShape.linear
    """wsd's decay: linear, cosine, or 1-sqrt (1 - sqrt of the decay's progress: Hägele et al.
    2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations")."""


OWN_KEYS = (
    "name",
    "decay_1d",
    "block_matrices_apart",
    "schedule",
    "schedule_args",
    "warmup_steps",
    "min_lr_ratio",
    "schedule_steps",
    "decay_fraction",
    "decay_shape",
)


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


@dataclass
class MuonConfig(OptimizerConfig):
    """torch.optim.Muon over the 2-D weight matrices of the model's blocks, AdamW over the rest
    (embeddings, head, norms, biases), as modded-nanogpt and Kimi split them; one learning rate
    for both (the schedule sets it on every group), Muon's scaled per matrix by `adjust_lr_fn`.
    Under fsdp and tp each matrix is orthogonalised whole (`src/components/muon.py`)."""

    _target_: str = "src.components.muon.muon"
    weight_decay: float = 0.01
    decay_1d: bool = False
    block_matrices_apart: bool = True
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalise each matrix's update."""
    adjust_lr_fn: str = "match_rms_adamw"
    """Muon's lr per matrix: match_rms_adamw (Kimi's: 0.2 * sqrt(max(rows, columns)), an update
    of AdamW's RMS, so that AdamW's lr and weight decay carry over), original (Keller Jordan's:
    sqrt(max(1, rows / columns)), with lr near 0.02) or spectral_unclamped."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's, and `eps`: for the parameters that are not the blocks' matrices."""
    eps: float = 1e-8
    name: str = "muon"
