"""Train one experiment: `python train.py [group=option ...] [key=value ...]`.

    python train.py                                   # MLP on synthetic data, one CPU/GPU
    python train.py parallel=ddp parallel.devices=4   # 4 processes (GPUs, or CPU with gloo)
    python train.py -m parallel=single,ddp parallel.devices=1,2
    python train.py trainer.resume=auto hydra.run.dir=outputs/<run>   # continue a stopped run

Configuration lives in conf/; `python train.py --help` lists the groups and options.
"""

import hydra
from omegaconf import DictConfig

from src.config.schema import register_configs
from src.launch.as_rank import follow_rank0_run_dir
from src.launch.command_line import (
    composition_errors_in_one_line,
    config_composed,
    expected_failures_in_one_line,
)
from src.launch.composing import composing_once
from src.launch.early_server import start_rank_server_early
from src.runtime.torch_private import exit_without_teardown


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    config_composed()
    start_rank_server_early(cfg.parallel)  # its imports overlap the next line's
    # Imported here so that --help and config errors stay fast.
    from src.launch.job import resume_hint, run

    return expected_failures_in_one_line(lambda: run(cfg), resume_hint)


if __name__ == "__main__":
    with exit_without_teardown():  # a second less per run: see src/runtime/torch_private.py
        register_configs()
        follow_rank0_run_dir()  # ranks started by torchrun/srun share rank 0's run directory
        with composition_errors_in_one_line("train.py"), composing_once():
            main()
