"""Train one experiment: `python train.py [group=option ...] [key=value ...]`.

    python train.py                                   # MLP on synthetic data, one CPU/GPU
    python train.py parallel=ddp parallel.devices=4   # 4 processes (GPUs, or CPU with gloo)
    python train.py -m parallel=single,ddp parallel.devices=1,2
    python train.py trainer.resume=auto hydra.run.dir=outputs/<run>   # continue a stopped run

Configuration lives in conf/; `python train.py --help` lists the groups and options.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from src.config import ConfigError, register_configs
from src.launch import follow_rank0_run_dir

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    # Imported here so that --help and config errors stay fast.
    from src.experiment import resume_command, run
    from src.stopping import Interrupted, RunStopped
    from src.sweep import run_job

    # Expected failures get one message and an exit code instead of a traceback. In a multirun,
    # `run_job` records how each job ended and the sweep goes on; a signal still stops it.
    try:
        return run_job(run, cfg)
    except Interrupted as stop:
        log.error("%s; resume with:\n  %s", stop, resume_command())
        sys.exit(stop.exit_code)
    except (ConfigError, RunStopped) as error:
        log.error("%s", error)
        sys.exit(error.exit_code)


if __name__ == "__main__":
    register_configs()
    follow_rank0_run_dir()  # ranks started by torchrun/srun share rank 0's run directory
    main()
