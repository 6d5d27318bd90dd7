"""Schema of the `plan` settings: what `python plan.py` and `parallel=auto` plan for."""

from __future__ import annotations

from dataclasses import dataclass

from src.config.base import ConfigError
from src.config.trainer import Accelerator


@dataclass
class PlanConfig:
    """What `python plan.py` and `parallel=auto` plan for (`src/planning/planner.py`)."""

    device_memory_gb: float = 80.0
    """Memory of one device (GPU; on CPU, what one process may use)."""
    accelerator: Accelerator = Accelerator.auto
    """The devices planned for: cpu (a row per process), cuda (a row per GPU: dp's output device
    and each pipeline stage apart; no GPU needed to plan), or auto: trainer.accelerator's."""
    strategies: list[str] | None = None
    """Strategies to plan; None: every one (parallel=auto, and plan.py unless an override
    names the parallel option: then that one)."""
    devices: list[int] | None = None
    """Device counts to plan; None: parallel.devices."""
    device_tflops: float = 100.0
    """One device's sustained TFLOP/s, for the predicted step time that ranks the strategies."""
    link_gb_per_s: float = 50.0
    """Bytes per second (GB/s) one device sends to another, for the same."""
    calibrate: bool = False
    """Measure this machine again for the predicted step time (a few seconds), instead of using
    its cached calibration (`src/planning/calibration.py`; GPUs the planner does not see use
    device_tflops and link_gb_per_s)."""
    compare: str | None = None
    """A sweep folder: `plan.py` prints each of its jobs' predicted step time against the
    measured one, instead of planning."""

    def __post_init__(self) -> None:
        """Each setting's range (checked by `typed`, before any tracing)."""
        if self.device_memory_gb <= 0:
            raise ConfigError(f"plan.device_memory_gb must be above 0, got {self.device_memory_gb}")
        if any(count < 1 for count in self.devices or []):
            raise ConfigError(f"plan.devices must all be at least 1, got {list(self.devices)}")
        if self.link_gb_per_s <= 0 or self.device_tflops <= 0:
            raise ConfigError("plan.link_gb_per_s and plan.device_tflops must be above 0")
