"""The model replicated over one process's devices (`parallel=dp`, `parallel=dp_criterion`):
how it runs and what it costs.

- `apply.py`: torch.nn.DataParallel's data flow on CUDA and CPU (scatter, replicate, parallel
  apply, gather: `DataParallel`), and the loss computed beside each replica
  (`parallel_criterion`);
- `costs.py`: each device's share, the bytes scattered, broadcast and gathered, the replicas'
  threads (`ReplicaCosts`).
"""
