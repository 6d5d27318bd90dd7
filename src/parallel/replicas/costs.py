"""What `parallel=dp` and `parallel=dp_criterion` cost (`ReplicaCosts`, their `CostModel`): the
model replicated over one process's devices, each replica fed its part of the batch, the
outputs gathered on the output device (dp) or left where they are (dp_criterion)."""

from __future__ import annotations

from dataclasses import dataclass

from src.parallel.shares import DeviceShare, Messages, ModelSizes


@dataclass(frozen=True)
class ReplicaCosts:
    """`devices` replicas on `device_type`, their outputs gathered when `gather_outputs`."""

    device_type: str
    devices: int
    gather_outputs: bool

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """On CPU, one process holding every replica (they share the parameters); on GPUs, the
        output device runs its part and holds the gathered outputs and their gradient, the
        others a parameter replica and their part of the batch."""
        parts = min(self.devices, micro_batch)
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
        replicas = min(self.devices, micro_batch) - 1
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

    def idle_fraction(self) -> float:
        """The replicas run side by side."""
        return 0.0

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """On CPU, no message but the replicas' threads: what running them costs beyond the
        module's own work, per micro-step (the calibration's `dp`; dp_criterion's second round
        of threads, for the loss alone, adds next to nothing). GPUs' replicas run side by side,
        their traffic a copy (`step_traffic`)."""
        replicas = min(self.devices, micro_batch)
        if self.device_type != "cpu" or replicas < 2:
            return []
        return [Messages("", accumulate, 0, replicas, wrapper="dp")]
