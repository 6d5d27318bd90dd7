"""What a plan is: one device's predicted peak memory by what holds it (`DevicePlan`), and
one strategy's devices, traffic, step time and fit at one device count (`Plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import DictConfig

from src.parallel.shares import Messages

MB = 2**20
# What holds a device's memory, as the plan counts it.
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class DevicePlan:
    """One device's predicted peak, split by what holds the memory (bytes)."""

    label: str
    devices: int = 1  # that this entry stands for (see DeviceShare.devices)
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    # Its work per optimizer step (forward, backward, optimizer), as traced (`work.WorkCounter`)
    flops_by_size: dict[int, float] = field(default_factory=dict)
    """Its matmuls' FLOPs by their `work.size_class`."""
    moved_bytes: float = 0
    """Bytes its other ops read and write."""
    ops: int = 0
    """Aten ops."""
    dtensor_ops: float = 0.0
    """Of those, the optimizer's on DTensors (`DeviceShare.dtensor_parameters`), which pay
    DTensor's dispatch beyond an op's own cost."""
    dtensor_layers: int = 0
    """Layers run forward and backward on DTensors per step (`DeviceShare.dtensor_layers`, in
    each of its passes), each paying DTensor's dispatch of its ops."""
    evaluation: int = 0
    """The peak while it evaluates one batch: its state, and the forward's live activations."""
    host: int = 0
    """Held in host memory instead, outside the peak: the state parallel.offload=cpu moves
    there (its parameters, gradients and optimizer state)."""

    @property
    def peak(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)

    @property
    def flops(self) -> float:
        return sum(self.flops_by_size.values())


@dataclass
class Plan:
    """One strategy at one device count: its devices, its traffic, and whether it fits."""

    strategy: str
    devices: int
    parallel: DictConfig
    device_plans: list[DevicePlan] = field(default_factory=list)
    traffic: dict[str, int] = field(default_factory=dict)
    messages: list[Messages] = field(default_factory=list)
    """Between processes, per step (`CostModel.step_messages`)."""
    step_time_s: float = math.nan
    fits: bool = False
    problem: str | None = None  # why it cannot run (the ConfigError it raises)

    @property
    def peak(self) -> int:
        return max((device.peak for device in self.device_plans), default=0)

    @property
    def eval_peak(self) -> int:
        return max((device.evaluation for device in self.device_plans), default=0)

    @property
    def needed(self) -> int:
        """The memory a run needs of its fullest device: training's or evaluation's peak."""
        return max(self.peak, self.eval_peak)
