"""Tasks of a user's own, outside `src/`: named by `task._target_=tests.odd_tasks.<Name>`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BrierScore:
    """Squared error between the softmax and the one-hot target (the loss), plus accuracy."""

    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        probabilities = outputs.float().softmax(-1)
        one_hot = torch.nn.functional.one_hot(targets, outputs.shape[-1]).float()
        correct = (outputs.argmax(-1) == targets).sum(dtype=torch.float32)
        return torch.stack([(probabilities - one_hot).square().sum(), correct])

    def count(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        return {"loss": sums[0] / count, "accuracy": sums[1] / count}


class LabelAndValue:
    """Dict outputs against dict targets: cross-entropy of outputs["logits"] against
    targets["label"] plus the squared error of outputs["value"] against targets["value"] (the
    loss), accuracy, and the squared error alone."""

    def sums(self, outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]):
        logits, labels = outputs["logits"].float(), targets["label"]
        squared = (outputs["value"].float() - targets["value"]).square().sum()
        correct = (logits.argmax(-1) == labels).sum(dtype=torch.float32)
        cross_entropy = F.cross_entropy(logits, labels, reduction="sum")
        return torch.stack([cross_entropy + squared, correct, squared])

    def count(self, targets: dict[str, torch.Tensor]) -> int:
        return targets["label"].numel()

    def figures(self, sums: list[float], count: float) -> dict[str, float]:
        loss, correct, squared = sums
        return {"loss": loss / count, "accuracy": correct / count, "value_mse": squared / count}
