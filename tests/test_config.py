"""The shipped `conf/` composes, validates and builds what it names."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import ConfigAttributeError, ValidationError

from src.data import build_data

GROUPS = ("model", "data", "parallel", "trainer", "optimizer", "logger")


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (ROOT / "conf" / group).glob("*.yaml"))


def test_default_config_has_every_group(compose_config):
    cfg = compose_config()
    assert all(group in cfg for group in GROUPS)
    assert (cfg.model._target_, cfg.data._target_, cfg.parallel.name) == (
        "src.models.MLP",
        "src.data.synthetic_classification",
        "single",
    )


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
    assert (cfg.model.hidden, cfg.model.depth, cfg.logger.name) == (48, 3, "none")


@pytest.mark.parametrize(
    "override, error",
    [
        ("trainer.max_steps=abc", ValidationError),
        ("data.input_dim=1.5", ValidationError),
        ("trainer.max_stepz=3", ConfigAttributeError),
        ("model.widht=3", ConfigAttributeError),
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
