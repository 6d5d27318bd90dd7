"""Expert parallel (`parallel.ep`), all of it: how a mixture of experts' experts are split over
the ep ranks (borrowed from dp_shard) and what that costs.

- `apply.py`: ep's checks (`check_degrees`, `check_no_experts_under_ddp`, `check_experts`),
  `resolved_ep`, and `apply_ep`: each MoE layer's experts split over the ep ranks, FSDP-sharded
  over the ranks that hold the same ones, and its tokens sent to them and back
  (`exchanged_expert_outputs`);
- `costs.py`: what ep splits of a model (`expert_split`), and the experts' bytes, buffers,
  traffic and messages per step, for the planner.
"""
