"""Tensor parallel, all of it: how a model is split over the tp ranks and what that costs.

- `registry.py`: the hook a model registers its plan with (`tensor_parallel_plan`), and
  `RowOrder` for fused parameters;
- `builtin_plans.py`: the template's own models' plans (mlp, transformer, gpt);
- `gpt2_plan.py`: transformers' GPT-2's plan (its Conv1D styles, whole heads per rank);
- `declared_plans.py`: a plan a model declares as transformers' do (`base_model_tp_plan`), as
  torch's ParallelStyles;
- `apply.py`: which plan a model gets (`tp_plan`), the split (`apply_tp`), the row orders that
  keep checkpoints in single's layout, and sequence and loss parallel's checks and loss;
- `costs.py`: what a tp rank keeps of the model's state, work and activations, and what it sends
  per step, for the planner.

"Plan" here means torch's `parallelize_module` plan: module names to ParallelStyles.
"""
