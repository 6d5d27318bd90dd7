"""What the model is trained and evaluated on, as sums over a batch.

Both functions return sums, not means: a strategy that computes them on several devices or
micro-batches adds the parts, and dividing by the global count gives the exact global mean even
when the parts have different sizes. Outputs are (..., classes) logits, targets (...) class ids:
classification (batch, classes) and language modelling (batch, seq, vocab) alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every target in the batch."""
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten(), reduction="sum")


def loss_and_correct(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, number of correct predictions] over the batch (the first one
    differentiable): what training and evaluation both measure."""
    correct = (outputs.argmax(-1) == targets).sum(dtype=torch.float32)
    return torch.stack([loss_sum(outputs, targets), correct])
