"""Train one experiment: `python train.py [group=option ...] [key=value ...]`.

    python train.py                                   # MLP on synthetic data, one CPU/GPU
    python train.py parallel=ddp parallel.devices=4   # 4 processes (GPUs, or CPU with gloo)
    python train.py -m parallel=single,ddp parallel.devices=1,2

Configuration lives in conf/; `python train.py --help` lists the groups and options.
"""

import hydra
from omegaconf import DictConfig

from src.config import register_configs


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from src.experiment import run  # imported here so that --help and config errors stay fast

    return run(cfg)["final_val_loss"]


if __name__ == "__main__":
    register_configs()
    main()
