"""What a strategy asks of the machine: which device type a run gets, the cores a process may
use, and its resident memory's peak."""

from __future__ import annotations

import os
import resource
import sys

import torch

from src.config.base import ConfigError
from src.config.trainer import Accelerator


def resolve_device_type(accelerator: Accelerator) -> str:
    """'auto' becomes cuda when a GPU is visible, else cpu."""
    if accelerator == Accelerator.cuda and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=cuda but no GPU is visible; use auto or cpu")
    if accelerator == Accelerator.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return Accelerator(accelerator).value


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def process_peak_memory_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)
