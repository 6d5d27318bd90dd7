"""Tensor parallel, all of it: how a model is split over the tp ranks and what that costs.

- `registry.py`: the hook a model registers its styles with (`tensor_parallel_styles`), and
  `RowOrder` for fused parameters;
- `builtin_styles.py`: the template's own models' styles (mlp, transformer, gpt);
- `gpt2_styles.py`: transformers' GPT-2's styles (its Conv1D styles, whole heads per rank);
- `declared_styles.py`: the styles a model declares as transformers' do (`base_model_tp_plan`),
  as torch's ParallelStyles;
- `apply.py`: which styles a model gets (`tp_styles`), the split (`apply_tp`), the row orders
  that keep checkpoints in single's layout, and sequence and loss parallel's checks and loss;
- `costs.py`: what a tp rank keeps of the model's state, work and activations, and what it sends
  per step, for the planner.

A model's "styles" are what torch's `parallelize_module` takes as its `parallelize_plan`: module
names to ParallelStyles ("plan" is the planner's output alone, src/planning/).
"""
