"""The root schemas (`conf/config.yaml`'s, `conf/eval.yaml`'s and `conf/sample.yaml`'s) and their
registration.

Each YAML file under `conf/` starts from a typed schema, so Hydra rejects a misspelt key or a value
of the wrong type (`trainer.max_steps=abc`) with its own message before any work starts. Each
group's schemas live beside it: `src/config/<group>.py` for `conf/<group>/`. Every default has
its one source there, with what the setting does in the docstring below it; an option's YAML file
sets only what differs from its schema and what names the choice. `register_configs()` puts them
in Hydra's ConfigStore under `schema/<group>/<name>`; it is called by `train.py` and the tests,
never at import time.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig

from src.config.base import first_line
from src.config.data import (
    HFDatasetConfig,
    ImageFolderConfig,
    SyntheticConfig,
    SyntheticRegressionConfig,
    SyntheticSegmentationConfig,
    SyntheticTokensConfig,
    TextConfig,
    TokensConfig,
    TorchvisionSetConfig,
)
from src.config.logger import LoggerConfig
from src.config.model import (
    ConvNetConfig,
    FCNConfig,
    GPTConfig,
    HFCausalLMConfig,
    HFImageClassifierConfig,
    MLPConfig,
    MoEConfig,
    ResNetConfig,
    TimmConfig,
    TransformerConfig,
)
from src.config.optimizer import AdamWConfig, MuonConfig, SGDConfig
from src.config.parallel import MeshConfig, ParallelConfig, PipelineConfig
from src.config.plan import PlanConfig
from src.config.task import (
    LanguageModelConfig,
    RegressionConfig,
    SegmentationConfig,
    TaskConfig,
)
from src.config.trainer import TrainerConfig


@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    parallel: Any = MISSING
    trainer: TrainerConfig = MISSING
    optimizer: Any = MISSING
    logger: LoggerConfig = MISSING
    plan: PlanConfig = field(default_factory=PlanConfig)
    seed: int = 0


@dataclass
class EvalConfig(Config):
    """`python eval.py`'s own settings; the others are the evaluated run's (`SAVED_RUN`)."""

    ckpt_path: str = MISSING
    """A run folder (its newest checkpoint), a checkpoint folder, or `best` / `last`: the run's
    `checkpoints/best`, or its newest `checkpoints/step-*`, of the run in `run_dir`."""
    run_dir: str | None = None
    """The run whose `best` / `last` checkpoint to evaluate; None: the newest run in outputs/."""
    split: str = "test"
    """The data split to evaluate: test, val, ... (the data's own)."""
    predict: bool = False
    """Also write the model's outputs for every sample of the split to predictions.pt."""


@dataclass
class SampleConfig(Config):
    """`python sample.py`'s own settings; the others are the sampled run's (`SAVED_RUN`)."""

    ckpt_path: str = MISSING
    """As eval.py's: a run folder, a checkpoint folder, `best` / `last`, or an exported file."""
    run_dir: str | None = None
    """The run whose `best` / `last` checkpoint to sample from; None: the newest in outputs/."""
    prompt: str = ""
    """The text the samples continue (`FILE:<path>`: the text of that file); token ids separated
    by spaces for a run without a tokenizer (synthetic tokens). Empty: the end-of-text token."""
    max_new_tokens: int = 200
    """Tokens generated after the prompt; past the model's positions the context is cropped."""
    temperature: float = 0.8
    """The logits are divided by it before the softmax; 0: greedy (the most likely token)."""
    top_k: int | None = 200
    """Draw among the k most likely tokens only; None: among all."""
    num_samples: int = 3
    """Samples of the prompt, generated together (a batch)."""
    cache: bool = True
    """Keep the keys and values of the tokens seen (model=gpt, transformer); false: compute the
    whole context again for each token, as any other model does."""


# The option of each group that `eval.py` stores from the evaluated checkpoint's config
# (`store_saved_run`); `parallel` is eval.py's own: any layout reads any checkpoint.
SAVED_RUN = "saved_run"
SAVED_GROUPS = ("model", "data", "task", "trainer", "optimizer", "logger")


SCHEMAS = {
    "model": {
        "mlp": MLPConfig,
        "convnet": ConvNetConfig,
        "transformer": TransformerConfig,
        "fcn": FCNConfig,
        "gpt": GPTConfig,
        "moe": MoEConfig,
        "resnet": ResNetConfig,
        "hf_causal_lm": HFCausalLMConfig,
        "hf_image_classifier": HFImageClassifierConfig,
        "timm": TimmConfig,
    },
    "data": {
        "synthetic": SyntheticConfig,
        "synthetic_tokens": SyntheticTokensConfig,
        "synthetic_segmentation": SyntheticSegmentationConfig,
        "synthetic_regression": SyntheticRegressionConfig,
        "torchvision_set": TorchvisionSetConfig,
        "image_folder": ImageFolderConfig,
        "tokens": TokensConfig,
        "text": TextConfig,
        "hf_dataset": HFDatasetConfig,
    },
    "task": {
        "classification": TaskConfig,
        "language_model": LanguageModelConfig,
        "segmentation": SegmentationConfig,
        "regression": RegressionConfig,
    },
    "parallel": {
        "base": ParallelConfig,
        "pipeline": PipelineConfig,
        "mesh": MeshConfig,
    },
    "trainer": {"default": TrainerConfig},
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig, "muon": MuonConfig},
}


@functools.cache  # once per process: a run forked from the tests' preloader finds them stored
def register_configs() -> None:
    """Store the schemas so that YAML files can start from `/schema/<group>/<name>@_here_`."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    store.store(name="eval_schema", node=EvalConfig)
    store.store(name="sample_schema", node=SampleConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=schema)


def store_saved_run(config: dict[str, Any]) -> None:
    """A run's resolved `config` (a checkpoint's) as the option `saved_run` of each of
    `SAVED_GROUPS` it has: selected by `<group>=saved_run`, a group composes as the run had it, and
    the command line's overrides apply on top, as to any option."""
    store = ConfigStore.instance()
    for group in SAVED_GROUPS:
        if group in config:  # a weights file's config has the model's only
            node = sectioned_logger(config[group]) if group == "logger" else config[group]
            store.store(group=group, name=SAVED_RUN, node=node)


def sectioned_logger(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved `logger` as today's schema has it: a run from before the other loggers saved W&B's
    own keys beside the run's name and group, and `name: wandb` or `none`."""
    if "name" not in saved:
        return saved
    shared = {key: value for key, value in saved.items() if key in LoggerConfig.__annotations__}
    own = {key: value for key, value in saved.items() if key not in shared and key != "name"}
    return {**shared, "wandb": {**own, "enabled": saved["name"] == "wandb"}}


def composition_error_line(error: Exception) -> str:
    """Hydra's report of a config it cannot compose, in one line: what failed, why, and for a
    misspelt key the closest key there (or all of them); for an unknown option, the options."""
    first, *rest = str(error).splitlines()
    if isinstance(error, MissingConfigException):  # the rest: Hydra's search path
        return f"{first}; choose one of {', '.join(error.options)}" if error.options else first
    # Hydra's hints: a link to its docs, and `+key=value`, which a typed schema refuses anyway
    # (an empty open dict takes it: `missing_key_hint` passes it on there).
    parts = [first] + [line for line in rest if line and not line.startswith(("See ", "To "))]
    if isinstance(error, OverrideParseException) and error.override not in first:
        parts.insert(0, f"Error parsing override '{error.override}'")
    cause = error.__cause__
    if cause is not None:
        parts.append(first_line(cause))
    line = ": ".join(part.rstrip(".") for part in parts)
    node, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if isinstance(node, DictConfig) and isinstance(key, str) and key not in node:
        full_key = str(getattr(cause, "full_key", key))
        line += missing_key_hint(node, full_key, rest)
    return line


def missing_key_hint(node: DictConfig, full_key: str, hydra_hints: list[str]) -> str:
    """What to write instead of `full_key`, whose last key `node` lacks: the closest key there,
    or all of them; for a node with none yet (an open dict such as `model.sizes`, which `+`
    extends), Hydra's own `+key=value`."""
    path, _, key = full_key.rpartition(".")
    keys = [str(k) for k in node]
    close = difflib.get_close_matches(key, keys, n=1)
    if close:
        return f"; did you mean {close[0]}?"
    if keys:
        return f"; the keys there: {', '.join(keys)}"
    appends = [hint.split()[-1] for hint in hydra_hints if hint.startswith("To append")]
    return f"; {path or 'it'} has no keys yet" + (f": add one with {appends[0]}" if appends else "")
