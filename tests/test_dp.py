"""`parallel=dp` and `parallel=dp_criterion`: the replica data flow (scatter, replicate, parallel
apply, gather or per-device loss), on CPU threads here and on real GPUs in the cuda tests."""

from __future__ import annotations

import collections
import copy
import logging
import math
import re
import threading

import pytest
import torch
from helpers import (
    TINY_SGD,
    assert_same_training,
    needs_gpus,
    parallel_config,
    reference_run,
    run_sweep,
    run_train,
    summary,
    sweep_runs,
)
from torch import nn

from src.components.models import MLP, Transformer
from src.components.tasks import loss_sum
from src.observe.report import markdown_table
from src.observe.sweep_rows import Row
from src.parallel import build_strategy
from src.parallel.replicas.apply import DataParallel, gather, parallel_criterion

CPU = torch.device("cpu")
UNEVEN = (*TINY_SGD, "trainer.batch_size=25")  # 13+12 on 2 devices, 9+9+7 on 3


@pytest.mark.equivalence
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", ["dp", "dp_criterion"])
def test_train_py_matches_single(name, devices):
    runs = sweep_runs(*UNEVEN, "parallel=dp,dp_criterion", "parallel.devices=2,3")
    run_dir = runs[f"parallel={name} parallel.devices={devices}"]
    assert_same_training(reference_run(*UNEVEN), run_dir)
    result = summary(run_dir)
    assert result["strategy"] == name and result["devices"] == devices
    assert result["world_size"] == 1 and len(result["peak_memory_mb"]) == 1


# The tiny MLP noting its forward passes' threads, its first steps' tensor memory counted (the
# default).
THREAD_NOTING = (
    *(override for override in TINY_SGD if not override.startswith("trainer.count_tensor_memory")),
    "model._target_=tests.odd_models.ThreadNotingMLP",
)


def test_every_training_step_runs_its_replicas_in_threads_of_their_own(tmp_path):
    """The first steps too, whose tensor memory is counted under a dispatch mode, which is
    thread-local: the count sees dp's steps as dp runs them."""
    run_train(*THREAD_NOTING, "parallel=dp", run_dir=tmp_path)

    log_text = (tmp_path / "train.log").read_text()
    threads = re.findall(r"training forward in (.+)", log_text)
    steps = [threads[i : i + 2] for i in range(0, len(threads), 2)]  # 2 replicas a step
    assert len(steps) == 6
    for step, names in enumerate(steps, 1):
        assert len(set(names)) == 2 and "MainThread" not in names, (step, names)
    assert not math.isnan(summary(tmp_path)["tensor_peak_mb"][0])


# ------------------------------------------------------------------- the strategies, in process


def strategy_step(name, devices, model, inputs, targets, fn=loss_sum, device_type="cpu"):
    """One forward/backward through the strategy: (loss sum, gradients by parameter name)."""
    strategy = build_strategy(parallel_config(name, devices=devices), device_type)
    strategy.setup()
    wrapped = strategy.wrap(copy.deepcopy(model))
    total = strategy.apply(wrapped, inputs, targets, fn)
    (total / len(targets)).backward()
    grads = {key: p.grad.cpu() for key, p in strategy.unwrap(wrapped).named_parameters()}
    return total.cpu(), grads


def full_batch_step(model, inputs, targets, fn=loss_sum):
    model = copy.deepcopy(model)
    total = fn(model(inputs), targets)
    (total / len(targets)).backward()
    return total, {key: p.grad for key, p in model.named_parameters()}


def assert_same_step(expected, actual):
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=1e-5)
    assert actual[1].keys() == expected[1].keys()
    for key, grad in expected[1].items():
        torch.testing.assert_close(actual[1][key], grad, rtol=0, atol=1e-6, msg=key)


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["dp", "dp_criterion"])
@pytest.mark.parametrize(("devices", "batch"), [(4, 5), (3, 25), (4, 2)])
def test_loss_and_gradients_equal_the_full_batch_on_uneven_splits(name, devices, batch):
    torch.manual_seed(0)
    mlp = MLP(input_shape=(6,), num_classes=4, hidden=8, depth=2)
    inputs, targets = torch.randn(batch, 6), torch.randint(0, 4, (batch,))
    expected = full_batch_step(mlp, inputs, targets)
    assert_same_step(expected, strategy_step(name, devices, mlp, inputs, targets))


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["dp", "dp_criterion"])
def test_sequence_outputs_split_on_the_batch_dimension(name):
    torch.manual_seed(0)
    model = Transformer(input_shape=(5,), num_classes=7, hidden=8, depth=1, heads=2)
    inputs, targets = torch.randint(0, 7, (5, 5)), torch.randint(0, 7, (5, 5))
    expected = full_batch_step(model, inputs, targets)
    assert_same_step(expected, strategy_step(name, 3, model, inputs, targets))


class TwoHeads(nn.Module):
    def __init__(self, as_dict: bool):
        super().__init__()
        self.as_dict = as_dict
        self.logits = nn.Linear(6, 4)
        self.score = nn.Linear(6, 1)

    def forward(self, x):
        logits, score = self.logits(x), self.score(x)
        return {"logits": logits, "score": score} if self.as_dict else (logits, score)


def two_head_loss(outputs, targets):
    logits, score = (outputs["logits"], outputs["score"]) if isinstance(outputs, dict) else outputs
    return loss_sum(logits, targets) + score.square().sum()


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["dp", "dp_criterion"])
@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_tuple_and_dict_outputs(name, as_dict):
    torch.manual_seed(0)
    model = TwoHeads(as_dict)
    inputs, targets = torch.randn(5, 6), torch.randint(0, 4, (5,))
    expected = full_batch_step(model, inputs, targets, two_head_loss)
    actual = strategy_step(name, 4, model, inputs, targets, two_head_loss)
    assert_same_step(expected, actual)


def test_check_batch_allows_uneven_splits_and_warns_about_idle_devices(caplog):
    strategy = build_strategy(parallel_config("dp", devices=4), "cpu")
    with caplog.at_level(logging.WARNING):
        strategy.check_batch(5)
        assert not caplog.records
        strategy.check_batch(3)
    assert "only 3 devices get work" in caplog.text


# ----------------------------------------------------------------------------- the replica flow


class Recorder(nn.Module):
    """Scales by a weight and notes, per call, its thread and its inputs' sizes with `record`, a
    function attribute that the replicas (copies) share."""

    def __init__(self, record):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.record = record

    def forward(self, x, scale, offset=0.0):
        self.record((threading.current_thread().name, len(x), len(scale), offset))
        return x * self.weight * scale + offset


@pytest.mark.parametrize(("batch", "chunks"), [(5, [2, 2, 1]), (9, [3, 3, 3]), (2, [1, 1])])
@pytest.mark.parametrize("call", ["positional", "keyword", "keyword-only"])
def test_replicas_run_in_their_own_threads_on_chunks_of_every_input(batch, chunks, call):
    """As torch's `scatter_kwargs`: keyword inputs are split like positional ones (keyword-only
    ones too: there was once nothing to split them by), anything but a tensor goes whole."""
    calls = []
    recorder = Recorder(calls.append)
    model = DataParallel(recorder, [CPU] * 4, gather_outputs=True)
    x, scale = torch.arange(batch, dtype=torch.float32), torch.full((batch,), 2.0)
    if call == "positional":
        output = model(x, scale, 1.0)
    elif call == "keyword":
        output = model(x, scale=scale, offset=1.0)
    else:
        output = model(x=x, scale=scale, offset=1.0)

    torch.testing.assert_close(output, x * 2 + 1)  # gathered in order
    assert sorted(size for _, size, _, _ in calls) == sorted(chunks)
    assert all(x_size == scale_size and offset == 1.0 for _, x_size, scale_size, offset in calls)
    threads = {thread for thread, *_ in calls}
    assert len(threads) == len(chunks) and threading.current_thread().name not in threads
    output.sum().backward()
    assert recorder.weight.grad == (x * 2).sum()  # every replica's gradient summed


Point = collections.namedtuple("Point", ["x", "y"])


def test_gather_keeps_structure_none_and_stacks_scalars_as_torch_does():
    parts = [
        {"loss": torch.tensor(1.0), "pair": (torch.ones(2, 3), Point(torch.zeros(2), None))},
        {"loss": torch.tensor(2.0), "pair": (torch.ones(1, 3), Point(torch.ones(1), None))},
    ]
    gathered = gather(parts, CPU)
    assert list(gathered) == ["loss", "pair"]
    torch.testing.assert_close(gathered["loss"], torch.tensor([1.0, 2.0]))  # 0-dim: stacked
    assert isinstance(gathered["pair"], tuple) and gathered["pair"][0].shape == (3, 3)
    point = gathered["pair"][1]
    assert isinstance(point, Point) and point.y is None
    torch.testing.assert_close(point.x, torch.tensor([0.0, 0.0, 1.0]))
    assert gather([[torch.ones(1)], [torch.ones(2)]], CPU)[0].shape == (3,)  # a list stays one


def test_gather_refuses_dicts_whose_keys_differ_between_replicas():
    parts = [{"logits": torch.ones(2)}, {"scores": torch.ones(2)}]
    with pytest.raises(ValueError, match="replica 1 returned a dict with keys .'scores'. but"):
        gather(parts, CPU)


class ScalarAndNone(nn.Module):
    """Returns a per-replica 0-dim loss, no auxiliary output, and per-sample logits."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, features):
        logits = self.layer(features)
        return {"loss": logits.square().sum(), "aux": None, "logits": logits}


def test_a_model_returning_scalars_and_none_runs_under_dp():
    inputs = torch.randn(5, 3)
    outputs = DataParallel(ScalarAndNone(), [CPU] * 3, gather_outputs=True)(features=inputs)
    assert outputs["aux"] is None and outputs["loss"].shape == (3,)
    torch.testing.assert_close(outputs["loss"].sum(), outputs["logits"].square().sum())


def test_batchnorm_running_statistics_come_from_the_first_replica():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(3)
    inputs = torch.randn(6, 3)
    DataParallel(norm, [CPU] * 2, gather_outputs=True)(inputs)
    first_chunk_only = nn.BatchNorm1d(3)
    first_chunk_only(inputs[:3])
    torch.testing.assert_close(norm.running_mean, first_chunk_only.running_mean)
    torch.testing.assert_close(norm.running_var, first_chunk_only.running_var)


def fail_on_the_short_chunk(x):
    if len(x) == 1:
        raise ValueError(f"chunk of {len(x)} sample")
    return x


class FailsOnShortChunk(nn.Module):
    def forward(self, x):
        return fail_on_the_short_chunk(x)


@pytest.mark.parametrize("where", ["model", "criterion"])
def test_an_exception_in_a_worker_is_raised_with_its_traceback(where):
    module = FailsOnShortChunk() if where == "model" else nn.Identity()

    def criterion(output, target):
        return fail_on_the_short_chunk(output).sum()

    with pytest.raises(ValueError, match="chunk of 1 sample") as error:
        outputs = DataParallel(module, [CPU] * 4, gather_outputs=False)(torch.randn(5, 2))
        parallel_criterion(criterion, outputs, torch.zeros(5), [CPU] * 3)
    message = str(error.value)
    assert "in replica 2" in message and "Original Traceback" in message
    assert "fail_on_the_short_chunk" in message


@pytest.mark.parametrize(
    ("grad_enabled", "dtype"),
    [(True, torch.bfloat16), (True, torch.float16), (False, None)],
    ids=["bf16", "fp16", "no_grad-fp32"],
)
def test_workers_keep_the_callers_grad_mode_and_autocast_dtype(grad_enabled, dtype):
    seen = []

    def criterion(output, target):
        seen.append(
            (
                threading.current_thread().name,
                torch.is_grad_enabled(),
                (output @ output.T).dtype,
                output.dtype,
            )
        )
        return output.float().sum()

    # fp16 is not CPU autocast's default (bf16): seeing it in the threads shows the dtype is copied
    autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    with torch.set_grad_enabled(grad_enabled), autocast:
        outputs = DataParallel(nn.Linear(4, 4), [CPU] * 3, gather_outputs=False)(torch.ones(6, 4))
        parallel_criterion(criterion, outputs, torch.zeros(6), [CPU] * 3)

    expected = dtype or torch.float32
    assert len({thread for thread, *_ in seen}) == 3
    assert all(record[1:] == (grad_enabled, expected, expected) for record in seen)


# ---------------------------------------------------------------------------------- real GPUs


@pytest.mark.cuda
@pytest.mark.equivalence
@needs_gpus(1)
@pytest.mark.parametrize("name", ["dp", "dp_criterion"])
def test_cuda_path_matches_the_full_batch_and_keeps_bf16(name):
    devices = min(torch.cuda.device_count(), 4)
    torch.manual_seed(0)
    mlp = MLP(input_shape=(6,), num_classes=4, hidden=8, depth=2)
    inputs, targets = torch.randn(2 * devices + 1, 6), torch.randint(0, 4, (2 * devices + 1,))
    expected = full_batch_step(mlp, inputs, targets)
    actual = strategy_step(name, devices, mlp, inputs, targets, device_type="cuda")
    assert_same_step(expected, actual)

    dtypes = []

    def noting_dtype(outputs, targets):
        dtypes.append(outputs.dtype)
        return loss_sum(outputs, targets)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        strategy_step(name, devices, mlp, inputs, targets, noting_dtype, device_type="cuda")
    assert dtypes and all(dtype == torch.bfloat16 for dtype in dtypes)


@pytest.mark.cuda
@needs_gpus(2)
def test_dp_criterion_lowers_the_output_devices_peak_memory():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 50_000))  # a large output
    inputs, targets = torch.randn(512, 32), torch.randint(0, 50_000, (512,))
    peaks = {}
    for name in ("dp", "dp_criterion"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
        strategy_step(name, 2, model, inputs, targets, device_type="cuda")
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated(0)
    assert peaks["dp_criterion"] < 0.8 * peaks["dp"], peaks


@pytest.mark.cuda
@needs_gpus(2)
def test_a_sweep_shows_the_output_devices_memory_ratio_for_dp_and_dp_criterion(tmp_path):
    """The workload dp_criterion exists for: whole-batch segmentation maps on the output device."""
    segmentation = ("model=fcn", "data=synthetic_segmentation", "task=segmentation")
    result = run_sweep(
        *segmentation,
        "trainer.max_steps=6",
        "logger=none",
        "trainer.accelerator=cuda",
        "parallel=dp,dp_criterion",
        sweep_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ratios = {summary(tmp_path / job)["strategy"]: summary(tmp_path / job) for job in "01"}
    ratios = {name: figures["output_device_memory_ratio"] for name, figures in ratios.items()}
    assert ratios["dp_criterion"] < ratios["dp"], ratios
    assert "output device memory" in (tmp_path / "summary.md").read_text()


def test_the_sweep_table_shows_the_output_devices_memory_ratio_only_where_measured():
    """On CPU (and for the other strategies) the figure is absent, and so is the column."""
    measured = Row(job="0", strategy="dp", devices=2, variant="", output_device_memory_ratio=2.5)
    other = Row(job="1", strategy="ddp", devices=2, variant="")
    header, _, line, _ = markdown_table([measured, other]).splitlines()
    assert "output device memory" in header and "| 2.50x |" in line
    assert "output device memory" not in markdown_table([other])


class ScaledByBuffer(nn.Module):
    """torch's test_data_parallel_buffers_requiring_grad: a buffer that requires grad."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.scale = nn.Buffer(scale)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * self.scale


def test_a_buffer_requiring_grad_gets_every_replicas_gradient():
    inputs = torch.randn(4, 3, dtype=torch.double)
    module = ScaledByBuffer(torch.randn(3, dtype=torch.double, requires_grad=True))
    DataParallel(module, [CPU, CPU], gather_outputs=True)(inputs).sum().backward()
    torch.testing.assert_close(module.scale.grad, inputs.sum(0))
    assert module.scale.is_leaf


class NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 3))

    def forward(self) -> torch.Tensor:
        return self.weight * 2


def test_a_forward_without_inputs_runs_once_as_torchs_does():
    assert DataParallel(NoInputs(), [CPU, CPU], gather_outputs=True)().shape == (2, 3)


class ZeroingInForward(nn.Linear):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.zero_grad()
        return super().forward(inputs)


def test_zero_grad_in_a_replicas_forward_warns_and_keeps_the_gradients():
    """As torch's DataParallel: its replicas' parameters are copies, so zero_grad there only
    warns. The module's own zero_grad still works afterwards."""
    torch.manual_seed(0)
    module = ZeroingInForward(3, 2)
    wrapped = DataParallel(module, [CPU, CPU], gather_outputs=True)
    inputs = torch.randn(4, 3)
    expected = torch.autograd.grad(nn.Linear.forward(module, inputs).sum(), module.weight)[0]
    for _ in range(2):  # the second forward must not clear the first backward's gradients
        with pytest.warns(UserWarning, match=r"zero_grad\(\) from a module created with"):
            output = wrapped(inputs)
        output.sum().backward()
    torch.testing.assert_close(module.weight.grad, 2 * expected)
    module.zero_grad()
    assert module.weight.grad is None
