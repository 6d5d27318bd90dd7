"""Evaluate a checkpoint: `python eval.py ckpt_path=<run folder | checkpoint folder | best | last>`.

    python eval.py ckpt_path=outputs/<date>/<time>                  # that run's newest checkpoint
    python eval.py ckpt_path=best                                   # the newest run's best one
    python eval.py ckpt_path=last run_dir=outputs/<run> split=val   # a run's newest, on val
    python eval.py ckpt_path=<...> parallel=ddp parallel.devices=2 predict=true

The model, data, task and trainer settings are the run's own (its checkpoint's config); overrides
apply on top; `parallel` is this command's (`single` unless given), whatever layout trained and
saved the checkpoint. Figures go to the console, eval.json in outputs/eval/<date>/<time>/ and a W&B
run (job_type=eval) in the training run's group; `predict=true` writes predictions.pt too.
"""

import sys

import hydra
from omegaconf import DictConfig

from src.config.base import ConfigError
from src.config.schema import register_configs
from src.launch.as_rank import follow_rank0_run_dir
from src.launch.command_line import (
    composition_errors_in_one_line,
    config_composed,
    exit_with_error,
    expected_failures_in_one_line,
)
from src.launch.composing import composing_once
from src.launch.early_server import start_rank_server_early
from src.runtime.torch_private import exit_without_teardown


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> float:
    config_composed()
    start_rank_server_early(cfg.parallel)
    from src.launch.eval_job import run_eval

    return expected_failures_in_one_line(
        lambda: run_eval(cfg)["loss"], lambda: "run the same command to evaluate it again"
    )


if __name__ == "__main__":
    with exit_without_teardown():  # a second less per run: see src/runtime/torch_private.py
        register_configs()
        follow_rank0_run_dir()  # ranks started by torchrun/srun share rank 0's run directory
        with composition_errors_in_one_line("eval.py"), composing_once():
            from src.launch.eval_job import with_saved_run

            try:
                sys.argv[1:] = with_saved_run(sys.argv[1:])
            except ConfigError as error:
                exit_with_error("eval.py", str(error))
            main()
