"""The data-parallel degree `dp_shard` (FSDP2), all of it: how a model is sharded over the
dp_shard ranks and what that costs.

- `apply.py`: `apply_fsdp` (each block a unit, tied blocks together), its mixed-precision and
  offload policies, the scaler that checks every rank's shard, rank 0's weights copied to every
  rank, the gradients' sync between micro-steps, the optimizer's parameter names;
- `costs.py`: what FSDP2 gathers and holds beside the traced step, and what it sends per step,
  for the planner.
"""
