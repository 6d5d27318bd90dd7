"""Train one experiment: `python train.py [group=option ...] [key=value ...]`.

    python train.py                                   # MLP on synthetic data, one CPU/GPU
    python train.py parallel=ddp parallel.devices=4   # 4 processes (GPUs, or CPU with gloo)
    python train.py -m parallel=single,ddp parallel.devices=1,2
    python train.py trainer.resume=auto hydra.run.dir=outputs/<run>   # continue a stopped run

Configuration lives in conf/; `python train.py --help` lists the groups and options.
"""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import hydra
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig

from src.config.schema import ConfigError, composition_error_line, register_configs
from src.launch.launcher import follow_rank0_run_dir, start_rank_server_early
from src.launch.torch_private import exit_without_teardown

log = logging.getLogger(__name__)
# Hydra lets its errors through to the caller, instead of reporting them itself (several lines,
# exit code 1), while this variable is "1". train.py sets it for as long as Hydra composes the
# config (see `composition_errors_in_one_line`), unless the user has set it.
LET_ERRORS_THROUGH = "HYDRA_FULL_ERROR"
composing = False


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    global composing
    if composing:  # composed: from here on Hydra reports errors its own way
        del os.environ[LET_ERRORS_THROUGH]
        composing = False
    start_rank_server_early(cfg.parallel)  # its imports overlap the next line's
    # Imported here so that --help and config errors stay fast.
    from src.launch.job import resume_hint, run
    from src.runtime.stopping import Interrupted, ProcessDied, RunStopped

    # Expected failures get one message and an exit code instead of a traceback. In a multirun,
    # `sweep.run_job` records how each job ended and the sweep goes on; a signal still stops it.
    try:
        return run(cfg)
    except (Interrupted, ProcessDied) as stop:
        log.error("%s; %s", stop, resume_hint())
        sys.exit(stop.exit_code)
    except (ConfigError, RunStopped) as error:
        log.error("%s", error)
        sys.exit(error.exit_code)


@contextlib.contextmanager
def composition_errors_in_one_line() -> Iterator[None]:
    """A config Hydra cannot compose (a misspelt key, a wrong type, an unknown option, an
    override it cannot parse) ends with one line and exit code 2, like every other bad input.
    (A sweep composes every job's config before it runs the first.) With HYDRA_FULL_ERROR=1 set
    by the user, Hydra's own report stays, with its traceback."""
    global composing
    composing = os.environ.get(LET_ERRORS_THROUGH) != "1"
    if composing:
        os.environ[LET_ERRORS_THROUGH] = "1"
    try:
        yield
    except (ConfigCompositionException, OverrideParseException) as error:
        if not composing:  # the user's HYDRA_FULL_ERROR=1 asks for the traceback
            raise
        print(f"train.py: error: {composition_error_line(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    with exit_without_teardown():  # a second less per run: see src/launch/torch_private.py
        register_configs()
        follow_rank0_run_dir()  # ranks started by torchrun/srun share rank 0's run directory
        with composition_errors_in_one_line():
            main()
