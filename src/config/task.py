"""Schemas of `conf/task/`. A task turns (outputs, targets) into sums: the loss sum, metric
sums, and the count to divide by (`src/components/tasks.py`). Your own: any class with `sums`,
`count` and `figures`, named by _target_."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TaskConfig:
    _target_: str = "src.components.tasks.Classification"


@dataclass
class LanguageModelConfig(TaskConfig):
    _target_: str = "src.components.tasks.LanguageModel"


@dataclass
class SegmentationConfig(TaskConfig):
    _target_: str = "src.components.tasks.Segmentation"
    ignore_index: int = -100
    """Target pixels with this label count in no loss, accuracy or IoU."""


@dataclass
class RegressionConfig(TaskConfig):
    _target_: str = "src.components.tasks.Regression"
