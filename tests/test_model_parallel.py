"""`parallel=model_parallel`: stages, split points, the GPipe schedule, and the same training as
`single` through the real `train.py`."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import (
    TINY_SGD,
    TINY_TRANSFORMER_SGD,
    assert_same_optimizer_state,
    assert_same_training,
    checkpoint,
    needs_gpus,
    parallel_config,
    reference_run,
    run_train,
    summary,
    sweep_runs,
)
from odd_models import FloatBoundaryMLP, StructuredMLP
from omegaconf import DictConfig

from src.components.models import GPT, MLP
from src.components.tasks import loss_sum
from src.parallel import build_strategy
from src.parallel.base import ConfigError
from src.parallel.pp.costs import schedule_bubble
from src.parallel.pp.cut import balanced_split_points, parameter_count
from src.parallel.stages.pipeline import Pipeline, gpipe_ticks

# TINY's MLP: three 32->32 hidden blocks of 1056 parameters, then a 330-parameter head.
TINY_MLP = {"input_shape": (32,), "num_classes": 10, "hidden": 32, "depth": 3}
CPU = torch.device("cpu")


def pipeline_config(**settings) -> DictConfig:
    return parallel_config("model_parallel", **settings)


# ------------------------------------------------------------------------------ stage layout


def largest_stage(sizes: list[int], points: list[int]) -> int:
    bounds = [0, *points, len(sizes)]
    return max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_balanced_split_is_the_best_contiguous_partition(stages):
    sizes = [7, 1, 1, 5, 2, 2, 9, 3]
    points = balanced_split_points(sizes, stages)
    assert len(points) == stages - 1 and points == sorted(set(points))
    assert all(0 < p < len(sizes) for p in points)
    best = min(
        largest_stage(sizes, list(cuts))
        for cuts in itertools.combinations(range(1, len(sizes)), stages - 1)
    )
    assert largest_stage(sizes, points) == best


def test_default_split_balances_parameters_and_shares_the_blocks():
    model = MLP(**TINY_MLP)
    pipeline = Pipeline(model, [CPU, CPU], microbatches=1)

    assert pipeline.split_points == [2]
    assert [parameter_count(stage) for stage in pipeline.stages] == [2 * 1056, 1056 + 330]
    assert [block for stage in pipeline.stages for block in stage] == list(model)
    assert list(pipeline.parameters()) == list(model.parameters())


def test_explicit_split_points_give_those_stages():
    model = MLP(**TINY_MLP)
    pipeline = Pipeline(model, [CPU, CPU, CPU], microbatches=1, split_points=[1, 3])
    assert [len(stage) for stage in pipeline.stages] == [1, 2, 1]
    assert pipeline.describe()["stage_parameters"] == [1056, 2112, 330]


def test_gpipe_ticks_run_every_micro_batch_through_every_stage_in_order():
    stages, microbatches = 3, 4
    ticks = list(gpipe_ticks(stages, microbatches))
    assert len(ticks) == microbatches + stages - 1
    done_at = {pair: t for t, tick in enumerate(ticks) for pair in tick}
    assert sorted(done_at) == list(itertools.product(range(stages), range(microbatches)))
    for (stage, micro), tick in done_at.items():
        assert tick == stage + micro
    busy = sum(len(tick) for tick in ticks)
    idle = 1 - busy / (stages * len(ticks))
    assert idle == pytest.approx(schedule_bubble(stages, 1, microbatches))


@pytest.mark.equivalence
def test_uneven_micro_batches_give_the_full_batch_loss_and_gradients():
    torch.manual_seed(0)
    model = MLP(**TINY_MLP)
    inputs, targets = torch.randn(10, 32), torch.randint(0, 10, (10,))
    loss_sum(model(inputs), targets).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    total = Pipeline(model, [CPU, CPU], microbatches=3)(inputs, targets, loss_sum)  # 4 + 3 + 3
    total.backward()
    torch.testing.assert_close(total, loss_sum(model(inputs), targets))
    for grad, parameter in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, grad)


def test_balanced_split_cuts_only_where_allowed():
    sizes = [7, 1, 1, 5, 2, 2, 9, 3]
    assert balanced_split_points(sizes, 2) == [4]
    assert balanced_split_points(sizes, 2, cuttable={3, 6}) == [6]
    assert balanced_split_points(sizes, 3, cuttable={3, 6}) == [3, 6]
    assert balanced_split_points(sizes, 3, cuttable={3}) is None


def test_tuples_lists_and_dicts_cross_stages_with_the_full_batch_gradients():
    torch.manual_seed(0)
    model = StructuredMLP(**TINY_MLP)  # its boundaries carry a tuple, a dict and a list
    inputs, targets = torch.randn(10, 32), torch.randint(0, 10, (10,))
    loss_sum(model(inputs), targets).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    total = Pipeline(model, [CPU] * 4, microbatches=3)(inputs, targets, loss_sum)
    total.backward()
    torch.testing.assert_close(total, loss_sum(model(inputs), targets))
    for grad, parameter in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, grad)


def test_the_automatic_split_avoids_a_boundary_that_is_not_tensors():
    with torch.device("meta"):
        model = FloatBoundaryMLP(**TINY_MLP)  # block 1 returns (tensor, float)
        inputs = torch.empty(2, 32)
    assert balanced_split_points([parameter_count(b) for b in model], 2) == [2]

    def planned(**settings) -> list[int]:
        stage_cut = build_strategy(pipeline_config(**settings), "cpu").stage_cut
        stage_cut.choose_cuts(model, inputs)
        return stage_cut.split_points

    assert planned(devices=2) == [1]
    assert planned(devices=3) == [1, 3]
    with pytest.raises(ConfigError, match="no stage can start at block 2 .block 1 returns a tuple"):
        planned(devices=4)
    with pytest.raises(ConfigError, match="block 1 returns a tuple holding a float, which cannot"):
        planned(devices=2, split_points=[2])


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"microbatches": 0}, "parallel.microbatches must be at least 1"),
        ({"split_points": [1, 2]}, "has 2 entries but parallel.devices=2"),
        ({"devices": 3, "split_points": [2, 2]}, "strictly increasing"),
        ({"devices": 3, "split_points": [3, 1]}, "strictly increasing"),
        ({"split_points": [0]}, "strictly increasing block indices above 0"),
    ],
)
def test_bad_settings_are_refused_before_any_work(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_strategy(pipeline_config(**settings), "cpu")


def test_too_few_samples_for_the_micro_batches_is_refused():
    strategy = build_strategy(pipeline_config(microbatches=8), "cpu")
    strategy.check_batch(8)
    with pytest.raises(ConfigError, match="too few for parallel.microbatches=8"):
        strategy.check_batch(7)


def test_split_points_and_stages_are_checked_against_the_model():
    with torch.device("meta"):
        model, inputs = MLP(**TINY_MLP), torch.empty(2, 32)
    with pytest.raises(ConfigError, match="parallel.devices=5 stages but the model has only 4"):
        build_strategy(pipeline_config(devices=5), "cpu").check_model(model, inputs)
    too_far = build_strategy(pipeline_config(split_points=[4]), "cpu")
    with pytest.raises(ConfigError, match=r"split_points=\[4\] reaches past the model's last"):
        too_far.check_model(model, inputs)
    with pytest.raises(ValueError, match=r"4 blocks cannot be cut into 2 stages at \[4\]"):
        Pipeline(MLP(**TINY_MLP), [CPU, CPU], microbatches=1, split_points=[4])


# ---------------------------------------------------------------------- same training as single


@pytest.mark.equivalence
@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("workload", [TINY_SGD, TINY_TRANSFORMER_SGD], ids=["mlp", "transformer"])
def test_model_parallel_trains_exactly_like_single(workload, microbatches):
    runs = sweep_runs(*workload, "parallel=model_parallel", "parallel.microbatches=1,4")
    run_dir = runs[f"parallel.microbatches={microbatches}"]
    assert_same_training(reference_run(*workload), run_dir)

    result = summary(run_dir)
    assert result["strategy"] == "model_parallel" and result["stages"] == 2
    assert result["microbatches"] == microbatches
    assert result["bubble_fraction"] == pytest.approx(1 / (microbatches + 1))
    assert "bubble (idle) fraction" in (run_dir / "train.log").read_text()


def test_blocks_that_hand_on_tuples_dicts_and_lists_train_exactly_like_single(tmp_path):
    workload = (*TINY_SGD, "model._target_=tests.odd_models.StructuredMLP")
    pipelined = ("parallel=model_parallel", "parallel.devices=4", "parallel.microbatches=2")
    run_train(*workload, *pipelined, run_dir=tmp_path)
    assert_same_training(reference_run(*workload), tmp_path)
    assert summary(tmp_path)["split_points"] == [1, 2, 3]  # a tuple, a dict and a list cross


@pytest.mark.equivalence
def test_checkpoints_load_between_model_parallel_and_single(tmp_path):
    # Explicit, uneven layout on purpose: 3 stages at [1, 3], 5 micro-batches of a batch of 24.
    run_train(
        *TINY_SGD,
        "parallel=model_parallel",
        "parallel.devices=3",
        "parallel.split_points=[1,3]",
        "parallel.microbatches=5",
        run_dir=tmp_path,
    )
    single_dir = reference_run(*TINY_SGD)
    assert_same_training(single_dir, tmp_path)
    assert summary(tmp_path)["split_points"] == [1, 3]
    # Optimizer state has single's layout (the optimizer is built on the unwrapped model).
    assert_same_optimizer_state(single_dir, tmp_path)

    # model_parallel -> single: the checkpoint loads into a plain model.
    single_model = MLP(**TINY_MLP)
    single_model.load_state_dict(checkpoint(tmp_path)["model"])
    # single -> model_parallel: loads through `unwrap`, computes the same, and saves back the same.
    strategy = build_strategy(pipeline_config(devices=3, microbatches=2), "cpu")
    strategy.setup()
    pipelined = strategy.wrap(MLP(**TINY_MLP))
    strategy.unwrap(pipelined).load_state_dict(single_model.state_dict())
    inputs, targets = torch.randn(6, 32), torch.randint(0, 10, (6,))
    with torch.no_grad():
        total = strategy.apply(pipelined, inputs, targets, loss_sum)
        torch.testing.assert_close(total, loss_sum(single_model(inputs), targets))
    saved_again = strategy.unwrap(pipelined).state_dict()
    assert saved_again.keys() == single_model.state_dict().keys()
    for key, value in single_model.state_dict().items():
        assert torch.equal(saved_again[key], value)


# ------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@needs_gpus(2)
def test_each_stage_lives_on_its_own_gpu():
    strategy = build_strategy(pipeline_config(devices=2, microbatches=4), "cuda")
    strategy.setup()
    model = strategy.wrap(MLP(**TINY_MLP))
    for stage, device in zip(model.stages, [torch.device("cuda", i) for i in (0, 1)], strict=True):
        assert {p.device for p in stage.parameters()} == {device}

    inputs, targets = torch.randn(8, 32), torch.randint(0, 10, (8,))
    total = strategy.apply(model, inputs, targets, loss_sum)
    assert total.device == torch.device("cuda", 1)
    total.backward()
    assert all(p.grad.device == p.device for p in model.parameters())


@pytest.mark.cuda
@needs_gpus(2)
def test_a_weight_tied_across_gpus_stays_on_the_first_stage_and_gets_both_uses_gradients():
    """GPT's head on cuda:1 runs on a copy of the embedding's weight, which lives on cuda:0 and
    gets the gradient of both uses, as the CPU model's one weight does."""
    torch.manual_seed(0)
    model = GPT(input_shape=(4,), num_classes=8, n_layer=2, n_head=2, n_embd=8)
    single_model = copy.deepcopy(model)
    devices = [torch.device("cuda", i) for i in (0, 1)]
    pipelined = Pipeline(model, devices, microbatches=2, split_points=[2])
    inputs, targets = torch.randint(0, 8, (4, 4)), torch.randint(0, 8, (4, 4))
    total = pipelined(inputs, targets, loss_sum)
    expected = loss_sum(single_model(inputs), targets)
    torch.testing.assert_close(total.cpu(), expected)
    total.backward()
    expected.backward()
    assert model[0].token.weight is model[-1][1].weight
    assert model[0].token.weight.device == devices[0]
    for (name, parameter), (_, alone) in zip(
        model.named_parameters(), single_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(parameter.grad.cpu(), alone.grad, msg=name)
