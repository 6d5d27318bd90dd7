"""`parallel=fsdp` through the real `train.py`: FSDP2 over gloo process groups on CPU, NCCL
where GPUs are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import (
    ROOT,
    TINY,
    TINY_SGD,
    TINY_TRANSFORMER_SGD,
    assert_same_losses,
    assert_same_training,
    checkpoint,
    gpu_count,
    needs_gpus,
    reference_run,
    run_train,
    summary,
)

from src.components.models import MLP

FSDP = ("parallel=fsdp", "parallel.devices=2")
# SGD (helpers.TINY_SGD) also because Adam's steps hardly change when every gradient is scaled
# down (clipped).
CLIP_ACCUMULATE = (*TINY_SGD, "trainer.accumulate=2", "trainer.grad_clip=0.05")


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "workload", [CLIP_ACCUMULATE, TINY_TRANSFORMER_SGD], ids=["mlp-clip-accumulate", "transformer"]
)
def test_fsdp_trains_exactly_like_single(tmp_path, workload):
    run_train(*workload, *FSDP, run_dir=tmp_path)

    assert_same_training(reference_run(*workload), tmp_path)
    result = summary(tmp_path)
    assert result["strategy"] == "fsdp" and result["world_size"] == 2
    assert result["memory_devices"] == ["cpu:rank0", "cpu:rank1"]
    assert len(result["peak_memory_mb"]) == 2 and min(result["peak_memory_mb"]) > 0


def test_the_clipped_workload_really_clips():
    clipped = checkpoint(reference_run(*CLIP_ACCUMULATE))["model"]
    unclipped = checkpoint(reference_run(*TINY_SGD))["model"]
    assert max((clipped[key] - unclipped[key]).abs().max() for key in clipped) > 1e-2


@pytest.mark.equivalence
def test_fsdp_checkpoint_is_in_single_s_format_and_single_resumes_from_it(tmp_path):
    """Half a run under fsdp, the rest under single: the same losses as an uninterrupted single
    run, so the gathered weights and Adam state are whole (Adam: missing second moments would
    blow the next steps up). (fsdp resuming its own checkpoints, which are in the same format, is
    in test_resume.py.)"""
    run_train(*TINY, *FSDP, "trainer.max_steps=3", run_dir=tmp_path)
    state = checkpoint(tmp_path)
    MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3).load_state_dict(state["model"])
    assert state["step"] == 3
    assert list(state["optimizer"]["state"]) == list(range(8))  # single's parameter indices
    groups = state["optimizer"]["param_groups"]  # adamw's: the weights, then the biases
    assert [group["params"] for group in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    resumed = run_train(*TINY, "parallel=single", "trainer.resume=auto", run_dir=tmp_path)

    assert "at step 3" in resumed.stdout
    assert_same_losses(reference_run(*TINY), tmp_path)


# One rank, in a process of its own (a process group outlives a failed test in pytest's). It
# ends as the template's commands do (`exit_without_teardown`): once under a loaded suite, the
# interpreter's teardown of torch aborted ("terminate called without an active exception") after
# the figures were printed.
WHAT_A_LAYER_SEES = """
import json, sys, torch
from src.config.parallel import MeshConfig
from src.components.models import MLP
from src.components.tasks import loss_sum
from src.parallel import build_strategy
from src.runtime.torch_private import exit_without_teardown

with exit_without_teardown():
    mesh = "src.parallel.strategies.mesh.Mesh"
    config = MeshConfig(_target_=mesh, name="fsdp", devices=1, dp_shard=-1)
    strategy = build_strategy(config, "cpu", sys.argv[1])
    strategy.setup()
    model = strategy.wrap(MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3))
    gathered = []
    layer = model[1][0]
    layer.register_forward_pre_hook(lambda layer, _: gathered.append(str(layer.weight.dtype)))
    strategy.apply(model, torch.randn(4, 32), torch.randint(0, 10, (4,)), loss_sum).backward()
    params = list(model.parameters())
    print(json.dumps({
        "gathered": gathered,
        "kept": sorted({str(p.dtype) for p in params} | {str(p.grad.dtype) for p in params}),
        "sharded": all(type(p).__name__ == "DTensor" for p in params),
    }), flush=True)
    strategy.teardown()
"""


@pytest.mark.parametrize("precision, gathered", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_bf16_gathers_bf16_parameters_but_keeps_fp32_shards_and_gradients(precision, gathered):
    result = subprocess.run(
        [sys.executable, "-c", WHAT_A_LAYER_SEES, precision],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"gathered": [f"torch.{gathered}"], "kept": ["torch.float32"], "sharded": True}


@pytest.mark.cuda
@pytest.mark.equivalence
@needs_gpus(1)
def test_fsdp_on_gpus_uses_nccl_and_bf16_trains_like_single_bf16(tmp_path):
    devices = min(2, gpu_count())
    fsdp = ("parallel=fsdp", f"parallel.devices={devices}", "trainer.accelerator=cuda")
    run_train(*TINY_SGD, *fsdp, run_dir=tmp_path / "fp32")
    assert summary(tmp_path / "fp32")["memory_devices"] == [f"cuda:{i}" for i in range(devices)]
    assert "cuda:0, nccl" in (tmp_path / "fp32" / "train.log").read_text()
    assert_same_training(reference_run(*TINY_SGD, "trainer.accelerator=cuda"), tmp_path / "fp32")

    bf16 = (*TINY_SGD, "trainer.accelerator=cuda", "trainer.precision=bf16")
    run_train(*bf16, *fsdp, run_dir=tmp_path / "bf16")
    # bf16 rounding differs (fsdp casts the weights once, autocast per op): close, not equal.
    assert_same_training(reference_run(*bf16), tmp_path / "bf16", atol=1e-2)


@pytest.mark.equivalence
def test_fsdp_starts_every_rank_from_rank_0s_weights(tmp_path):
    """As DDP does: a model whose initialisation is not all from the seeded RNG (here, from the
    rank) would otherwise train a different model on each rank."""
    workload = (*TINY_SGD, "model._target_=tests.odd_models.RankSeededMLP")
    run_train(*workload, *FSDP, run_dir=tmp_path)
    assert_same_training(reference_run(*workload), tmp_path)


@pytest.mark.equivalence
def test_fsdp_trains_a_model_whose_blocks_share_a_parameter_like_single(tmp_path):
    """Tied embeddings: the first block and the last share a weight, so they form one unit."""
    workload = (*TINY_TRANSFORMER_SGD, "model._target_=tests.odd_models.TiedTransformer")
    run_train(*workload, *FSDP, run_dir=tmp_path)
    assert_same_training(reference_run(*workload), tmp_path)
