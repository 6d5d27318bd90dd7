"""N-D layouts on one DeviceMesh (`parallel=tp`, `fsdp_tp`, ...) through the real `train.py`:
gloo processes on CPU, each layout against `single` under SGD in fp32."""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    FP16,
    FP16_TOLERANCE,
    TINY,
    TINY_GPT_SGD,
    TINY_SGD,
    TINY_TRANSFORMER_SGD,
    assert_same_training,
    checkpoint,
    forked_ranks,
    parallel_config,
    reference_run,
    run_train,
    summary,
    sweep_runs,
)
from slurm_cluster import free_port
from styled_models import ResidualFeedForward
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import SequenceParallel

from src.components.models import GPT, MLP, ConvNet, Transformer
from src.components.precision import LossScaling
from src.components.tasks import loss_sum
from src.config.base import ConfigError
from src.parallel import build_strategy
from src.parallel.layout import Layout
from src.parallel.pp.schedules import LOOPED, ONE_STAGE, SCHEDULES, SPLIT_BACKWARD
from src.parallel.tp.apply import tp_styles
from src.runtime.ranks import Ranks

WORKLOADS = {
    # Accumulation too: two micro-steps per optimizer step; and clipping, by the norm of the
    # whole model's gradients (a pp rank holds its own stages' only).
    "mlp": (*TINY_SGD, "trainer.accumulate=2", "trainer.grad_clip=0.05"),
    # Clipped too: under tp its norms are whole tensors beside the split layers' DTensors (or,
    # with sequence_parallel, DTensors replicated over tp).
    "transformer": (*TINY_TRANSFORMER_SGD, "trainer.accumulate=2", "trainer.grad_clip=0.05"),
    "gpt": TINY_GPT_SGD,  # tied embedding and head, replicated over the tp ranks
    # A model of the test's own, whose styles come through the hook (tests/styled_models.py).
    "own-styles": (*TINY_SGD, "model._target_=tests.styled_models.ResidualFeedForward"),
}


@pytest.mark.equivalence
@pytest.mark.parametrize("workload", ["mlp", "gpt", "own-styles"])
def test_tensor_parallel_trains_exactly_like_single(workload, tmp_path):
    """Against `reference_run`: the mlp's is the one the other layouts here are held to."""
    run_train(*WORKLOADS[workload], "parallel=tp", run_dir=tmp_path)
    assert_same_training(reference_run(*WORKLOADS[workload]), tmp_path)
    result = summary(tmp_path)
    assert result["strategy"] == "tp" and result["world_size"] == 1  # one data-parallel share
    assert result["memory_devices"] == ["cpu:rank0", "cpu:rank1"]


# The transformer under tp with each of sequence_parallel and loss_parallel on and off: one sweep.
SP_LP_SWEEP = (
    *WORKLOADS["transformer"],
    "parallel=tp",
    "parallel.sequence_parallel=false,true",
    "parallel.loss_parallel=false,true",
)


def sp_lp_run(sp: bool, lp: bool) -> Path:
    """The sweep's run with these two settings (Hydra writes a swept bool as `True`)."""
    wanted = {f"parallel.sequence_parallel={sp}", f"parallel.loss_parallel={lp}"}
    runs = sweep_runs(*SP_LP_SWEEP)
    (run_dir,) = [run_dir for key, run_dir in runs.items() if set(key.split()) == wanted]
    return run_dir


@pytest.mark.equivalence
@pytest.mark.parametrize("sp, lp", [(False, False), (True, False), (False, True), (True, True)])
def test_sequence_and_loss_parallel_change_nothing_in_the_numbers(sp, lp):
    run_dir = sp_lp_run(sp, lp)
    assert_same_training(reference_run(*WORKLOADS["transformer"]), run_dir)


def test_sequence_and_loss_parallel_split_the_norms_and_the_logits():
    """What the two options add to the transformer's styles (the sweep above: that it changes
    nothing in the numbers)."""
    model = Transformer(input_shape=(8,), num_classes=16, hidden=32, depth=1, heads=2)
    plain = tp_styles(model, 2)
    both = tp_styles(model, 2, sequence_parallel=True, loss_parallel=True)
    assert "1.norm1" not in plain and "2.1" not in plain
    assert isinstance(both["1.norm1"], SequenceParallel) and isinstance(
        both["2.0"], SequenceParallel
    )
    assert both["2.1"].output_layouts == (Shard(-1),) and not both["2.1"].use_local_output


@pytest.mark.equivalence
def test_fsdp_2_by_tp_2_trains_exactly_like_single(tmp_path):
    """The 2-D preset on 4 processes: FSDP2 over the data-parallel pair, tp within each."""
    run_train(*WORKLOADS["mlp"], "parallel=fsdp_tp", run_dir=tmp_path)
    assert_same_training(reference_run(*WORKLOADS["mlp"]), tmp_path)
    assert summary(tmp_path)["world_size"] == 2  # two data-parallel shares of the batch


@pytest.mark.equivalence
def test_fsdp_2_by_tp_2_trains_like_single_under_fp16(tmp_path):
    """fp16 with loss scaling, clipping and accumulation: parameters gathered in fp16 (as under
    fsdp) and one loss scale on all 4 ranks."""
    run_train(*FP16, "parallel=fsdp_tp", run_dir=tmp_path)
    assert_same_training(reference_run(*FP16), tmp_path, atol=FP16_TOLERANCE)
    assert summary(tmp_path)["scaler_skipped_steps"] == 0


# Strategies whose processes each hold part of the gradients, as `parallel=<option>` on 2
# processes: fsdp; on the mesh, fsdp's shards (dp_shard 2), tp's splits and pp's stages.
SPLIT_GRADIENTS = [("fsdp", {}), ("fsdp_tp", {"tp": 1}), ("tp", {}), ("pp", {})]


def one_overflowing_rank_makes_every_rank_skip(rank: int, store_path: str) -> None:
    """Rank 1's gradients hold an inf, rank 0's do not: under each strategy's fp16 scaler both
    skip the step, and so keep one loss scale."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    for option, settings in SPLIT_GRADIENTS:
        strategy = build_strategy(parallel_config(option, devices=2, **settings), "cpu", "fp16")
        parameter = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([parameter], lr=0.1)
        scaling = LossScaling(strategy.grad_scaler(enabled=True, init_scale=1024.0))
        gradient = torch.tensor([math.inf if rank == 1 else 1.0, 1.0])
        scaling.scale((parameter * gradient).sum()).backward()
        scaling.step(optimizer)
        assert (scaling.skipped_steps, parameter.tolist()) == (1, [1.0, 1.0]), (option, rank)
    dist.destroy_process_group()


def test_fp16_steps_are_skipped_on_every_rank_when_one_rank_s_gradients_overflow(tmp_path):
    forked_ranks(one_overflowing_rank_makes_every_rank_skip, str(tmp_path / "store"))


def gathered_in_fp16(rank: int, port: int) -> None:
    """Rank `rank` of fsdp 2 on the mesh under fp16: a layer sees its weight gathered in fp16,
    while the shards and their gradients stay fp32."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    ranks = Ranks(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
    config = parallel_config("fsdp_tp", devices=2, tp=1)
    strategy = build_strategy(config, "cpu", "fp16", ranks)
    strategy.setup()
    model = strategy.wrap(MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3))
    gathered = []
    model[1][0].register_forward_pre_hook(lambda layer, _: gathered.append(layer.weight.dtype))
    strategy.apply(model, torch.randn(4, 32), torch.randint(0, 10, (4,)), loss_sum).backward()
    kept = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()}
    assert (gathered, kept) == ([torch.float16], {torch.float32}), rank
    strategy.teardown()


def test_the_mesh_s_fsdp_gathers_parameters_in_the_autocast_dtype():
    """fsdp's mixed-precision policy, which the mesh's FSDP shares (`dp_shard.apply.apply_fsdp`)."""
    forked_ranks(gathered_in_fp16, free_port())


# Data parallel alone (DDP, whose gradients the mlp workload clips) and with tp or pp on 4
# processes, taking the ranks they leave (tp 2: dp 2 x tp 2; pp 2: dp 2 x pp 2). DDP's ranks
# are alike: 2 prove what 4 would. tp 2 x pp 2 is the V schedule's test below; tp-split stages
# under 1F1B are the 3-D preset's.
DATA_PARALLEL_LAYOUTS = {  # processes, tp, pp
    "ddp2": (2, 1, 1),
    "ddp2xtp2": (4, 2, 1),
    "ddp2xpp2-1F1B": (4, 1, 2),
}


def assert_trains_like_single(run_dir: Path, layout: str, processes: int = 4) -> None:
    """Losses and weights of `single` on the mlp workload, its final validation loss, and the
    layout's name and devices (`processes` of them) in the summary."""
    reference = reference_run(*WORKLOADS["mlp"])
    assert_same_training(reference, run_dir)
    assert summary(run_dir)["final_val_loss"] == pytest.approx(
        summary(reference)["final_val_loss"], rel=0, abs=1e-5
    )
    assert summary(run_dir)["layout"] == layout
    assert summary(run_dir)["memory_devices"] == [f"cpu:rank{rank}" for rank in range(processes)]


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", list(DATA_PARALLEL_LAYOUTS))
def test_data_parallel_alone_or_with_tp_or_pp_trains_exactly_like_single(layout, tmp_path):
    processes, tp, pp = DATA_PARALLEL_LAYOUTS[layout]
    degrees = (f"parallel.devices={processes}", f"parallel.tp={tp}", f"parallel.pp={pp}")
    run_train(
        *WORKLOADS["mlp"], "parallel=tp", *degrees, "parallel.dp_replicate=-1", run_dir=tmp_path
    )
    assert_trains_like_single(tmp_path, layout, processes)


@pytest.mark.equivalence
def test_the_mesh_preset_s_2_by_2_hsdp_trains_exactly_like_single(tmp_path):
    """`parallel=mesh` takes the degrees directly: 2 replicas of FSDP2 over 2 shards (FSDP2's
    HSDP, not DDP: dp_shard is set). About 15 s on 2 CPU cores."""
    degrees = ("parallel.dp_replicate=2", "parallel.dp_shard=2")
    run_train(*WORKLOADS["mlp"], "parallel=mesh", *degrees, run_dir=tmp_path)
    assert_trains_like_single(tmp_path, "hsdp2xfsdp2")


@pytest.mark.equivalence
def test_tp_2_by_pp_2_under_a_v_schedule_trains_exactly_like_single(tmp_path):
    """ZBVZeroBubble's V: the MLP's 4 blocks as 4 stages, 2 per pp rank, each split over 2 tp
    ranks (tp x pp without data parallel: no FSDP). The 60 validation samples in batches of 7
    end with a smaller batch, which the V's evaluation schedule must take too."""
    v_schedule = (
        "parallel.schedule=ZBVZeroBubble",
        "parallel.stages_per_rank=2",
        "trainer.eval_batch_size=7",
    )
    degrees = ("parallel.devices=4", "parallel.tp=2", "parallel.pp=2", "parallel.dp_replicate=1")
    run_train(*WORKLOADS["mlp"], "parallel=tp", *degrees, *v_schedule, run_dir=tmp_path)
    assert_trains_like_single(tmp_path, "tp2xpp2-ZBVZeroBubble")


# The schedules that split the backward into input and weight gradients, each with FSDP over the
# pipelines: fsdp 2 x pp 2 on 4 processes, one sweep; each data-parallel share of 6 samples in 6
# micro-batches (DualPipeV takes no fewer than its 4 stages).
SPLIT_BACKWARD_SWEEP = (
    *WORKLOADS["mlp"],
    "parallel=pp",
    "parallel.devices=4",
    "parallel.pp=2",
    "parallel.dp_shard=2",
    "parallel.stages_per_rank=2",
    "parallel.microbatches=6",
    f"parallel.schedule={','.join(SPLIT_BACKWARD)}",
)


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule", SPLIT_BACKWARD)
def test_fsdp_2_by_pp_2_under_a_split_backward_schedule_trains_exactly_like_single(schedule):
    """Their weight gradients are computed after the input gradients, from the stage's
    registered parameters: FSDP keeps each stage gathered until its gradients are reduced
    (resharded after each forward, those were the sharded ones, and the gradients were lost)."""
    run_dir = sweep_runs(*SPLIT_BACKWARD_SWEEP)[f"parallel.schedule={schedule}"]
    assert_trains_like_single(run_dir, f"fsdp2xpp2-{schedule}")


@pytest.mark.equivalence
def test_fsdp_2_by_tp_2_by_pp_2_on_8_processes_trains_exactly_like_single(tmp_path):
    """The 3-D preset: two pipelines of two stages, each stage tp-split over 2 ranks, and the
    pipelines' stages FSDP-sharded over the data-parallel pair."""
    run_train(*WORKLOADS["mlp"], "parallel=fsdp_tp_pp", run_dir=tmp_path)
    reference = reference_run(*WORKLOADS["mlp"])
    assert_same_training(reference, tmp_path)
    result = summary(tmp_path)
    assert result["layout"] == "fsdp2xtp2xpp2-1F1B" and result["world_size"] == 2
    assert result["final_val_loss"] == pytest.approx(
        summary(reference)["final_val_loss"], rel=0, abs=1e-5
    )


def test_a_tp_checkpoint_is_single_s_state_dict():
    """The fused qkv rows, regrouped per rank while training, are back in single's order."""
    state = checkpoint(sp_lp_run(False, False))
    Transformer(input_shape=(8,), num_classes=16, hidden=32, depth=2, heads=2).load_state_dict(
        state["model"]
    )
    assert list(state["optimizer"]["param_groups"][0]["params"]) == list(range(len(state["model"])))


@pytest.mark.parametrize(
    "model, settings, message",
    [
        (
            ConvNet(input_shape=(1, 16, 16), num_classes=10, width=8, depth=2, hidden=16),
            {},
            "parallel.tp=2: no tensor-parallel styles for ConvNet (registered: GPT, "
            "GPT2PreTrainedModel, MLP, ResidualFeedForward, Transformer); a model brings its own "
            "with @tensor_parallel_styles",
        ),
        (
            GPT(input_shape=(9,), num_classes=16, n_layer=1, n_head=3, n_embd=24),
            {},
            "parallel.tp=2 does not divide the model's 3 block 1's attention heads",
        ),
        (
            GPT(input_shape=(9,), num_classes=16, n_layer=1, n_head=2, n_embd=16),
            {"loss_parallel": True},
            "parallel.loss_parallel splits the vocabulary head's weight, which this model ties",
        ),
        (
            MLP(input_shape=(9,), num_classes=10, hidden=32, depth=3),
            {"sequence_parallel": True},
            "parallel.sequence_parallel=true (which splits each sequence of tokens over the tp "
            "ranks): the tensor-parallel styles for MLP do not take it; set it to false (models "
            "whose styles take it: GPT, Transformer)",
        ),
        (
            ResidualFeedForward(input_shape=(9,), num_classes=10, hidden=16, depth=1),
            {"loss_parallel": True},
            "parallel.loss_parallel=true (which keeps the logits split over the vocabulary into "
            "the loss): the tensor-parallel styles for ResidualFeedForward do not take it",
        ),
        (
            Transformer(input_shape=(9,), num_classes=16, hidden=16, depth=1, heads=2),
            {"sequence_parallel": True},
            "parallel.tp=2 does not divide the model's 9 tokens per sequence",
        ),
    ],
    ids=[
        "no-styles",
        "heads",
        "loss-parallel-tied",
        "sequence-parallel-mlp",
        "loss-parallel-own-styles",
        "sequence-length",
    ],
)
def test_a_model_tp_cannot_split_is_refused(model, settings, message):
    strategy = build_strategy(parallel_config("tp", **settings), "cpu")
    with pytest.raises(ConfigError, match=re.escape(message)):
        strategy.check_model(model, torch.zeros(2, 9, dtype=torch.long))


def test_train_py_refuses_tp_for_a_model_without_styles_in_one_line(tmp_path):
    result = run_train(
        *TINY,
        "model=convnet",
        "data.image_shape=[1,8,8]",
        "parallel=tp",
        run_dir=tmp_path,
        check=False,
    )
    assert result.returncode == 2
    errors = [line for line in result.stdout.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "no tensor-parallel styles for ConvNet" in errors[0]
    assert "@tensor_parallel_styles" in errors[0]  # the hook a model brings its styles through
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "world_size, degrees, expected",
    [
        (4, {"dp_shard": -1, "tp": 2}, Layout(dp_shard=2, tp=2)),
        (8, {"dp_replicate": 2, "tp": 2, "pp": -1}, Layout(pp=2, dp_replicate=2, tp=2)),
        (2, {"tp": -1}, Layout(tp=2)),
    ],
)
def test_degrees_of_minus_one_take_the_remaining_ranks(world_size, degrees, expected):
    assert Layout.of(world_size, **degrees) == expected


@pytest.mark.parametrize(
    "world_size, degrees, message",
    [
        (
            4,
            {"dp_shard": 2, "tp": 3},
            "the degrees multiply to 6 (dp_shard 2 x tp 3) but the job has 4 processes",
        ),
        (6, {"dp_shard": -1, "tp": 4}, "leave no whole number of ranks for parallel.dp_shard"),
        (4, {"dp_shard": -1, "tp": -1}, "at most one may be -1"),
        (4, {"tp": 0}, "parallel.tp=0: each degree must be at least 1"),
    ],
)
def test_degrees_that_do_not_multiply_out_are_refused(world_size, degrees, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Layout.of(world_size, **degrees)


def test_the_ranks_sharing_a_data_parallel_index_are_the_tp_and_pp_peers():
    layout = Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    assert [layout.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.coordinates(7) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert layout.label() == "fsdp2xtp2xpp2"


# The schedules of a whole backward on 2 processes, 4 micro-batches: the one-stage ones in one
# sweep, the looped ones with 2 stages per rank (the MLP's 4 blocks as 4 stages) in another. The
# 60 validation samples in batches of 7 end with a smaller batch, which the pipeline's stages
# must take too (the V's evaluation schedule: the tp 2 x pp 2 V test's). The schedules that split
# the backward are each held to single under fsdp 2 x pp 2 above (our code branches on a schedule
# only for its stage placement and its evaluation schedule, the same with FSDP or without).
PP = (*WORKLOADS["mlp"], "parallel=pp", "parallel.microbatches=4", "trainer.eval_batch_size=7")
WHOLE_BACKWARD = [schedule for schedule in SCHEDULES if schedule not in SPLIT_BACKWARD]
LOOPED_WHOLE_BACKWARD = [schedule for schedule in LOOPED if schedule in WHOLE_BACKWARD]
SCHEDULE_SWEEPS = {
    1: (*PP, "parallel.stages_per_rank=1", f"parallel.schedule={','.join(ONE_STAGE)}"),
    2: (*PP, "parallel.stages_per_rank=2", f"parallel.schedule={','.join(LOOPED_WHOLE_BACKWARD)}"),
}


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule", WHOLE_BACKWARD)
def test_every_schedule_of_a_whole_backward_trains_exactly_like_single(schedule):
    stages_per_rank = 1 if schedule in ONE_STAGE else 2
    run_dir = sweep_runs(*SCHEDULE_SWEEPS[stages_per_rank])[f"parallel.schedule={schedule}"]
    reference = reference_run(*WORKLOADS["mlp"])
    assert_same_training(reference, run_dir)
    assert summary(run_dir)["final_val_loss"] == pytest.approx(
        summary(reference)["final_val_loss"], rel=0, abs=1e-5
    )
    assert summary(run_dir)["memory_devices"] == ["cpu:rank0", "cpu:rank1"]


def test_the_sweep_report_names_pipelines_by_schedule_with_bubble_and_measured_idle():
    """The schedule sweep's report: each job named by its layout and schedule, the theoretical
    bubble of 2 stages over 4 micro-batches, (2 - 1) / (4 + 2 - 1), beside each rank's measured
    idle fraction (wall time of the schedule's step minus its stages' own chunks and loss)."""
    runs = sweep_runs(*SCHEDULE_SWEEPS[1])
    (sweep_dir,) = {run_dir.parent for run_dir in runs.values()}
    rows = {row["strategy"]: row for row in csv.DictReader((sweep_dir / "summary.csv").open())}
    assert set(rows) == {"pp2-GPipe", "pp2-1F1B"}
    for row in rows.values():
        assert float(row["pipeline_bubble"]) == pytest.approx(1 / 5)
    for schedule in ONE_STAGE:
        pipeline = summary(runs[f"parallel.schedule={schedule}"])["pipeline"]
        assert pipeline["schedule"] == schedule and pipeline["microbatches"] == 4
        assert len(pipeline["idle_fraction_per_rank"]) == 2
        assert all(0 < idle < 1 for idle in pipeline["idle_fraction_per_rank"])
    assert (
        "| bubble (theory) | idle per pp rank (measured) |"
        in (sweep_dir / "summary.md").read_text()
    )


def test_a_pp_rank_holds_only_its_own_stages_parameters_and_buffers():
    """Each pp rank of the schedule sweep's 1F1B run holds a run of whole blocks, its stage,
    and together they hold the model once (its checkpoint: single's state_dict)."""
    run_dir = sweep_runs(*SCHEDULE_SWEEPS[1])["parallel.schedule=1F1B"]
    held = summary(run_dir)["pipeline"]["held_bytes_per_rank"]
    block_bytes: dict[int, int] = {}
    for name, value in checkpoint(run_dir)["model"].items():
        block = int(name.split(".")[0])
        block_bytes[block] = block_bytes.get(block, 0) + value.nbytes
    sizes = [block_bytes[block] for block in sorted(block_bytes)]
    first_stages = [sum(sizes[:point]) for point in range(1, len(sizes))]
    assert len(held) == 2 and held[0] in first_stages
    assert sum(held) == sum(sizes)


@pytest.mark.parametrize(
    "schedule, stages_per_rank, microbatches, message",
    [
        ("1F1B", 1, 1, "parallel.schedule=1F1B needs parallel.microbatches (1) >= the stages (2)"),
        ("Interleaved1F1B", 2, 5, "needs parallel.microbatches (5) to be a multiple of its rounds"),
        ("DualPipeV", 2, 3, "parallel.schedule=DualPipeV needs parallel.microbatches (3) >= the"),
        ("ZBVZeroBubble", 1, 4, "parallel.schedule=ZBVZeroBubble runs 2 stages per rank in a V"),
        ("GPipe", 2, 4, "parallel.schedule=GPipe runs one stage per rank"),
        ("Nosuch", 1, 4, "parallel.schedule=Nosuch is none of GPipe, 1F1B, Interleaved1F1B"),
    ],
)
def test_a_schedule_that_cannot_run_its_settings_is_refused(
    schedule, stages_per_rank, microbatches, message
):
    settings = {"schedule": schedule, "stages_per_rank": stages_per_rank}
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_strategy(parallel_config("pp", microbatches=microbatches, **settings), "cpu")


def test_a_model_with_fewer_blocks_than_pipeline_stages_is_refused():
    short = MLP(input_shape=(8,), num_classes=10, hidden=8, depth=1)
    interleaved = parallel_config("pp", schedule="Interleaved1F1B", stages_per_rank=2)
    with pytest.raises(ConfigError, match="= 4 stages, but the model has only 2 blocks"):
        build_strategy(interleaved, "cpu").check_model(short, None)
