"""A task of a user's own, outside `src/`: named by `task._target_=tests.odd_tasks.BrierScore`."""

from __future__ import annotations

import torch


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
