"""The planner (`src/planning/planner.py`, `plan.py`) and `parallel=auto`: predicted peaks against
the peaks of real training steps, the choice, and bad input."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_SGD, TrainRun, options, run_plan, run_train
from hydra import initialize_config_dir
from torch.distributed._tools.mem_tracker import _MemRefType

import src.planning.planner
from src.components.data import build_data
from src.components.model_contract import settle_model_settings
from src.config.base import ConfigError
from src.launch.memory_check import measured_peaks_mb
from src.parallel.shares import DeviceShare, Messages
from src.planning.device_memory import RUNNING, STEPPING, unsplit_step_bytes
from src.planning.memory_trace import check_traceable, meta_model_and_inputs, model_sizes
from src.planning.planner import (
    candidate_parallels,
    choose,
    format_table,
    plan_all,
    resolve_auto,
)
from src.planning.plans import MB, Plan
from src.planning.step_time import BACKWARD_SHARE, DeviceSpeed

TINY_MLP = ("model.hidden=64", "model.depth=3", "trainer.batch_size=64", "logger=none")
TINY_GPT = (
    "model=gpt",
    "data=synthetic_tokens",
    "task=language_model",
    "data.seq_len=16",
    "trainer.batch_size=16",
    "logger=none",
)
# torchvision's ResNet-18 with the CIFAR stem on 32x32 images, 4 wide: BatchNorm buffers,
# residual branches, in-place ReLUs.
TINY_RESNET = (
    *("model=resnet", "model.width=4", "model.cifar_stem=true"),
    *("data.image_shape=[3,32,32]", "data.num_samples=64", "trainer.batch_size=8"),
    "logger=none",
)
TINY_MOE = (*TINY_GPT, "model=moe", "model.experts=4")
NEEDS_TORCHVISION = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="model=resnet needs torchvision"
)
# Models that are not an nn.Sequential: tests/odd_models.py's LoopMLP (a stem, a ModuleList of
# 3 blocks it loops over, a head) and transformers' Llama as tests/test_any_model.py sizes it
# (4 attention heads, 2 key/value heads).
TINY_LOOP = (
    *("model._target_=tests.odd_models.LoopMLP", "+model.width=64", "+model.layers=3"),
    *("trainer.batch_size=64", "logger=none"),
)
TINY_LLAMA = (
    *("model=hf_causal_lm", "model.sizes.hidden_size=32", "model.sizes.intermediate_size=64"),
    *("data.seq_len=8", "data.vocab_size=16", "data.num_samples=600"),
    *("trainer.batch_size=16", "logger=none"),
)
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="model=hf_causal_lm needs transformers"
)
FSDP_2 = ("parallel=fsdp", "parallel.devices=2")
RESNET_CASES = {
    "resnet-single": ("parallel=single",),
    "resnet-ddp": ("parallel=ddp", "parallel.devices=2"),
    "resnet-fsdp": ("parallel=fsdp", "parallel.devices=2"),
    "resnet-model-parallel": ("parallel=model_parallel",),
}


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param((*TINY_MLP, "parallel=dp", "parallel.devices=2"), id="mlp-dp"),
        pytest.param(
            (*TINY_GPT, "parallel=single", "trainer.activation_checkpointing=true"),
            id="gpt-single-checkpointing",
        ),
        pytest.param(
            (*TINY_GPT, "parallel=single", "trainer.activation_checkpointing=selective"),
            id="gpt-single-selective-checkpointing",
        ),
        pytest.param(
            (
                *TINY_GPT,
                "parallel=model_parallel",
                "parallel.microbatches=2",
                "trainer.accumulate=2",
            ),
            id="gpt-pipeline-accumulate",
        ),
        pytest.param(
            (*TINY_GPT, "parallel=ddp", "parallel.devices=1", "trainer.precision=bf16"),
            id="gpt-ddp-bf16",
        ),
        # ranks started by `launch`
        pytest.param((*TINY_MLP, "parallel=ddp", "parallel.devices=2"), id="mlp-ddp"),
        *[
            pytest.param((*TINY_RESNET, *case), id=name, marks=NEEDS_TORCHVISION)
            for name, case in RESNET_CASES.items()
        ],
        pytest.param((*TINY_LOOP, "parallel=single"), id="loop-mlp-single"),
        pytest.param((*TINY_LOOP, "parallel=ddp", "parallel.devices=2"), id="loop-mlp-ddp"),
        # Its stem and head in FSDP's root unit, gathered while the blocks run; the weight
        # average sharded as the weights are, held as optimizer state is.
        pytest.param((*TINY_LOOP, *FSDP_2, "trainer.ema_decay=0.9"), id="loop-mlp-fsdp-ema"),
        # Its stages traced by torch, each micro-batch through them in turn.
        pytest.param(
            (*TINY_LOOP, "parallel=model_parallel", "parallel.microbatches=2"),
            id="loop-mlp-model-parallel",
        ),
        *[
            pytest.param(
                (*TINY_LLAMA, f"parallel={name}", "parallel.devices=2"),
                id=f"llama-{name}",
                marks=NEEDS_TRANSFORMERS,
            )
            # tp by the model's own styles (`_tp_plan`), embedding and head included
            for name in ("ddp", "fsdp", "tp")
        ],
    ],
)
def test_predicted_peaks_within_10_percent_of_measured(compose_config, overrides):
    """Training's peak, and evaluation's (one evaluation batch beside the optimizer state)."""
    cfg = compose_config(*overrides)
    (plan,) = plan_all(cfg, [cfg.parallel])
    measured = measured_peaks_mb(cfg)
    assert plan.peak / MB == pytest.approx(measured["training"]["Total"], rel=0.10)
    assert plan.eval_peak / MB == pytest.approx(measured["evaluation"]["Total"], rel=0.10)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param((*TINY_GPT, "parallel=tp"), id="gpt-tp"),
        # nanoGPT's layout: no biases in the Linears and LayerNorms (nor in the fused qkv the
        # plan regroups), and dropout's masks kept for backward.
        pytest.param(
            (*TINY_GPT, "parallel=tp", "model.bias=false", "model.dropout=0.1"),
            id="gpt-tp-nanogpt-layout",
        ),
        pytest.param((*TINY_MLP, "parallel=pp", "parallel.schedule=1F1B"), id="mlp-pp-1F1B"),
        pytest.param(
            (*TINY_MLP, "parallel=fsdp_tp"),
            id="mlp-fsdp2xtp2",
        ),
        pytest.param((*TINY_MLP, "parallel=fsdp", "parallel.devices=2"), id="mlp-fsdp"),
        # Each gradient whole on every rank through the micro-step that skips the sync.
        pytest.param((*TINY_MLP, *FSDP_2, "trainer.accumulate=2"), id="mlp-fsdp-accumulate"),
        # The tied embedding and head (one unit, most of the model) gathered while the blocks
        # run, resharded while the loss does: +16% when counted as one block.
        pytest.param((*TINY_GPT, *FSDP_2, "data.vocab_size=4096"), id="gpt-fsdp-tied-unit"),
        # Parameters gathered in bf16, so activations in bf16 too: +11% traced in fp32.
        pytest.param(
            (
                "model=mlp",
                "trainer.batch_size=64",
                "logger=none",
                *FSDP_2,
                "trainer.precision=bf16",
            ),
            id="mlp-fsdp-bf16",
        ),
        pytest.param((*TINY_GPT, "parallel=cp"), id="gpt-cp2"),
        # ep's experts: FSDP all-gathers a rank's own, or copies them where it holds them
        # alone (ep = dp_shard); evaluation holds the exchange's tokens sent and received too.
        # 10 s (ep 2) and 16 s (fsdp 4 x ep 2) under -n 2 on 2 cores at a load of about 5.
        pytest.param((*TINY_MOE, "parallel=ep", "parallel.devices=2"), id="moe-ep2"),
        pytest.param(
            (*TINY_MOE, "parallel=ep", "parallel.devices=4", "parallel.ep=2"), id="moe-fsdp4xep2"
        ),
    ],
)
def test_predicted_mesh_peak_of_rank_0_within_10_percent_of_measured(compose_config, overrides):
    """measured_peaks_mb gives rank 0's peaks: the planner's share labelled cpu:0 is rank 0's
    (under pp the ranks' peaks differ: pp rank 0's is the first of its peers). Evaluation's is
    held to it too, except under pp, whose forward-only schedules hold more than the plan
    models (docs/planner.md)."""
    cfg = compose_config(*overrides)
    (plan,) = plan_all(cfg, [cfg.parallel])
    rank_0 = plan.device_plans[0]
    assert rank_0.label == "cpu:0"
    measured = measured_peaks_mb(cfg)
    assert rank_0.peak / MB == pytest.approx(measured["training"]["Total"], rel=0.10)
    if cfg.parallel.get("pp", 1) == 1:
        assert rank_0.evaluation / MB == pytest.approx(measured["evaluation"]["Total"], rel=0.10)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_offload_plans_the_shards_in_host_memory(compose_config, layout):
    """parallel.offload=cpu, planned for GPUs (it is refused on CPU): a device keeps FSDP's
    gathered units, the unsharded gradients and the activations; its shards of the parameters,
    gradients and optimizer state are in the host-memory column, outside the peak."""
    overrides = (*TINY_MLP, "optimizer=adamw", "plan.accelerator=cuda", f"parallel={layout}")
    cfg = compose_config(*overrides)
    offloaded = compose_config(*overrides, "parallel.offload=cpu").parallel
    (kept,), (moved,) = (plan_all(cfg, [p]).pop().device_plans for p in (cfg.parallel, offloaded))
    assert kept.host == 0 and moved.optimizer == 0
    assert moved.activations == kept.activations
    assert moved.host >= kept.peak - moved.peak > 0.3 * kept.peak
    assert "host MB" in format_table([plan_all(cfg, [offloaded])[0]], 80).splitlines()[1]


def test_plan_splits_state_and_adds_what_the_strategy_holds(compose_config):
    """FSDP holds a shard of the state, DDP a second copy of the gradients (its buckets)."""
    cfg = compose_config(*TINY_MLP)
    single, ddp, fsdp = plan_all(
        cfg,
        [
            cfg.parallel,
            compose_config(*TINY_MLP, "parallel=ddp").parallel,
            compose_config(*TINY_MLP, "parallel=fsdp", "parallel.devices=4").parallel,
        ],
    )
    (replica,) = ddp.device_plans
    assert replica.gradients == 2 * replica.parameters  # at the optimizer step: grads + buckets
    assert fsdp.peak < single.peak < ddp.peak
    assert fsdp.traffic["gradient reduce-scatter"] < ddp.traffic["gradient all-reduce"]


def test_a_plan_fits_only_if_its_evaluation_fits_too(compose_config):
    """An evaluation batch of 512 takes all 409 validation samples of the tiny gpt in one
    forward: about 19 MB, where a training step peaks at about 4 MB; 10 MB is too little."""
    cfg = compose_config(*TINY_GPT, "trainer.eval_batch_size=512", "plan.device_memory_gb=0.01")
    (plan,) = plan_all(cfg, [cfg.parallel])
    assert plan.peak < 0.01 * 2**30 < plan.eval_peak
    assert not plan.fits


def plan(name: str, peak_mb: float, step_ms: float) -> Plan:
    result = Plan(name, 2, None, step_time_s=step_ms / 1000, fits=peak_mb < 10)
    return result


def test_auto_chooses_the_fastest_plan_that_fits():
    plans = [plan("ddp", 50, 1), plan("fsdp", 5, 3), plan("dp", 5, 2)]
    best, reason = choose(plans)
    assert best.strategy == "dp"
    assert "too big: ddp" in reason and "\n" not in reason
    # A tie (on one device every strategy predicts single's step) goes to the plain run.
    assert choose([plan("cp", 5, 1), plan("single", 5, 1)])[0].strategy == "single"


def test_auto_resolves_to_a_strategy_and_says_why(compose_config):
    cfg = compose_config(*TINY_MLP, "parallel=auto", "plan.strategies=[dp,model_parallel]")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        resolved = resolve_auto(cfg)  # composes the candidates' options, as inside train.py
    assert resolved.parallel.name in ("dp", "model_parallel")
    assert resolved.parallel.devices == 2
    assert resolved.parallel.chosen_by.startswith(f"parallel=auto chose {resolved.parallel.name}")


def test_auto_may_choose_a_mesh_layout(compose_config):
    cfg = compose_config(*MESH_MLP, "parallel=auto", "plan.strategies=[tp,pp]")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        resolved = resolve_auto(cfg)
    assert resolved.parallel.name in ("tp", "pp")
    assert resolved.parallel._target_ == "src.parallel.strategies.mesh.Mesh"


def test_train_with_parallel_auto_records_the_choice(tmp_path):
    run_train(
        *TINY_MLP,
        "parallel=auto",
        "plan.strategies=[dp,dp_criterion]",
        "trainer.max_steps=2",
        "data.num_samples=300",
        run_dir=tmp_path,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] in ("dp", "dp_criterion")
    assert summary["chosen_by"].startswith(f"parallel=auto chose {summary['strategy']}")
    log = (tmp_path / "train.log").read_text()
    assert f'chosen_by="parallel=auto chose {summary["strategy"]} on' in log  # a sentence, quoted


@pytest.mark.parametrize(
    "command, message",
    [
        (["plan.py", "plan.strategies=[ddp,zero3]"], "plan.strategies: unknown strategy 'zero3'"),
        (["train.py", "parallel=auto", "plan.device_memory_gb=0"], "must be above 0, got 0.0"),
        (
            ["plan.py", "parallel=single", "parallel.devices=2"],
            "parallel=single uses one device, got parallel.devices=2",
        ),
    ],
    ids=["plan.py", "train.py", "plan.py-one-that-cannot-run"],
)
def test_bad_plan_settings_are_one_line_and_exit_2(command, message, tmp_path):
    script, *overrides = command
    run_dir = None if script == "plan.py" else tmp_path
    result = TrainRun(*overrides, "logger=none", script=script, run_dir=run_dir).finish()
    assert result.returncode == 2
    output = (result.stdout + result.stderr).splitlines()  # train.py logs its error line
    error_lines = [line for line in output if "error" in line.lower()]
    assert len(error_lines) == 1 and message in error_lines[0]


def test_a_strategy_without_a_cost_model_trains_but_plan_py_refuses_it_in_one_line(tmp_path):
    """`Strategy.cost_model` None (`tests/odd_strategies.py`): train.py runs it; plan.py, asked
    for it alone, names it and its class in one line and exits 2."""
    unpriced = ("parallel=single", "parallel._target_=tests.odd_strategies.Unpriced")
    run_train(*TINY_SGD, *unpriced, "trainer.max_steps=2", run_dir=tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    result = run_plan(*TINY_MLP, *unpriced)
    assert result.returncode == 2
    named = "parallel=single (tests.odd_strategies.Unpriced) has no cost model"
    assert [line for line in result.stderr.splitlines() if "cost model" in line] == [
        f"plan.py: error: {named} (Strategy.cost_model returns None): it trains, but cannot be "
        "planned"
    ]


def test_planning_leaves_a_strategy_without_a_cost_model_out_in_one_line(compose_config, caplog):
    """As parallel=auto does among the other strategies."""
    cfg = compose_config(*TINY_MLP)
    unpriced = cfg.parallel.copy()
    unpriced._target_ = "tests.odd_strategies.Unpriced"
    assert [plan.strategy for plan in plan_all(cfg, [unpriced, cfg.parallel])] == ["single"]
    left_out = [r.message for r in caplog.records if "cost model" in r.message]
    assert len(left_out) == 1 and left_out[0].startswith("left out: parallel=single (tests.")


def test_no_devices_is_refused_before_any_strategy_is_planned(compose_config):
    """`plan.py parallel.devices=0` once planned every strategy on 0 devices and then said that
    none fits the memory; plan.py prints this line and exits 2 as for the settings above."""
    cfg = compose_config("parallel.devices=0")
    with pytest.raises(ConfigError, match="parallel.devices must be at least 1, got 0"):
        candidate_parallels(cfg, every=True)


def test_plan_py_help_names_the_plan_settings():
    result = subprocess.run(
        [sys.executable, "plan.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "plan.device_memory_gb" in result.stdout and "parallel=auto" in result.stdout


def test_gpu_plan_shows_dp_output_device_and_each_stage(compose_config):
    """Planned for GPUs (no GPU needed): dp's output device holds the state and the gathered
    outputs, the replicas only parameters; a pipeline gets one row per stage."""
    overrides = (*TINY_MLP, "plan.accelerator=cuda", "data.num_classes=500")
    dp_cfg = compose_config(*overrides, "parallel=dp", "parallel.devices=3")
    pipeline = compose_config(*overrides, "parallel=model_parallel", "parallel.devices=3").parallel
    dp, stages = plan_all(dp_cfg, [dp_cfg.parallel, pipeline])
    output_device, *replicas = dp.device_plans
    assert [device.label for device in dp.device_plans] == ["cuda:0", "cuda:1", "cuda:2"]
    assert all(replica.gradients == replica.optimizer == 0 for replica in replicas)
    assert output_device.peak > max(replica.peak for replica in replicas)
    assert [device.label for device in stages.device_plans] == ["cuda:0", "cuda:1", "cuda:2"]
    assert sum(d.parameters for d in stages.device_plans) < 1.01 * output_device.parameters


def test_plan_py_plans_every_strategy_that_runs_and_recommends_one():
    result = run_plan(*TINY_MLP, "parallel.devices=2")
    assert result.returncode == 0, result.stderr
    *table, last = result.stdout.strip().splitlines()
    assert "peak MB  eval peak MB" in table[1]
    rows = {line.split()[0] for line in table[2:] if not line.startswith(" ")}
    assert {"ddp", "dp", "dp_criterion", "fsdp", "model_parallel", "tp", "pp", "fsdp_tp"} <= rows
    cannot = "cannot run: cp x2, ep x2, fsdp_cp_tp x2, fsdp_tp_pp x2, hybrid x2, single x2"
    assert f"{cannot} (plan one with parallel=<name> to see why)" in table
    assert last.startswith("recommended: parallel=") and "the fastest of those that fit" in last
    planned = [option for option in options("parallel") if option != "auto"]
    assert f"planned fsdp on 2 device(s) (6/{len(planned)}, " in result.stderr  # progress


def test_plan_py_plans_a_model_that_is_not_a_sequential_but_not_its_pipelines():
    """LoopMLP on 4 devices: every strategy that runs it whole on a CPU is planned, hybrid's
    two stages in each process included; the pipelines over processes are refused (and
    model_parallel's 4 stages of its 3 blocks), not the table."""
    result = run_plan(*TINY_LOOP, "parallel.devices=4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    (end,) = (i for i, line in enumerate(lines) if line.startswith("cannot run: "))
    rows = {line.split()[0] for line in lines[2:end] if not line.startswith(" ")}
    assert rows == {"ddp", "dp", "dp_criterion", "fsdp", "mesh", "hybrid"}
    cannot = lines[end].removeprefix("cannot run: ").partition(" (")[0].split(", ")
    assert {"pp x4", "model_parallel x4", "fsdp_tp_pp x4"} <= set(cannot)
    assert lines[-1].startswith("recommended: parallel=")


def test_the_planner_refuses_a_pipeline_of_a_model_that_is_not_a_sequential(compose_config):
    """LoopMLP's segments: its 3 blocks between the two ends of its rest (stem and head), which
    share its parameters. Stages of them are refused in one line of the planner's own, whether
    or not the strategy cuts the model: it traces stages as runs of a Sequential's children."""
    cfg = compose_config(*TINY_LOOP)
    settle_model_settings(cfg)  # model=mlp's own keys left out, as plan_all does
    data = build_data(cfg.data, cfg.seed)
    sizes = model_sizes(cfg, data)
    assert len(sizes.block_parameter_bytes) == 3 + 2  # the blocks between the rest's two ends
    assert sorted(sizes.shared_blocks, key=min)[0] == [0, 4]  # tied: FSDP's root unit
    model, _ = meta_model_and_inputs(cfg, data, 2)
    stages = [DeviceShare("cpu:0", 8, blocks=(0, 2)), DeviceShare("cpu:1", 8, blocks=(2, 5))]
    with pytest.raises(ConfigError, match="the planner prices pipeline stages of an nn.Sequen"):
        check_traceable(model, stages)
    check_traceable(model, [DeviceShare("cpu:0", 8)])


def test_equal_shares_are_traced_once(compose_config, monkeypatch):
    """ddp and fsdp give each of 2 devices the same half batch through the whole model: one
    trace serves both (fsdp then shards its state), with the plans as when traced apart."""
    traced = []
    trace_share = src.planning.planner.trace_share
    monkeypatch.setattr(
        src.planning.planner, "trace_share", lambda *a: traced.append(a) or trace_share(*a)
    )
    cfg = compose_config(*TINY_MLP, "parallel=ddp")
    fsdp = compose_config(*TINY_MLP, "parallel=fsdp").parallel
    together = plan_all(cfg, [cfg.parallel, fsdp])
    assert len(traced) == 1
    apart = [plan_all(cfg, [parallel])[0] for parallel in (cfg.parallel, fsdp)]
    assert [p.device_plans for p in together] == [p.device_plans for p in apart]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_trace_keeps_the_peak_while_the_model_runs_apart_from_the_optimizer_step(
    compose_config, monkeypatch, checkpointing
):
    """While the model runs, the trace holds more activations (recomputed ones included) and
    only some gradients; at the optimizer step every gradient, and AdamW's temporaries beside
    its two moments. The phases come from MemTracker's internals."""
    traces = []
    trace_share = src.planning.planner.trace_share
    monkeypatch.setattr(
        src.planning.planner, "trace_share", lambda *a: traces.append(trace_share(*a)) or traces[-1]
    )
    cfg = compose_config(
        *TINY_MLP, "optimizer=adamw", f"trainer.activation_checkpointing={checkpointing}"
    )
    plan_all(cfg, [cfg.parallel])
    (traced,) = traces
    running, stepping = traced.peaks[RUNNING], traced.peaks[STEPPING]
    kind = _MemRefType
    assert running[kind.ACT] > stepping[kind.ACT]
    assert running[kind.GRAD] < stepping[kind.GRAD] == stepping[kind.PARAM]
    assert stepping[kind.OPT] > running[kind.OPT] >= 2 * running[kind.PARAM]


def test_muon_s_step_temporaries_are_planned_whole_beside_its_split_momentum(
    compose_config, monkeypatch
):
    """optimizer=muon: the trace steps torch's Muon on whole matrices, and what its step makes
    (at least the widest block matrix's update, 64 x 64 in fp32) is planned whole on every
    rank however its state is split, as each rank gathers each matrix (AdamW's temporaries are
    its shards'); its state is one momentum per block matrix, two moments (AdamW's) for the
    rest (biases), under AdamW's two per parameter."""
    traces = []
    trace_share = src.planning.planner.trace_share
    monkeypatch.setattr(
        src.planning.planner, "trace_share", lambda *a: traces.append(trace_share(*a)) or traces[-1]
    )
    cfg = compose_config(*TINY_MLP, "optimizer=muon")
    plan_all(cfg, [cfg.parallel])
    (muon,) = traces
    assert muon.whole_step_bytes >= 64 * 64 * 4
    held = muon.peaks[RUNNING]
    assert held[_MemRefType.PARAM] < held[_MemRefType.OPT] < 2 * held[_MemRefType.PARAM]
    fsdp = DeviceShare("cpu:0", 1, state_shards=4)
    whole = muon.whole_step_bytes
    assert unsplit_step_bytes(whole, fsdp) == {"optimizer": whole - whole // 4}


class FixedCPU(DeviceSpeed):
    """A CPU with given figures: FLOP/s by intra-op threads, a message's bytes/s between
    processes and in-memory bytes/s (no per-op cost or latency)."""

    def __init__(self, flops_per_s: dict[int, float], link: float, copy: float):
        self.rates, self.link, self.copy = flops_per_s, link, copy

    def flops_per_s(self, threads: int, size: int) -> float:
        return self.rates[threads]

    def message_s(self, messages: Messages, processes: int) -> float:
        return messages.count * messages.size / self.link

    def copy_bytes_per_s(self) -> float:
        return self.copy


@pytest.mark.parametrize(
    "speed, chosen",
    [
        # A second thread adds nothing (cores shared with others): two processes of one thread
        # each halve the work, and the link is fast.
        (FixedCPU({1: 1e9, 2: 1e9}, link=1e10, copy=1e10), "ddp"),
        # Threads scale perfectly and the link is slow: one process on both cores wins.
        (FixedCPU({1: 1e9, 2: 2e9}, link=1e6, copy=1e10), "model_parallel"),
    ],
    ids=["threads-do-not-scale", "slow-link"],
)
def test_auto_on_cpu_ranks_by_the_measured_speed(compose_config, monkeypatch, speed, chosen):
    """On CPU a process's devices share its cores: model_parallel's two stages in one process
    cost all of the model's FLOPs at the process's threads, ddp's two processes each half of
    them at one thread each, plus the gradient all-reduce over the link."""
    monkeypatch.setattr(src.planning.planner, "usable_cores", lambda: 2)
    cfg = compose_config(*TINY_MLP, "parallel=ddp", "trainer.accelerator=cpu")
    pipeline = compose_config(*TINY_MLP, "parallel=model_parallel").parallel
    ddp, stages = plan_all(cfg, [cfg.parallel, pipeline], speed=speed)
    flops = stages.device_plans[0].flops
    assert ddp.device_plans[0].flops == pytest.approx(flops / 2, rel=0.01)
    assert stages.step_time_s == pytest.approx(
        flops / speed.rates[2] + sum(stages.traffic.values()) / speed.copy
    )
    compute = flops / 2 / speed.rates[1]
    (all_reduce,) = ddp.messages  # during backward: only what outlasts it counts
    assert all_reduce.overlapped
    after_backward = max(0, all_reduce.size / speed.link - BACKWARD_SHARE * compute)
    assert ddp.step_time_s == pytest.approx(compute + after_backward, rel=0.01)
    assert choose([ddp, stages])[0].strategy == chosen


# An MLP of 4 Linears (16-32, 32-32, 32-32, 32-8), in two tensor-parallel pairs: (0, 1) and
# (2, head). Parameters in floats: 544, 1056, 1056 and 264 by block, 2920 in all.
MESH_MLP = (
    *("model.hidden=32", "model.depth=3", "data.input_dim=16", "data.num_classes=8"),
    *("trainer.batch_size=16", "logger=none"),
)
FLOAT = 4


def mesh_plans(compose_config, *layouts: tuple[str, ...]) -> list[Plan]:
    """`single` and each layout (overrides of `parallel=...`) planned on MESH_MLP."""
    cfg = compose_config(*MESH_MLP)
    parallels = [compose_config(*MESH_MLP, *layout).parallel for layout in layouts]
    return plan_all(cfg, [cfg.parallel, *parallels])


def test_tensor_parallel_splits_the_planned_linears_and_all_reduces_each_pair(compose_config):
    """Colwise Linears split weight and bias, Rowwise ones their weight (their biases, 32 + 8
    floats, stay whole): each of 2 tp ranks keeps 40 + 2880 / 2 = 1480 of the 2920 floats, and
    half the FLOPs (every Linear is split). Per step each pair all-reduces its output forward,
    (32 + 8) floats x 16 samples, and the gradient of its input backward, but the first pair's
    (the data needs none): 32 floats x 16 samples; a ring all-reduce of S bytes over 2 ranks
    sends 2 (2 - 1) / 2 S from each."""
    single, tp = mesh_plans(compose_config, ("parallel=tp", "parallel.devices=2"))
    (whole,), (split,) = single.device_plans, tp.device_plans
    assert whole.parameters == 2920 * FLOAT
    assert split.parameters == pytest.approx(1480 * FLOAT, abs=1)
    assert split.optimizer == pytest.approx(whole.optimizer * 1480 / 2920, abs=1)
    assert split.flops == pytest.approx(whole.flops / 2, abs=1)
    assert tp.traffic == {"activation all-reduce": 2 * (2 - 1) * ((40 + 32) * FLOAT * 16) // 2}


def test_dtensor_s_dispatch_is_counted_where_parameters_and_layers_are_dtensors(compose_config):
    """MESH_MLP at depth 4: five Linears, tp's two pairs and a head it leaves whole. Under tp 2
    the pairs' 4 Linears run forward and backward on DTensors, and 8 of the 10 parameter
    tensors are DTensors, so 8/10 of the optimizer's ops (it runs the same ops per tensor);
    under fsdp every parameter is a DTensor (its layers compute on the gathered plain ones);
    under single and ddp none. A tp layer runs once per micro-batch of the pipeline."""
    five = (*MESH_MLP, "model.depth=4")
    cfg = compose_config(*five)
    layouts = [
        ("parallel=tp",),
        ("parallel=fsdp",),
        ("parallel=ddp",),
        ("parallel=fsdp_tp", "parallel.devices=4"),
        ("parallel=fsdp_tp_pp", "parallel.devices=4"),
    ]
    parallels = [cfg.parallel, *(compose_config(*five, *layout).parallel for layout in layouts)]
    single, tp, fsdp, ddp, fsdp_tp, tp_pp = (p.device_plans for p in plan_all(cfg, parallels))
    assert [tp[0].dtensor_layers, fsdp[0].dtensor_layers, single[0].dtensor_layers] == [4, 0, 0]
    assert fsdp[0].dtensor_ops > 0 and tp[0].dtensor_ops == pytest.approx(0.8 * fsdp[0].dtensor_ops)
    assert single[0].dtensor_ops == ddp[0].dtensor_ops == 0
    # fsdp 2 x tp 2: FSDP2 makes every parameter a DTensor, and tp's layers run on DTensors
    assert (fsdp_tp[0].dtensor_ops, fsdp_tp[0].dtensor_layers) == (fsdp[0].dtensor_ops, 4)
    # tp 2 x pp 2 (no FSDP): each stage holds one pair, run once for each of 2 micro-batches;
    # stage 0's 4 parameter tensors are its pair's, stage 1's 6 its pair's 4 and the head's 2
    # (plain): 4 of the model's 10 tensors' optimizer ops on DTensors in each stage (AdamW runs
    # about as many ops for each tensor)
    assert [device.dtensor_layers for device in tp_pp] == [2 * 2, 2 * 2]
    shares = [device.dtensor_ops / fsdp[0].dtensor_ops for device in tp_pp]
    assert shares == pytest.approx([0.4, 0.4], abs=0.02)


def test_a_model_s_own_tensor_parallel_styles_reach_the_planner(compose_config):
    """tests/styled_models.py's model, styled through its hook on MESH_MLP's sizes, depth 1:
    stem 544, block 2112 (up) + 2080 (down) and head 264 floats, 5000 in all. Its styles split up's
    weight and bias and down's weight, 4160 floats: each of 2 tp ranks keeps 5000 - 4160 / 2."""
    own = ("model._target_=tests.styled_models.ResidualFeedForward", "model.depth=1")
    cfg = compose_config(*MESH_MLP, *own)
    single, tp = plan_all(
        cfg, [cfg.parallel, compose_config(*MESH_MLP, *own, "parallel=tp").parallel]
    )
    assert single.device_plans[0].parameters == 5000 * FLOAT
    assert tp.device_plans[0].parameters == pytest.approx(2920 * FLOAT, abs=1)


def test_sequence_parallel_sends_an_all_gather_and_a_reduce_scatter_for_each_all_reduce(
    compose_config,
):
    """A transformer of 2 blocks, each an attention and an MLP pair whose output is 8 tokens x
    32 features: 4 x 1024 bytes per sample, 16 samples. Without sequence parallel each pair's
    output and its gradient are all-reduced (each rank sends 2 (2 - 1) / 2 of them); with it,
    all-gathered and reduce-scattered, (2 - 1) / 2 of them each, twice: as much in all."""
    transformer = (
        *("model=transformer", "data=synthetic_tokens", "data.seq_len=8", "data.vocab_size=16"),
        *("model.hidden=32", "model.depth=2", "model.heads=2", "trainer.batch_size=16"),
        *("parallel=tp", "logger=none"),
    )
    cfg = compose_config(*transformer)
    parallel = compose_config(*transformer, "parallel.sequence_parallel=true").parallel
    plain, sequence = plan_all(cfg, [cfg.parallel, parallel])
    summed = 4 * 8 * 32 * FLOAT * 16
    assert plain.traffic == {"activation all-reduce": 2 * 2 * (2 - 1) * summed // 2}
    # Where the tokens are, not the work: the same FLOPs per tp rank (the plan's layout change
    # around a whole attention once counted it as split a second time: a rank's FLOPs at 0).
    assert sequence.device_plans[0].flops == plain.device_plans[0].flops
    assert sequence.traffic == {
        "activation all-gather": 2 * (2 - 1) * summed // 2,
        "activation reduce-scatter": 2 * (2 - 1) * summed // 2,
    }


def test_fsdp_by_tp_shards_what_each_tp_rank_keeps(compose_config):
    """fsdp 2 x tp 2: each rank's 1480 floats are sharded 2 ways, plus FSDP's working set at
    its peak, in block 1's backward, of units as a tp rank keeps them: block 1 gathered (1024 / 2
    + 32 floats) and block 0 gathered ahead of it ((512 + 32) / 2), block 2's gradients ((1024 +
    32) / 2) waiting for their reduce-scatter. Each data-parallel share is 8 samples, so the
    pairs all-reduce half as much as under tp 2 alone."""
    _, mesh = mesh_plans(compose_config, ("parallel=fsdp_tp",))
    (rank,) = mesh.device_plans
    assert rank.parameters == pytest.approx((1480 // 2 + 544 + 272) * FLOAT, abs=1)
    # The trace's gradients at that moment, shared out (602 floats), and block 2's waiting.
    assert rank.gradients == pytest.approx((602 + 528) * FLOAT, abs=1)
    assert mesh.traffic == {
        "activation all-reduce": 2 * (2 - 1) * ((40 + 32) * FLOAT * 8) // 2,
        "parameter all-gather": 2 * 1480 * FLOAT // 2,
        "gradient reduce-scatter": 1480 * FLOAT // 2,
    }


@pytest.mark.parametrize(
    "schedule, stages_per_rank, rank_floats, boundaries, bubble",
    [
        # Blocks 0-1 (1600 floats) and 2-3 (1320), balanced by parameters; one boundary.
        ("1F1B", 1, [1600, 1320], 1, (2 - 1) / (2 + 2 - 1)),
        # One block per stage, rank 0 holding stages 0 and 2, rank 1 stages 1 and 3.
        ("Interleaved1F1B", 2, [544 + 1056, 1056 + 264], 3, (2 - 1) / (2 * 2 + 2 - 1)),
    ],
)
def test_pipeline_ranks_hold_their_stages_and_send_their_boundaries(
    compose_config, monkeypatch, schedule, stages_per_rank, rank_floats, boundaries, bubble
):
    """pp 2 over 2 micro-batches: each rank holds its stages' blocks; every boundary sends a
    block's output (32 floats per sample, 16 samples) forward and its gradient back. On CPU
    each rank is a process on one of the 2 cores: the step is the busiest rank's FLOPs,
    stretched by the schedule's bubble, plus the traffic over the link."""
    layout = ("parallel=pp", f"parallel.schedule={schedule}")
    monkeypatch.setattr(src.planning.planner, "usable_cores", lambda: 2)
    cfg = compose_config(*MESH_MLP, *layout, f"parallel.stages_per_rank={stages_per_rank}")
    speed = FixedCPU({1: 1e9}, link=1e9, copy=1e10)
    (pp,) = plan_all(cfg, [cfg.parallel], speed=speed)
    assert [device.label for device in pp.device_plans] == ["cpu:0", "cpu:1"]
    assert [device.parameters for device in pp.device_plans] == [f * FLOAT for f in rank_floats]
    assert pp.traffic == {"stage activations": boundaries * 2 * 32 * FLOAT * 16}
    busiest = max(device.flops for device in pp.device_plans)
    expected = busiest / 1e9 / (1 - bubble) + sum(pp.traffic.values()) / 1e9
    assert pp.step_time_s == pytest.approx(expected)
    assert sum(m.count * m.size for m in pp.messages) == sum(pp.traffic.values())
