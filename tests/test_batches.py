"""Structured batches: inputs, targets and outputs that are dicts (or tuples) of tensors, carried
by the data, the loop and every strategy. A model fed a dict and returning a dict, scored by a
task of a user's own (`tests/odd_*.py`), trains like `single` everywhere."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import BESIDES_SINGLE, TINY_SGD, assert_same_training, strategy_runs, summary
from odd_data import halves_and_values
from odd_models import DictInDictOutMLP
from odd_tasks import LabelAndValue
from torch.utils._pytree import tree_flatten

from src.components.batch_order import SplitSamples, ValBatches, train_batches
from src.config.base import ConfigError
from src.parallel.stages.pipeline import Pipeline
from src.training.build import check_config

DICTS = (
    *TINY_SGD,
    "data._target_=tests.odd_data.halves_and_values",
    "model._target_=tests.odd_models.DictInDictOutMLP",
    "task._target_=tests.odd_tasks.LabelAndValue",
    # Each strategy's weight average, evaluated and checkpointed at step 3 (tests/test_ema.py).
    "trainer.ema_decay=0.5",
    "trainer.ema_eval=true",
    "trainer.checkpoint_every=3",
)


def same(expected, actual) -> bool:
    """Whether two batches have one structure and equal tensors."""
    (expected_leaves, expected_spec), (leaves, spec) = tree_flatten(expected), tree_flatten(actual)
    return spec == expected_spec and all(map(torch.equal, expected_leaves, leaves))


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", BESIDES_SINGLE)
def test_dict_inputs_outputs_and_targets_train_like_single(strategy):
    runs = strategy_runs(*DICTS)
    run_dir = runs[strategy]
    assert summary(run_dir)["strategy"] == strategy
    assert_same_training(runs["single"], run_dir)
    assert 0 <= summary(run_dir)["val_value_mse"] < summary(run_dir)["final_val_loss"]


def test_dict_batches_through_the_loader_equal_the_in_memory_ones():
    data = halves_and_values(
        0, input_dim=6, num_classes=3, num_samples=130, val_fraction=0.1, test_fraction=0.1
    )
    direct = train_batches(data.train, 12, 7, rank=1, world_size=2)
    through_loader = train_batches(SplitSamples(data.train), 12, 7, 1, 2, start_batch=5)
    for expected, got in zip(itertools.islice(direct, 5, 15), through_loader, strict=False):
        assert same(expected, got)
    for (inputs, targets, _), (loaded_inputs, loaded_targets, _) in zip(
        ValBatches(data.val, 5, 0, 2), ValBatches(SplitSamples(data.val), 5, 0, 2), strict=True
    ):
        assert same((inputs, targets), (loaded_inputs, loaded_targets))


def test_pipeline_micro_batches_of_dicts_give_the_full_batch_gradients():
    torch.manual_seed(0)
    data = halves_and_values(
        0, input_dim=6, num_classes=3, num_samples=40, val_fraction=0.5, test_fraction=0.1
    )
    inputs, targets = data.train[:10]
    model, task = (
        DictInDictOutMLP(input_shape=(6,), num_classes=3, hidden=8, depth=2),
        LabelAndValue(),
    )
    expected_total = task.sums(model(inputs), targets)
    expected_total[0].backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    total = Pipeline(model, [torch.device("cpu")] * 2, microbatches=3)(inputs, targets, task.sums)
    total[0].backward()  # micro-batches of 4, 3 and 3 samples
    torch.testing.assert_close(total, expected_total)
    for grad, parameter in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, grad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "model._target_=tests.odd_models.DictInDictOutMLP",
                "data._target_=tests.odd_data.halves_and_values",
            ],
            "returns outputs shaped {'logits': [2, 10], 'value': [2]} for inputs shaped {'left': "
            "[2, 16], 'right': [2, 16]} and targets shaped {'label': [2], 'value': [2]}, but for "
            "Classification the outputs must be one tensor, not a dict",
        ),
        (
            ["task._target_=tests.odd_tasks.LabelAndValue", "parallel=ddp"],
            "which LabelAndValue cannot score (IndexError: too many indices",
        ),
        (
            ["model._target_=tests.odd_models.ListOutputMLP", "parallel=dp"],
            "for Classification the outputs must be one tensor, not a list; return one from the "
            "model, or name a task of your own that takes a list (task._target_)",
        ),
    ],
    ids=["dict-model-builtin-task", "tensor-model-dict-task", "list-output"],
)
def test_a_model_and_task_that_do_not_fit_are_refused_before_any_work(
    compose_config, tmp_path, overrides, message
):
    cfg = compose_config(*TINY_SGD, *overrides)
    with pytest.raises(ConfigError) as refused:
        check_config(cfg, tmp_path)
    assert message in str(refused.value) and "\n" not in str(refused.value)
