"""The data-parallel degree `dp_replicate` (whole replicas, torch's DDP), all of it:

- `apply.py`: its checks, `apply_ddp` with the reducer's options, and the reducer's release;
- `costs.py`: what the reducer's buckets add to a replica's memory and what the gradients'
  all-reduce sends per step, for the planner; `DDPCosts`, `Replicated`'s cost model.

The strategy that runs it, alone or over each process's stage cut, is `replicated.Replicated`;
beside dp_shard (HSDP), FSDP2 replicates instead (`dp_shard.apply.apply_fsdp`), priced with
these costs.
"""
