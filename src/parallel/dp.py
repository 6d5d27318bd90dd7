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
from src.parallel.base import LossFn, Strategy, process_peak_memory_mb
from src.parallel.mechanisms.replicas import DataParallel
from src.parallel.shares import DeviceShare, Messages, ModelSizes

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

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """On CPU, one process holding every replica (they share the parameters); on GPUs, the
        output device runs its part and holds the gathered outputs and their gradient, the
        others a parameter replica and their part of the batch."""
        parts = min(self.cfg.devices, micro_batch)
        if self.device_type == "cpu":
            share = DeviceShare(
                "cpu:0", micro_batch, parts=parts, gather=self.gather_outputs, devices=parts
            )
            return [share]
        chunk = -(-micro_batch // parts)
        gathered = 2 * micro_batch * sizes.block_output_bytes[-1] if self.gather_outputs else 0
        output_device = DeviceShare("cuda:0", chunk, extra_bytes={"activations": gathered})
        replicas = [DeviceShare(f"cuda:{i}", chunk, replica_only=True) for i in range(1, parts)]
        return [output_device, *replicas]

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        """From the output device, per micro-step: the inputs scattered, the parameters
        broadcast to each replica and their gradients reduced back; with the gather, the
        outputs gathered and their gradients scattered back."""
        replicas = min(self.cfg.devices, micro_batch) - 1
        others = replicas / (replicas + 1)
        traffic = {
            "input scatter": int(accumulate * others * micro_batch * sizes.input_bytes),
            "parameter broadcast + gradient reduce": 2
            * accumulate
            * replicas
            * sizes.parameter_bytes,
        }
        if self.gather_outputs:
            outputs = micro_batch * sizes.block_output_bytes[-1]
            traffic["output gather + gradient scatter"] = int(2 * accumulate * others * outputs)
        return traffic

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """On CPU, no message but the replicas' threads: what running them costs beyond the
        module's own work, per micro-step (the calibration's `dp`; dp_criterion's second round
        of threads, for the loss alone, adds next to nothing). GPUs' replicas run side by side,
        their traffic a copy (`step_traffic`)."""
        replicas = min(self.cfg.devices, micro_batch)
        if self.device_type != "cpu" or replicas < 2:
            return []
        return [Messages("", accumulate, 0, replicas, wrapper="dp")]
