"""Plan before you launch: `python plan.py [the same overrides as train.py]` (`python train.py
--help` lists the groups, their options and every key).

Prints, for every strategy that can run on parallel.devices (or plan.strategies x plan.devices;
or only the one named by a `parallel=<name>` override), the predicted peak memory per device
split into parameters, gradients, optimizer state and activations, the peak while evaluating a
batch, the bytes sent per step, and whether the higher peak fits plan.device_memory_gb, then one
line recommending the fastest predicted one that fits, and why. Nothing runs on a device: the
real model and batch are traced on fake tensors (src/planning/planner.py); progress goes to
stderr.

    python plan.py parallel.devices=8                          # every strategy on 8 devices
    python plan.py model=gpt data=synthetic_tokens task=language_model parallel=fsdp
    python plan.py plan.strategies=[ddp,fsdp,hybrid] plan.devices=[2,4,8]
    python plan.py parallel=auto plan.device_memory_gb=16      # what parallel=auto would pick
    python plan.py plan.compare=multirun/2026-12-04/10-00-00   # predicted vs measured step time

plan.* settings: device_memory_gb (one device's memory), strategies, devices, device_tflops and
link_gb_per_s (for the predicted step time on GPUs the planner does not see), calibrate (measure
this machine again for the predicted step time), compare (a sweep folder: each job's predicted
step time against its measured one).
"""

import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, OverrideParseException

from src.config.base import ConfigError
from src.config.job import job_config
from src.config.schema import composition_error_line, register_configs
from src.runtime.torch_private import exit_without_teardown

CONF = Path(__file__).resolve().parent / "conf"


def main(overrides: list[str]) -> int:
    from src.planning.planner import (
        candidate_parallels,
        format_table,
        plan_all,
        planned_device_type,
        recommendation,
    )
    from src.planning.step_time import measured_speed

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            # Typed once, here: a setting out of range stops it now.
            job = job_config(compose(config_name="config", overrides=overrides))
            if job.plan.compare:
                print(compared_step_times(Path(job.plan.compare)))
                return 0
            every = not names_a_strategy(overrides)
            parallels = candidate_parallels(job, every)
            plans = plan_all(job, parallels, progress if len(parallels) > 1 else None)
            if len(plans) == 1 and plans[0].problem:  # asked alone: train.py's line and exit
                raise ConfigError(plans[0].problem)
            print(format_table(plans, job.plan.device_memory_gb, brief=every))
            if len(plans) > 1:
                print(measured_speed(planned_device_type(job), job.plan).describe())
                print(recommendation(plans))
        except (ConfigCompositionException, OverrideParseException) as error:
            print(f"plan.py: error: {composition_error_line(error)}", file=sys.stderr)
            return 2
        except ConfigError as error:
            print(f"plan.py: error: {error}", file=sys.stderr)
            return error.exit_code
    return 0


def compared_step_times(sweep_dir: Path) -> str:
    """Each finished job of a sweep folder: its predicted step time against its measured one."""
    from src.observe.sweep_rows import collect

    if not sweep_dir.is_dir():
        raise ConfigError(f"plan.compare: no sweep folder at {sweep_dir}")
    header = f"{'job':<6}{'strategy':<18}{'devices':>8}{'predicted ms':>14}{'measured ms':>13}"
    lines = [f"{header}{'ratio':>8}"]
    for row in collect(sweep_dir):
        if row.step_time_ms is None or row.predicted_step_ms is None:
            lines.append(
                f"{row.job:<6}{row.strategy:<18}{row.devices:>8}  {row.status}: no step time"
            )
            continue
        ratio = row.predicted_step_ms / row.step_time_ms
        lines.append(
            f"{row.job:<6}{row.strategy:<18}{row.devices:>8}{row.predicted_step_ms:>14.3g}"
            f"{row.step_time_ms:>13.3g}{ratio:>8.2f}"
        )
    return "\n".join(lines)


def names_a_strategy(overrides: list[str]) -> bool:
    """Whether the overrides choose the parallel option (`parallel=fsdp`), which is then the one
    planned (unless plan.strategies lists others)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return any(override.key_or_group == "parallel" for override in parsed)


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    logging.basicConfig(level=logging.WARNING)
    with exit_without_teardown():
        sys.exit(main(sys.argv[1:]))
