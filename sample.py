"""Write text with a trained model: `python sample.py ckpt_path=<run folder | checkpoint | best |
last | exported file>`, nanoGPT's sample.py for any run of this template.

    python sample.py ckpt_path=best prompt="To be" max_new_tokens=200 temperature=0.8 top_k=200
    python sample.py ckpt_path=outputs/<date>/<time> prompt=FILE:prompt.txt num_samples=3 seed=1
    python sample.py ckpt_path=best temperature=0                  # greedy: the likeliest tokens

The model, data and trainer settings are the run's own (its checkpoint's config, as eval.py takes
them); overrides apply on top. A checkpoint of any layout loads on one device (CPU or GPU,
`trainer.accelerator`). The samples are decoded by the run's tokenizer (`<run>/tokenizer/`), or
printed as token ids for a run without one; model=gpt and transformer keep a key/value cache.
"""

import sys

import hydra
from omegaconf import DictConfig

from src.config.base import ConfigError
from src.config.schema import register_configs
from src.launch.command_line import (
    composition_errors_in_one_line,
    config_composed,
    exit_with_error,
    expected_failures_in_one_line,
)
from src.launch.composing import composing_once
from src.runtime.torch_private import exit_without_teardown


@hydra.main(version_base="1.3", config_path="conf", config_name="sample")
def main(cfg: DictConfig) -> float:
    config_composed()
    from src.launch.sample_job import run_sample

    return expected_failures_in_one_line(
        lambda: len(run_sample(cfg)), lambda: "run the same command to sample again"
    )


if __name__ == "__main__":
    with exit_without_teardown():  # a second less per run: see src/runtime/torch_private.py
        register_configs()
        with composition_errors_in_one_line("sample.py"), composing_once():
            from src.launch.eval_job import with_saved_run

            try:
                sys.argv[1:] = with_saved_run(sys.argv[1:])
            except ConfigError as error:
                exit_with_error("sample.py", str(error))
            main()
