"""Pipeline parallel, all of it: a model cut into stages over the pp ranks, run by
torch.distributed.pipelining's schedules, and what that costs.

- `cut.py`: where every pipeline cuts a model (`cut_at`: an nn.Sequential between its children,
  any other by torch's tracer), who holds each name, and pp's balanced split (`cut_model`); the
  in-process stage cut (model_parallel, hybrid) cuts with it too;
- `schedules.py`: the schedules by name, their up-front checks (`check_schedule`), the pp rank
  holding each stage, and `apply_pp`;
- `stages.py`: the stages each pp rank holds (`stage_parts`), the others' on the meta device;
- `tied.py`: weights tied across stages on several ranks, a copy apiece, gradients summed;
- `run.py`: `PipelineRun`, a rank's part of the pipeline run a micro-step at a time for the loop;
- `clock.py`: `StageClock`, a rank's measured idle fraction;
- `costs.py`: pp's bubble and the traffic and messages across the stages' boundaries, for the
  planner.
"""
