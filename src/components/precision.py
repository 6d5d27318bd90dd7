"""Mixed precision: the autocast context of a run and fp16's loss scaling.

bf16 keeps fp32's exponent range, so it needs no scaling; fp16 does: its gradients underflow to
zero unless the loss is multiplied up before backward, and a step whose scaled gradients
overflow (inf/NaN) is skipped while the scale is halved (`torch.amp.GradScaler`). Those skips
are the scaler's normal search for a scale, not a diverged run: they are counted
(`scaler_skipped_steps` in summary.json) and never stop training, whereas a non-finite *loss*
still does (see `src/runtime/stopping.py`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from src.config.trainer import Precision

AUTOCAST_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


def autocast(device_type: str, precision: Precision) -> contextlib.AbstractContextManager:
    """Autocast to `precision`'s dtype; off for fp32."""
    dtype = AUTOCAST_DTYPES.get(precision, torch.bfloat16)
    return torch.autocast(device_type, dtype=dtype, enabled=precision in AUTOCAST_DTYPES)


class LossScaling:
    """The loop's side of a GradScaler (enabled for fp16 only; otherwise every call is a plain
    pass-through): scale the loss, unscale before clipping, step, and count skipped steps."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.scaler.is_enabled():
            optimizer.step()
            return
        # GradScaler.step reads its inf checks back to decide on the step anyway, so these reads
        # of the scale add no wait. The scale drops exactly when the step was skipped.
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped_steps += self.scaler.get_scale() < scale

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run goes on at the scale it reached rather
        than searching again from `trainer.loss_scale_init` (plain numbers only)."""
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A disabled scaler (fp32, bf16) saves nothing and loads nothing: a change of precision
        # on resume starts fp16's scale afresh.
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state["skipped_steps"]
