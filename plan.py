"""Plan before you launch: `python plan.py [the same overrides as train.py]`.

Prints, for the configured strategy (or plan.strategies x plan.devices), the predicted peak
memory per device split into parameters, gradients, optimizer state and activations, the bytes
sent per step, and whether it fits plan.device_memory_gb. Nothing runs on a
device: the real model and batch are traced on fake tensors (src/plan.py).

    python plan.py                                             # the default run
    python plan.py model=gpt data=synthetic_tokens task=language_model parallel=fsdp
    python plan.py plan.strategies=[ddp,fsdp,hybrid] plan.devices=[2,4,8]
    python plan.py parallel=auto plan.device_memory_gb=16      # what parallel=auto would pick

plan.* settings: device_memory_gb (one device's memory), strategies, devices, device_tflops and
link_gb_per_s (for the predicted step time that parallel=auto ranks by).
"""

import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, OverrideParseException

from src.config import ConfigError, composition_error_line, register_configs
from src.process_exit import exit_without_teardown

CONF = Path(__file__).resolve().parent / "conf"


def main(overrides: list[str]) -> int:
    from src.plan import AUTO, candidate_parallels, choose, format_table, plan_all

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            cfg = compose(config_name="config", overrides=overrides)
            plans = plan_all(cfg, candidate_parallels(cfg))
            print(format_table(plans, cfg.plan.device_memory_gb))
            if cfg.parallel.name == AUTO:
                print(choose(plans)[1])
        except (ConfigCompositionException, OverrideParseException) as error:
            print(f"plan.py: error: {composition_error_line(error)}", file=sys.stderr)
            return 2
        except ConfigError as error:
            print(f"plan.py: error: {error}", file=sys.stderr)
            return error.exit_code
    return 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    logging.basicConfig(level=logging.WARNING)
    with exit_without_teardown():
        sys.exit(main(sys.argv[1:]))
