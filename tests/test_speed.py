"""The speed options through the real `train.py`: fp16 with loss scaling, activation
checkpointing, torch.compile, FLOP/s and MFU, the profiler."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from helpers import (
    BESIDES_SINGLE,
    FP16,
    FP16_TOLERANCE,
    TINY,
    TINY_TRANSFORMER,
    TINY_TRANSFORMER_SGD,
    assert_same_training,
    metrics,
    reference_run,
    run_train,
    strategy_runs,
    summary,
)
from torch._dynamo.utils import counters
from torch.distributed._tools.mem_tracker import MemTracker

from src.components.blocks import keep_kernels_apart_by_aten_capability, prepare_blocks
from src.components.models import MLP, Transformer
from src.components.tasks import Classification
from src.config.trainer import Recomputation, TrainerConfig
from src.observe.performance import table_peak_tflops, throughput_figures
from src.observe.report import markdown_table
from src.observe.sweep_rows import Row
from src.planning.planner import plan_all
from src.planning.plans import MB
from src.training.loop import progress_line


@pytest.mark.parametrize("strategy", BESIDES_SINGLE)
def test_fp16_trains_like_single_fp16(strategy):
    runs = strategy_runs(*FP16)

    assert_same_training(runs["single"], runs[strategy], atol=FP16_TOLERANCE)
    assert summary(runs[strategy])["scaler_skipped_steps"] == 0


def test_steps_the_loss_scaler_skips_are_counted_and_do_not_stop_the_run(tmp_path):
    """A first scale of 1e38 overflows every fp16 gradient: the scaler skips each step (halving
    the scale), the losses stay finite, and the run ends normally."""
    run_train(*FP16, "trainer.loss_scale_init=1e38", run_dir=tmp_path)

    result = summary(tmp_path)
    assert result["scaler_skipped_steps"] == result["steps"] == 6
    assert result["skipped_steps"] == 0


def test_summary_reports_the_model_flops_and_their_rate():
    """The tiny MLP (32 inputs, three hidden layers of 32, 10 classes), 24 samples a step:
    forward 2*24*(3*32*32 + 32*10) FLOPs, the weight gradients as many again, and the input
    gradients of every layer but the first 2*24*(2*32*32 + 32*10)."""
    result = summary(reference_run(*TINY))

    assert result["flops_per_step"] == 2 * 24 * (3392 + 3392 + 2368)
    seconds_per_step = result["step_time_ms"] / 1000
    assert result["tflops_per_sec"] == pytest.approx(
        result["flops_per_step"] / seconds_per_step / 1e12
    )
    assert "mfu" not in result  # no known peak for a CPU


def test_a_language_model_run_reports_tokens_per_second(tmp_path):
    """Its samples are sequences of data.seq_len=8 input tokens."""
    result = run_train(*TINY_TRANSFORMER, "task=language_model", run_dir=tmp_path)

    figures = summary(tmp_path)
    assert figures["tokens_per_sec"] == pytest.approx(figures["samples_per_sec"] * 8)
    rows = [row for row in metrics(tmp_path) if "train/samples_per_sec" in row]
    assert len(rows) == 6
    for row in rows:
        assert row["train/tokens_per_sec"] == pytest.approx(row["train/samples_per_sec"] * 8)
    assert result.stdout.count(" tokens/s | data wait") == 6


def test_a_run_on_features_reports_no_tokens_per_second():
    run_dir = reference_run(*TINY)

    assert "tokens_per_sec" not in summary(run_dir)
    assert not any("train/tokens_per_sec" in row for row in metrics(run_dir))


def test_progress_line_shows_slow_rates_to_3_digits_and_fast_ones_with_separators():
    slow = progress_line(3, 10, 2.5, {"samples_per_sec": 0.42, "tokens_per_sec": 430.08}, 0.5, 17)
    assert "| loss 2.5000 | 0.42 samples/s | 430 tokens/s | data wait 0.5 ms | eta 17s" in slow
    fast = progress_line(3, 10, 2.5, {"samples_per_sec": 12_345.4}, 0.5, 17)
    assert "| 12,345 samples/s | data wait" in fast
    assert "tokens/s" not in fast


def test_mfu_is_the_share_of_every_device_s_peak():
    figures = throughput_figures(flops_per_step=4e12, step_time_ms=500, devices=2, peak_tflops=10)
    assert figures["tflops_per_sec"] == pytest.approx(8)
    assert figures["tflops_per_sec_per_device"] == pytest.approx(4)
    assert figures["mfu"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("name", "precision", "matmul", "peak"),
    [
        ("NVIDIA H100 PCIe", "bf16", "high", 756.0),
        ("NVIDIA H100 80GB HBM3", "fp16", "high", 989.4),
        ("NVIDIA A100-SXM4-80GB", "fp32", "high", 156.0),  # TF32 tensor cores
        ("NVIDIA A100-SXM4-80GB", "fp32", "highest", 19.5),
        ("NVIDIA L40S", "bf16", "high", 362.1),
        ("Tesla V100-SXM2-16GB", "bf16", "high", None),  # no bf16 arithmetic
        ("Some Future GPU", "bf16", "high", None),
    ],
)
def test_peak_table_lookup(name, precision, matmul, peak):
    assert table_peak_tflops(name, precision, matmul) == peak


def test_sweep_table_has_flop_rate_and_mfu_columns():
    row = Row(job="0", strategy="ddp", devices=2, variant="", tflops_per_sec=0.123, mfu=0.0456)
    header, _, line = markdown_table([row]).splitlines()
    assert "TFLOP/s" in header and "MFU" in header
    assert "0.123" in line and "4.56%" in line


SGD = (*TINY, "optimizer=sgd", "optimizer.warmup_steps=0")


CHECKPOINTED = ("ddp", "fsdp", "model_parallel", "hybrid")


@pytest.mark.parametrize("strategy", ["single", *CHECKPOINTED])
def test_activation_checkpointing_trains_exactly_like_the_run_without_it(strategy):
    runs = strategy_runs(*SGD, "trainer.activation_checkpointing=true", strategies=CHECKPOINTED)

    assert_same_training(reference_run(*SGD), runs[strategy])


# Selective recomputation holds blocks in every kind of unit: dp's replicas, DDP's hooks, FSDP2's
# per-block units, tp's DTensors (the policy sees their ops), pp's stages (backward by
# autograd.grad). A peak of 1 TFLOP/s gives these runs an MFU for the FLOP-rate test below.
SELECTIVE = ("dp", "ddp", "fsdp", "tp", "pp")
SELECTIVE_RUN = (
    *TINY_TRANSFORMER_SGD,
    "trainer.activation_checkpointing=selective",
    "trainer.peak_tflops=1.0",
    "trainer.count_tensor_memory=true",
)


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["single", *SELECTIVE])
def test_selective_activation_checkpointing_trains_exactly_like_the_run_without_it(strategy):
    """The transformer, whose blocks keep their matmuls' and attention's outputs and recompute
    their norms, GELUs and residual sums."""
    runs = strategy_runs(*SELECTIVE_RUN, strategies=SELECTIVE)
    assert_same_training(reference_run(*TINY_TRANSFORMER_SGD), runs[strategy])


# Not dp: each case traces a plan in the test process (1.3-2.7 s each on a loaded machine).
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "tp", "pp"])
def test_a_run_s_tensor_peak_is_the_planned_peak(compose_config, strategy):
    """summary.json's tensor_peak_mb (MemTracker over the first steps and evaluation, on CPU)
    is the planner's peak within 10%, on the device where each is highest; the process's
    resident peak, interpreter and libraries included, is far above both."""
    summary_figures = summary(strategy_runs(*SELECTIVE_RUN, strategies=SELECTIVE)[strategy])
    cfg = compose_config(*SELECTIVE_RUN, f"parallel={strategy}")
    (plan,) = plan_all(cfg, [cfg.parallel])
    assert max(summary_figures["tensor_peak_mb"]) == pytest.approx(plan.needed / MB, rel=0.10)
    assert min(summary_figures["peak_memory_mb"]) > 10 * max(summary_figures["tensor_peak_mb"])


# The devices each strategy's job computes on, as its conf/parallel/ option ships: tp's and pp's
# peers read the same batch, dp's replicas share one process.
JOB_DEVICES = {"single": 1, "ddp": 2, "dp": 2, "tp": 2, "pp": 2}


def test_flop_rate_per_device_and_mfu_count_every_device_the_job_computes_on():
    """The same global batch, so the same FLOPs a step, under each strategy (the model's: the
    recomputation is not counted): each device's share of them is the step's FLOPs over the
    job's devices, however the work is split (counting the data-parallel processes only, tp 2
    and pp 2 reported twice their MFU). The selective-recomputation runs, which set a peak."""
    runs = strategy_runs(*SELECTIVE_RUN, strategies=SELECTIVE)

    results = {name: summary(runs[name]) for name in JOB_DEVICES}
    assert len({result["flops_per_step"] for result in results.values()}) == 1
    for name, devices in JOB_DEVICES.items():
        result = results[name]
        per_device = result["flops_per_step"] / devices / (result["step_time_ms"] / 1000) / 1e12
        assert result["tflops_per_sec_per_device"] == pytest.approx(per_device, rel=1e-9), name
        assert result["mfu"] == pytest.approx(per_device / 1.0, rel=1e-9), name


def test_activation_checkpointing_saves_activation_memory():
    """torch's own count of tensor memory (MemTracker, on CPU too) over a forward and backward
    pass: fully checkpointed blocks keep only their inputs for backward, selectively
    checkpointed ones their matmuls' outputs too."""
    inputs = torch.randint(0, 16, (32, 64))
    checkpoint_ops = TrainerConfig().checkpoint_ops

    def peak_bytes(recomputation: Recomputation) -> int:
        torch.manual_seed(0)
        model = Transformer(input_shape=(64,), num_classes=16, hidden=64, depth=4, heads=2)
        prepare_blocks(model, recomputation, compile=False, checkpoint_ops=checkpoint_ops)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            Classification().sums(model(inputs), inputs)[0].backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    kept = {mode: peak_bytes(mode) for mode in Recomputation}
    assert kept["full"] < 0.5 * kept["none"]
    assert kept["full"] < kept["selective"] < 0.9 * kept["none"]


# Inductor fuses and reorders float arithmetic, so compiled runs agree with eager ones to float
# rounding, not bit for bit.
COMPILE_TOLERANCE = 1e-4


def test_compile_compiles_blocks_of_torch_modules_and_copies_share_their_graphs():
    """An MLP's blocks hold torch modules only (Linear, ReLU), which `nn.Module.compile` left
    uncompiled. Copies of the model (dp's replicas) run the same graphs, bound to themselves."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3)
    prepare_blocks(model, Recomputation.none, compile=True)
    replica = copy.deepcopy(model)
    with torch.no_grad():
        replica[3].bias.add_(1.0)
    inputs = torch.randn(8, 32)

    torch.testing.assert_close(replica(inputs), model(inputs) + 1.0)
    # The first block (with its Flatten), the other two hidden blocks alike, the head.
    assert counters["stats"]["unique_graphs"] == 3
    assert list(model.state_dict()) == list(MLP((32,), 10, 32, 3).state_dict())


# Compiling is slow on 2 cores (inductor's C++ builds): one sweep, whose in-process jobs (dp,
# dp_criterion, model_parallel) share the compiled graphs and whose multi-process ones (ddp, fsdp)
# read inductor's cache on disk. hybrid, DDP over model_parallel's pipelines, adds no wrapper of
# its own, and would compile in 4 more processes.
COMPILED = tuple(name for name in BESIDES_SINGLE if name != "hybrid")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["single", *COMPILED])
def test_compiled_blocks_train_like_eager_ones_under_every_wrapper(strategy):
    """Compiled blocks in dp's replicas, DDP's hooks, FSDP2's per-block units and the pipelines'
    stages train as `single` does eagerly."""
    runs = strategy_runs(*SGD, "trainer.compile=true", strategies=COMPILED)
    assert_same_training(reference_run(*SGD), runs[strategy], atol=COMPILE_TOLERANCE)


def test_compiled_blocks_under_baseline_kernels_train_like_eager_ones(tmp_path):
    """After compiled runs with this CPU's own kernels (the sweep above) have filled inductor's
    cache, a compiled run under ATEN_CPU_CAPABILITY=default builds its own kernels instead of
    the vectorised ones cached, which failed to build there. Its weights then match eager
    `single`'s (1.5e-8 apart under `default`, measured), within the other kernels' rounding."""
    strategy_runs(*SGD, "trainer.compile=true", strategies=COMPILED)  # the cached kernels
    baseline = {"ATEN_CPU_CAPABILITY": "default"}
    run_train(*SGD, "trainer.compile=true", run_dir=tmp_path, env=baseline)
    assert_same_training(reference_run(*SGD), tmp_path)


@pytest.mark.parametrize(
    ("capability", "inherited", "expected"),
    [
        ("default", None, "{shared}-aten-default"),
        ("default", "{shared}-aten-avx2", "{shared}-aten-default"),  # a parent under avx2
        (None, "{shared}-aten-avx2", "{shared}"),
        ("default", "/data/my-inductor-cache", "/data/my-inductor-cache"),  # the user's own
    ],
)
def test_each_aten_capability_compiles_into_its_own_inductor_cache(
    monkeypatch, capability, inherited, expected
):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    shared = default_cache_dir()
    settings = {"ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": inherited}
    for name, value in settings.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value.format(shared=shared))
    keep_kernels_apart_by_aten_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected.format(shared=shared)


def test_profile_writes_a_chrome_trace_to_the_run_folder_and_w_and_b(tmp_path):
    run_train(
        *TINY, "logger=wandb", "trainer.profile=true", "trainer.profile_steps=2", run_dir=tmp_path
    )

    trace = json.loads((tmp_path / "profile_trace.json").read_text())
    assert any(event.get("name") == "ProfilerStep#3" for event in trace["traceEvents"])
    (saved,) = tmp_path.glob("wandb/offline-run-*/files/profile_trace.json")
    assert saved.resolve() == (tmp_path / "profile_trace.json").resolve()
