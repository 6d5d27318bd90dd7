"""Tasks: what the model is trained on and measured by (`task=` in the config), as sums.

A task turns a batch's (outputs, targets) into one 1-D tensor of sums, [loss sum, metric sums...]
(the first differentiable), and says how many targets the loss sum is over (`count`). Sums, not
means: a strategy that runs a batch on several devices or micro-batches adds the parts, and
dividing by the global count gives the exact global mean even when the parts differ in size.
`figures` turns the totals over many batches into the named means the loop logs.

A task of your own is any class with these three methods, named by `task._target_`; it may take
outputs and targets that are tuples or dicts of tensors (`src/components/batches.py`). The built-in
tasks take one tensor of each.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.components.targets import check_target


def build_task(settings: DictConfig) -> Task:
    """The task `task._target_` names, built with the task option's settings (checked first:
    `check_target`)."""
    check_target("task", settings, "a task")
    return instantiate(settings)


class Task(Protocol):
    """What the loop and the strategies call on a task (`task._target_`): sums, so that means are
    exact across any split of the batch."""

    def sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """A 1-D tensor of sums over the targets, the loss's first."""
        ...

    def count(self, targets: Any) -> int | torch.Tensor:
        """How many targets the sums are over."""
        ...

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        """Named means from sums (over all processes) and their count."""
        ...


def not_one_tensor(outputs: Any, targets: Any) -> str | None:
    """Why a built-in task cannot take these (None: each is one tensor)."""
    for name, value in (("outputs", outputs), ("targets", targets)):
        if not torch.is_tensor(value):
            return (
                f"the {name} must be one tensor, not a {type(value).__name__}; return one from "
                f"the {'model' if name == 'outputs' else 'data'}, or name a task of your own that "
                f"takes a {type(value).__name__} (task._target_)"
            )
    return None


def loss_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every target of (..., classes) logits and (...) class ids."""
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten(), reduction="sum")


class Classification:
    """Cross-entropy and accuracy. Outputs are (..., classes) logits, targets (...) class ids:
    one label per sample (batch, classes), or per token (batch, seq, vocab)."""

    def check(self, outputs: torch.Tensor, targets: torch.Tensor, num_classes: int) -> str | None:
        """Why outputs of this shape cannot be scored against these targets (None: they can)."""
        if problem := not_one_tensor(outputs, targets):
            return problem
        if outputs.dim() == 0 or outputs.shape[-1] < num_classes:
            return f"its last dimension must be the data's {num_classes} classes"
        if outputs.shape[:-1] != targets.shape:
            return f"it must be {list(targets.shape)} (the targets' shape) + [classes]"
        return None

    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[summed cross-entropy, correct predictions]."""
        # max's indices are argmax's (the first maximum) at half its time on CPUs (torch 2.14).
        correct = (outputs.max(-1).indices == targets).sum(dtype=torch.float32)
        return torch.stack([loss_sum(outputs, targets), correct])

    def count(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        loss, correct = sums
        return {"loss": loss / count, "accuracy": correct / count}


class LanguageModel(Classification):
    """Next-token cross-entropy and accuracy, (batch, seq, vocab) logits against the (batch, seq)
    next tokens; perplexity is exp(mean cross-entropy).

    A model may also return an auxiliary loss (a mixture of experts' load balancing): outputs
    (logits, aux loss (batch,)), each sample's aux loss summed over its tokens. It is added to
    the loss (what training minimises) and logged on its own as aux_loss, both means over the
    tokens."""

    @staticmethod
    def logits(outputs: Any) -> torch.Tensor:
        """The (batch, seq, vocab) logits of a model's outputs, without any aux loss."""
        return outputs[0] if isinstance(outputs, tuple) else outputs

    def check(self, outputs: Any, targets: torch.Tensor, num_classes: int) -> str | None:
        if isinstance(outputs, tuple) and len(outputs) == 2:
            logits, aux_loss = outputs
            if not torch.is_tensor(aux_loss) or aux_loss.shape != targets.shape[:1]:
                return "its second part, the aux loss, must be one sum per sample"
            return super().check(logits, targets, num_classes)
        return super().check(outputs, targets, num_classes)

    def sums(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """[summed loss, correct predictions], and the summed aux loss when the outputs carry
        one (which the summed loss includes)."""
        if not isinstance(outputs, tuple):
            return super().sums(outputs, targets)
        logits, aux_loss = outputs
        cross_entropy, correct = super().sums(logits, targets)
        aux_loss = aux_loss.float().sum()
        return torch.stack([cross_entropy + aux_loss, correct, aux_loss])

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        loss, correct, *aux_loss = sums
        figures = super().figures([loss, correct], count)
        if aux_loss:
            figures["aux_loss"] = aux_loss[0] / count
        cross_entropy = figures["loss"] - figures.get("aux_loss", 0.0)
        return {**figures, "perplexity": math.exp(min(cross_entropy, 700.0))}  # no overflow


class Segmentation:
    """Per-pixel cross-entropy, pixel accuracy and mean IoU. Outputs are (batch, classes, H, W)
    logits, targets (batch, H, W) class ids; pixels labelled `ignore_index` count nowhere.
    Mean IoU comes from the confusion counts summed over every batch (not a mean of per-batch
    IoUs), over the classes that occur in the targets or the predictions."""

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def check(self, outputs: torch.Tensor, targets: torch.Tensor, num_classes: int) -> str | None:
        if problem := not_one_tensor(outputs, targets):
            return problem
        if outputs.dim() != targets.dim() + 1 or outputs.shape[1] != num_classes:
            return f"it must be (batch, {num_classes} classes, ...) logits, one per target pixel"
        return None

    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[summed cross-entropy, correct pixels, confusion counts (classes x classes, row: the
        target, column: the prediction) flattened]."""
        classes = outputs.shape[1]
        loss = F.cross_entropy(
            outputs.float(), targets, ignore_index=self.ignore_index, reduction="sum"
        )
        kept = targets != self.ignore_index
        predicted = outputs.argmax(1)
        # Ignored pixels go to one extra cell, dropped: shapes never depend on the values (no
        # boolean indexing), so the sums also run on the meta device.
        cell = torch.where(kept, targets * classes + predicted, classes * classes).flatten()
        confusion = torch.zeros(classes * classes + 1, device=cell.device)
        confusion.index_add_(0, cell, torch.ones_like(cell, dtype=confusion.dtype))
        correct = ((predicted == targets) & kept).sum(dtype=torch.float32)
        return torch.cat([loss[None], correct[None], confusion[:-1]])

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != self.ignore_index).sum()

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        loss, correct, *confusion = sums
        classes = math.isqrt(len(confusion))
        matrix = torch.tensor(confusion).view(classes, classes)
        hits = matrix.diagonal()
        union = matrix.sum(0) + matrix.sum(1) - hits
        present = union > 0
        mean_iou = (hits[present] / union[present]).mean().item() if present.any() else math.nan
        return {"loss": loss / count, "pixel_accuracy": correct / count, "mean_iou": mean_iou}


class Regression:
    """Mean squared error (the loss) and mean absolute error over every target value; outputs
    are shaped like the targets."""

    def check(self, outputs: torch.Tensor, targets: torch.Tensor, num_classes: int) -> str | None:
        if problem := not_one_tensor(outputs, targets):
            return problem
        if outputs.shape != targets.shape:
            return f"it must be shaped like the targets, {list(targets.shape)}"
        return None

    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        error = outputs.float() - targets
        return torch.stack([error.square().sum(), error.abs().sum()])

    def count(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        squared, absolute = sums
        return {"loss": squared / count, "mae": absolute / count}
