"""`parallel=dp`: torch.nn.DataParallel in one process. Each step scatters the batch on dim 0 over
`parallel.devices`, replicates the model, runs the replicas in parallel threads, gathers their
outputs on the output device (the first one) and computes the loss there.

Everything after the gather (the full batch's outputs, the loss and its gradient) lives on the
output device, so with a large output (segmentation maps, big vocabularies) that device needs
much more memory than the others: `peak_memory_mb` per device and `output_device_memory_ratio` in
summary.json (and the W&B summary) show it. `parallel=dp_criterion` avoids the gather.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from src.components.batches import Tree, move
from src.parallel.base import LossFn, Strategy
from src.parallel.devices import process_peak_memory_mb
from src.parallel.replicas.apply import DataParallel
from src.parallel.replicas.costs import ReplicaCosts

log = logging.getLogger(__name__)


class DP(Strategy):
    gather_outputs = True

    def check_batch(self, micro_batch: int) -> None:
        """Any micro-batch works. One that does not divide by the devices is split unevenly
        (25 samples on 3 devices: 9, 9, 7) and the loss is still the exact mean over the batch,
        because the parts' loss sums are added before dividing. Fewer samples than devices leave
        the extra devices idle, which is allowed but almost certainly not what was meant."""
        super().check_batch(micro_batch)
        if micro_batch < self.cfg.devices:
            log.warning(
                "the micro-batch has %d samples for parallel.devices=%d: only %d devices get "
                "work; raise trainer.batch_size or lower parallel.devices",
                micro_batch,
                self.cfg.devices,
                micro_batch,
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        return DataParallel(model.to(self.devices[0]), self.devices, self.gather_outputs)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        return fn(model(inputs), move(targets, self.devices[0]))

    def report(self) -> dict[str, Any]:
        """On 2+ GPUs: the output device's peak memory over the other devices' mean."""
        _, (peaks,) = self.peak_memory_mb(process_peak_memory_mb)
        if self.device_type != "cuda" or len(peaks) < 2:
            return {}
        others = peaks[1:]
        return {"output_device_memory_ratio": peaks[0] / (sum(others) / len(others))}

    def cost_model(self) -> ReplicaCosts:
        return ReplicaCosts(self.device_type, self.cfg.devices, self.gather_outputs)
