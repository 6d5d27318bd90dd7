"""The shipped `conf/` composes, validates and builds what it names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, STRATEGIES, options, parallel_config
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from src.components.data import build_data
from src.components.optimizer import build_optimizer, settle_optimizer_settings
from src.components.schedules import lr_schedule
from src.config.base import ConfigError, typed
from src.config.schema import SCHEMAS, register_configs
from src.config.trainer import TrainerConfig
from src.parallel import build_strategy

GROUPS = ("model", "data", "parallel", "trainer", "optimizer", "logger")


def test_default_config_has_every_group(compose_config):
    cfg = compose_config()
    assert all(group in cfg for group in GROUPS)
    assert (cfg.model._target_, cfg.data._target_, cfg.parallel.name) == (
        "src.components.models.MLP",
        "src.components.data.synthetic_classification",
        "single",
    )


def test_train_py_help_names_the_launchers_that_hydras_listing_leaves_out():
    """`python train.py --help` lists conf/'s groups and options itself, but not Hydra's
    (hydra/*): its footer names the launchers of conf/hydra/launcher/."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        footer = compose("config", return_hydra_config=True).hydra.help.footer
    launchers = options("hydra/launcher")
    assert launchers and all(f"hydra/launcher={name}" in footer for name in launchers), launchers


@pytest.mark.parametrize(
    "group, option", [(group, option) for group in GROUPS for option in options(group)]
)
def test_every_option_composes(compose_config, group, option):
    cfg = compose_config(f"{group}={option}")
    assert cfg[group] is not None


def test_command_line_contract(compose_config):
    cfg = compose_config(
        "trainer.max_steps=7",
        "trainer.batch_size=16",
        "seed=3",
        "model=transformer",
        "data=synthetic_tokens",
        "logger=none",
        "model.hidden=48",
        "model.depth=3",
    )
    assert (cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.seed) == (7, 16, 3)
    assert (cfg.model.hidden, cfg.model.depth, cfg.logger.wandb.enabled) == (48, 3, False)


@pytest.mark.parametrize("model", ["gpt", "gpt2_124m", "moe", "transformer"])
def test_token_models_bring_their_data_and_task(compose_config, model):
    """`model=gpt` alone trains a language model on token ids; a data= or task= given wins."""
    cfg = compose_config(f"model={model}")
    assert cfg.data._target_.endswith(".synthetic_tokens")
    assert cfg.task._target_.endswith(".LanguageModel")
    cfg = compose_config(f"model={model}", "data=tokens", "task=classification")
    assert cfg.data._target_.endswith(".tokens") and cfg.task._target_.endswith(".Classification")


@pytest.mark.parametrize(
    "override, error",
    [
        ("trainer.max_steps=abc", ValidationError),
        ("data.input_dim=1.5", ValidationError),
        ("trainer.max_stepz=3", ConfigAttributeError),
        ("model.widht=3", ConfigAttributeError),
        ("trainer.precision=fp64", ValidationError),
        ("trainer.accelerator=tpu", ValidationError),
        ("optimizer.decay_shape=sqrt", ValidationError),
    ],
)
def test_schema_rejects_bad_values_and_unknown_keys(compose_config, override, error):
    with pytest.raises(ConfigCompositionException) as caught:
        compose_config(override)
    assert isinstance(caught.value.__cause__, error)


@pytest.mark.parametrize(
    "model, data, input_shape",
    [
        ("mlp", "synthetic", (32,)),
        ("convnet", "synthetic", (1, 16, 16)),
        ("transformer", "synthetic_tokens", (32,)),
    ],
)
def test_models_build_from_config_and_run_forward(compose_config, model, data, input_shape):
    overrides = [f"model={model}", f"data={data}"]
    if model == "convnet":
        overrides.append("data.image_shape=[1,16,16]")
    cfg = compose_config(*overrides, "data.num_samples=64")
    dataset = build_data(cfg.data, 0)
    assert dataset.input_shape == input_shape
    net = instantiate(cfg.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes)
    assert isinstance(net, torch.nn.Sequential) and len(net) >= 3
    outputs = net(dataset.train.inputs[:4])
    assert outputs.shape[-1] == dataset.num_classes


def test_no_option_repeats_its_schemas_defaults():
    """Each default has one source, its schema in src/config/<group>.py: an option's YAML sets only
    the keys it changes (or that name the choice)."""
    for path in sorted((ROOT / "conf").glob("*/*.yaml")):
        options = OmegaConf.to_container(OmegaConf.load(path))
        schemas = [d for d in options.get("defaults", []) if str(d).startswith("/schema/")]
        if not schemas:
            continue  # a preset across groups (experiment/) or a Hydra plugin's settings
        schema, _, package = schemas[0].partition("@")
        _, _, group, name = schema.split("/")
        defaults = OmegaConf.to_container(OmegaConf.structured(SCHEMAS[group][name]))
        if package != "_here_":  # a global option (model=gpt brings data and task) nests its own
            options = options.get(package, {})
        repeated = [key for key in options if key != "defaults" and options[key] == defaults[key]]
        assert not repeated, f"{path.relative_to(ROOT)} repeats the schema's {repeated}"


@pytest.mark.parametrize("option", STRATEGIES)
def test_every_strategy_option_builds_the_class_it_names(compose_config, option):
    parallel = compose_config(f"parallel={option}").parallel
    strategy = build_strategy(parallel, "cpu")
    assert f"{type(strategy).__module__}.{type(strategy).__name__}" == parallel._target_
    assert strategy.name == option


@pytest.mark.parametrize("option", ["single", "dp", "dp_criterion", "model_parallel"])
def test_one_process_strategies_refuse_more_nodes(option):
    with pytest.raises(ConfigError, match=f"parallel={option} runs in one process, on one node"):
        build_strategy(parallel_config(option, nodes=2), "cpu")


@pytest.mark.parametrize("option, kind", [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)])
def test_every_optimizer_option_builds_with_its_settings(compose_config, option, kind):
    settings = compose_config(f"optimizer={option}").optimizer
    optimizer = build_optimizer(settings, torch.nn.Linear(2, 2).parameters())
    assert type(optimizer) is kind
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (settings.lr, settings.weight_decay)


def test_another_optimizer_class_does_not_get_the_options_own_keys(compose_config):
    """As for `model._target_` (tests/test_any_model.py): sgd's momentum and nesterov are left
    out for Adagrad, which does not take them; what it takes, and the template's keys, stay."""
    cfg = compose_config("optimizer=sgd", "optimizer._target_=torch.optim.Adagrad")
    settle_optimizer_settings(cfg)
    assert not {"momentum", "nesterov"} & set(cfg.optimizer)
    optimizer = build_optimizer(cfg.optimizer, torch.nn.Linear(2, 2).parameters())
    assert type(optimizer) is torch.optim.Adagrad and optimizer.param_groups[0]["lr"] == 0.05
    assert (cfg.optimizer.name, cfg.optimizer.schedule) == ("sgd", "cosine")


# Rates of 10 steps at optimizer.lr=1: 2 warm-up steps, then a decay towards 0.1 (min_lr_ratio)
# that reaches it at step 10; wsd's over the last 0.4 of the steps (6 to 9: progress 0, 1/4, 1/2,
# 3/4). A scheduler class's curve is all its own (StepLR: halved every 3 steps).
WARMED_UP = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
SCHEDULE_RATES = {
    "linear": [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125],
    "wsd linear": [*WARMED_UP, 1.0, 0.775, 0.55, 0.325],
    "wsd cosine": [*WARMED_UP, 1.0, 0.868198, 0.55, 0.231802],
    "wsd 1-sqrt": [*WARMED_UP, 1.0, 0.55, 0.363604, 0.220577],
    "torch.optim.lr_scheduler.StepLR": [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125],
}


@pytest.mark.parametrize("schedule", SCHEDULE_RATES)
def test_each_schedule_gives_its_learning_rates(compose_config, schedule):
    name, _, shape = schedule.partition(" ")
    overrides = ["optimizer.lr=1", "optimizer.warmup_steps=2", f"optimizer.schedule={name}"]
    if shape:
        overrides += ["optimizer.decay_fraction=0.4", f"optimizer.decay_shape={shape}"]
    if name.startswith("torch."):
        overrides += ["+optimizer.schedule_args.step_size=3", "+optimizer.schedule_args.gamma=0.5"]
    lr_at = lr_schedule(compose_config(*overrides).optimizer, 10)
    assert [lr_at(step) for step in range(10)] == pytest.approx(SCHEDULE_RATES[schedule], rel=1e-5)


def test_a_group_s_setting_may_interpolate_another_group_s(compose_config):
    """`trainer.eval_batch_size=${model.hidden}` is read as the model's width wherever the
    trainer's settings are checked and typed (once a traceback: the schema has no `model`)."""
    cfg = compose_config("trainer.eval_batch_size=${model.hidden}", "model.hidden=48")
    assert typed(TrainerConfig, cfg.trainer).eval_batch_size == 48


# What `@hydra.main` does with a command's overrides, as `hydra._internal.utils._run_app` does it
# (run mode, no -m): read the mode, then compose the run's config (or the error composing it),
# with Hydra's own class or `composing_once`'s; and how many compositions that took.
MAIN_COMPOSES = """
import json, sys
from hydra._internal import hydra as hydra_internal
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_automatic_config_search_path
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf
from src.config.schema import register_configs
from src.launch.composing import RUN_MODE_OVERRIDE, ComposingOnce

register_configs()
compositions = []
load_configuration = ConfigLoaderImpl.load_configuration
ConfigLoaderImpl.load_configuration = lambda *args, **kwargs: (
    compositions.append(1) or load_configuration(*args, **kwargs)
)
overrides = json.loads(sys.argv[1])
search_path = create_automatic_config_search_path("train.py", None, "conf")
for hydra_class in (hydra_internal.Hydra, ComposingOnce):
    compositions.clear()
    GlobalHydra.instance().clear()
    hydra = hydra_class.create_main_hydra2("train", search_path)
    mode = hydra.get_mode("config", list(overrides))
    try:
        if mode is None:
            cfg = hydra.compose_config(
                "config", [*overrides, RUN_MODE_OVERRIDE], RunMode.RUN, with_log_configuration=True
            )
            composed = OmegaConf.to_yaml(cfg)
        else:
            composed = None
    except Exception as error:
        composed = repr(error)
    print(json.dumps([str(mode), composed, len(compositions)]))
"""


@pytest.mark.parametrize(
    "overrides, mode, compositions",
    [
        (["parallel=ddp", "trainer.max_steps=3"], "None", (2, 1)),
        # The mode only (the sweep composes afresh), from a run's composition.
        (["hparams_search=optimizer_optuna"], "RunMode.MULTIRUN", (1, 1)),
        (["trainer.max_step=3"], "None", (2, 2)),  # an error: Hydra's two tries, no third
        (["parallel=single,ddp"], "None", (2, 2)),  # sweeps, without -m: Hydra's error
    ],
)
def test_a_run_composes_its_config_once_as_hydra_composes_it_twice(overrides, mode, compositions):
    """`composing_once` (train.py's, eval.py's): the mode, and the config a run gets (or the
    error), are Hydra's, from one composition where Hydra makes two."""
    lines = subprocess.run(
        [sys.executable, "-c", MAIN_COMPOSES, json.dumps(overrides)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    hydra, once = (json.loads(line) for line in lines[-2:])
    assert once[:2] == hydra[:2] and hydra[0] == mode
    assert (hydra[2], once[2]) == compositions
