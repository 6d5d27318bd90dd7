"""Tasks (`task=`): what is optimised and measured, as sums that every strategy adds up."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    TINY,
    TINY_SGD,
    TINY_TRANSFORMER,
    TINY_TRANSFORMER_SGD,
    assert_goes_on_exactly,
    assert_same_training,
    metrics,
    reference_run,
    resumed_sweep_runs,
    run_train,
    strategy_runs,
    summary,
)

from src.components.tasks import Classification, Regression, Segmentation

SEGMENTATION = (
    *TINY_SGD,
    "model=fcn",
    "data=synthetic_segmentation",
    "task=segmentation",
    "data.num_samples=200",
    "data.image_shape=[2,6,6]",
    "data.ignore_fraction=0.3",
    "model.hidden=8",
    "model.depth=2",
    "trainer.accumulate=2",
)


def test_segmentation_sums_of_parts_give_the_whole_batchs_figures():
    torch.manual_seed(0)
    task = Segmentation(ignore_index=-1)
    outputs, targets = torch.randn(6, 3, 4, 4), torch.randint(-1, 3, (6, 4, 4))
    whole = task.sums(outputs, targets)
    parts = task.sums(outputs[:2], targets[:2]) + task.sums(outputs[2:], targets[2:])
    torch.testing.assert_close(parts, whole)
    count = task.count(targets).item()
    kept = targets != -1
    expected_loss = torch.nn.functional.cross_entropy(outputs, targets, ignore_index=-1)
    figures = task.figures(whole.tolist(), count)
    assert figures["loss"] == pytest.approx(expected_loss.item(), rel=1e-5)
    predicted = outputs.argmax(1)
    accuracy = (predicted == targets)[kept].float().mean().item()
    assert figures["pixel_accuracy"] == pytest.approx(accuracy)
    ious = []
    for c in range(3):
        truth, guess = targets[kept] == c, predicted[kept] == c
        ious.append((truth & guess).sum() / (truth | guess).sum())
    assert figures["mean_iou"] == pytest.approx(torch.stack(ious).mean().item())


def test_classification_counts_argmax_s_predictions_ties_and_nan_included():
    """The accuracy takes max's indices (faster on CPUs): the prediction stays argmax's, the
    first maximum, where logits tie (a zero-initialised head) or one is NaN."""
    logits = torch.tensor([[0.0, 0.0, 0.0], [1.0, 3.0, 3.0], [2.0, float("nan"), 5.0]])
    assert logits.argmax(-1).tolist() == [0, 1, 1]
    correct = Classification().sums(logits, torch.tensor([0, 1, 1]))[1]
    assert correct.item() == 3
    assert Classification().sums(logits, torch.tensor([1, 2, 2]))[1].item() == 0


def test_regression_is_mean_squared_and_absolute_error():
    outputs, targets = torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.zeros(2, 2)
    task = Regression()
    assert task.figures(task.sums(outputs, targets).tolist(), task.count(targets)) == {
        "loss": 1.5,
        "mae": 1.0,
    }


@pytest.mark.parametrize("strategy", ["ddp", "dp_criterion"])
def test_segmentation_with_ignored_pixels_trains_as_single(strategy):
    """The ranks' shares hold different numbers of counted pixels: each step's loss is still the
    mean over the whole batch's counted pixels."""
    runs = strategy_runs(*SEGMENTATION, strategies=("ddp", "dp_criterion"))
    assert_same_training(runs["single"], runs[strategy])
    figures = summary(runs[strategy])
    assert {"final_val_loss", "val_pixel_accuracy", "val_mean_iou"} <= figures.keys()


def test_language_model_reports_perplexity(tmp_path):
    run_train(*TINY_TRANSFORMER, "task=language_model", run_dir=tmp_path)
    figures = summary(tmp_path)
    assert figures["val_perplexity"] == pytest.approx(math.exp(figures["final_val_loss"]))
    assert "train/perplexity" in metrics(tmp_path)[0]


def test_regression_trains_an_mlp(tmp_path):
    regression = ("data=synthetic_regression", "task=regression", "optimizer.lr=0.01")
    run_train(*TINY, *regression, "trainer.max_steps=12", "trainer.eval_every=4", run_dir=tmp_path)
    val_losses = [row["val/loss"] for row in metrics(tmp_path) if "val/loss" in row]
    assert val_losses[-1] < val_losses[0]
    assert "val_mae" in summary(tmp_path)


def test_a_task_from_outside_src_trains_under_ddp_as_under_single(tmp_path):
    own_task = (*TINY_SGD, "task._target_=tests.odd_tasks.BrierScore")
    run_train(*own_task, "parallel=ddp", "parallel.devices=2", run_dir=tmp_path)
    assert_same_training(reference_run(*own_task), tmp_path)
    assert 0 <= summary(tmp_path)["val_accuracy"] <= 1


def test_a_model_whose_output_the_task_cannot_take_is_one_line(tmp_path):
    result = run_train(
        *TINY, "model=fcn", "data=synthetic_segmentation", run_dir=tmp_path, check=False
    )
    assert result.returncode == 2
    expected = "for Classification it must be [2, 16, 16] (the targets' shape) + [classes]"
    assert expected in result.stdout


GPT_RUN = (
    *(setting for setting in TINY_TRANSFORMER_SGD if not setting.startswith("model")),
    "model=gpt",
    "task=language_model",
    "model.n_embd=16",
    "model.n_head=2",
    "model.n_layer=2",
    "trainer.grad_clip=0.05",  # clips every step: a tied weight counted twice would show
    "trainer.checkpoint_every=3",
)


TIED = ("dp", "ddp", "fsdp", "model_parallel", "hybrid", "pp")


@pytest.mark.parametrize("strategy", TIED)
def test_gpt_with_tied_weights_trains_as_single(strategy):
    """model_parallel and pp put the embedding and the head it shares a weight with on two
    stages; pp's two processes each hold a copy, their gradients summed before clipping, whose
    norm counts the weight once."""
    runs = strategy_runs(*GPT_RUN, strategies=TIED)
    assert_same_training(runs["single"], runs[strategy])


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", ["pp", "single"])
def test_a_weight_tied_across_pipeline_ranks_resumes_exactly_across_layouts(layout):
    """pp resumes single's step-3 checkpoint (full) and single pp's (sharded: each rank's copy,
    its optimizer state under the embedding's name, written once)."""
    runs = strategy_runs(*GPT_RUN, strategies=TIED)
    step_3 = {name: runs[name] / "checkpoints" / "step-000003" for name in ("single", "pp")}
    resume = {"parallel=pp": step_3["single"], "parallel=single": step_3["pp"]}
    resumed = resumed_sweep_runs(*GPT_RUN, "parallel=pp,single", resume=resume)
    assert_goes_on_exactly(runs["single"], resumed[f"parallel={layout}"], [4, 5, 6])
