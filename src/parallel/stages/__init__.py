"""A model cut into stages on one process's devices (`parallel=model_parallel`, and each process
of `parallel=hybrid`): how it is cut and run, and what it costs.

- `cut.py`: `StageCut`, the pipeline's settings checked, its split points chosen on the meta
  model (`choose_cuts`), the `Pipeline` built;
- `pipeline.py`: `Pipeline`, the stages run over micro-batches in GPipe order;
- `hybrid.py`: the stage cut of each process of `parallel=hybrid` (its devices, its checks);
- `deferred_batchnorm.py`: BatchNorm's running statistics updated once a step
  (`parallel.deferred_batchnorm`);
- `costs.py`: each stage's share, the activations crossing the boundaries, the bubble
  (`StageCosts`).
"""
