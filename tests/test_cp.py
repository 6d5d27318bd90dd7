"""Context parallel (`parallel.cp`, src/parallel/cp/) through the real
`train.py`: gloo processes on CPU, the tiny GPT under SGD in fp32, each layout against `single`:
cp 2; cp 4, cp 2 x dp_shard 2 and cp 2 x tp 2 in one sweep of 4 processes; fsdp_cp_tp on 8;
each one's sharded checkpoint resumed exactly under another layout; the predictions of whole
sequences. This file alone took about 85 CPU-seconds (cgcpu.sh), two fifths of them the
4-process sweep and its resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    TINY_GPT_SGD,
    assert_goes_on_exactly,
    assert_same_training,
    resumed_sweep_runs,
    run_eval,
    summary,
    sweep_runs,
)
from torch import nn

from src.components.models import GPT
from src.config.base import ConfigError
from src.parallel.cp.apply import check_attention
from src.parallel.layout import Layout

# 4 steps, checkpointed (sharded) at 2 and 4: the resumes go on from step 2. One block: each
# block's attention is cut, ringed and wrapped alike, and a second cost the 4-process sweep
# 15-20% more CPU.
WORKLOAD = (
    *TINY_GPT_SGD,
    "model.n_layer=1",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.checkpoint_every=2",
    "trainer.checkpoint_format=sharded",
)


def two_process_runs() -> dict[str, Path]:
    """single (the reference for every layout here) and cp 2, in one sweep."""
    runs = sweep_runs(*WORKLOAD, "parallel=single,cp")
    return {key.removeprefix("parallel="): run_dir for key, run_dir in runs.items()}


@pytest.mark.equivalence
def test_cp_2_trains_exactly_like_single():
    runs = two_process_runs()
    assert_same_training(runs["single"], runs["cp"])
    result = summary(runs["cp"])
    assert result["world_size"] == 1  # both ranks read the same samples
    assert result["layout"] == "cp2"
    assert len(list((runs["cp"] / "checkpoints" / "step-000004").glob("*.distcp"))) == 2


def eight_process_run() -> Path:
    """fsdp_cp_tp (2 x 2 x 2), run once: its checkpoint is resumed under cp 2."""
    (run_dir,) = sweep_runs(*WORKLOAD, "parallel=fsdp_cp_tp").values()
    return run_dir


def step_2(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step-000002"


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", ["cp", "single"])
def test_sharded_checkpoints_resume_exactly_resharded_to_cp_2_and_single(layout):
    """cp 2 resumes fsdp_cp_tp's step-2 checkpoint (8 ranks' shards read by 2), single cp 2's."""
    resume = {
        "parallel=cp": step_2(eight_process_run()),
        "parallel=single": step_2(two_process_runs()["cp"]),
    }
    runs = resumed_sweep_runs(*WORKLOAD, "parallel=cp,single", resume=resume)
    assert_goes_on_exactly(two_process_runs()["single"], runs[f"parallel={layout}"], [3, 4])


# One sweep of 4 processes: tp takes the ranks that dp_shard and cp leave (the job that would
# need 8 is skipped). In this order, each layout's step-2 checkpoint is resumed by the next.
FOUR_PROCESS = {
    "parallel.dp_shard=1 parallel.cp=4": "cp4",
    "parallel.dp_shard=2 parallel.cp=2": "fsdp2xcp2",
    "parallel.dp_shard=1 parallel.cp=2": "cp2xtp2",
}
ON_4_PROCESSES = ("parallel=cp", "parallel.devices=4", "parallel.tp=-1")
EACH_LAYOUT = ("parallel.dp_shard=1,2", "parallel.cp=2,4")


def four_process_runs() -> dict[str, Path]:
    return sweep_runs(*WORKLOAD, *ON_4_PROCESSES, *EACH_LAYOUT)


@pytest.mark.equivalence
@pytest.mark.parametrize("degrees", list(FOUR_PROCESS))
def test_cp_composes_with_dp_shard_and_tp_on_4_processes(degrees):
    runs = four_process_runs()
    assert_same_training(two_process_runs()["single"], runs[degrees])
    assert summary(runs[degrees])["layout"] == FOUR_PROCESS[degrees]


@pytest.mark.equivalence
@pytest.mark.parametrize("degrees", list(FOUR_PROCESS))
def test_each_4_process_layout_resumes_another_s_checkpoint_exactly(degrees):
    """cp4's step-2 checkpoint resumed as fsdp2xcp2, fsdp2xcp2's as cp2xtp2, cp2xtp2's as cp4:
    each checkpoint holds exactly the state, and each layout restores it into its own shards."""
    saved, cycle = four_process_runs(), list(FOUR_PROCESS)
    resume = {resumer: step_2(saved[cycle[index - 1]]) for index, resumer in enumerate(cycle)}
    runs = resumed_sweep_runs(*WORKLOAD, *ON_4_PROCESSES, *EACH_LAYOUT, resume=resume)
    assert_goes_on_exactly(two_process_runs()["single"], runs[degrees], [3, 4])


@pytest.mark.equivalence
def test_fsdp_cp_tp_trains_exactly_like_single_on_8_processes():
    assert_same_training(two_process_runs()["single"], eight_process_run())
    assert summary(eight_process_run())["layout"] == "fsdp2xcp2xtp2"


@pytest.mark.equivalence
def test_predictions_under_cp_are_single_s_whole_sequences(tmp_path):
    """eval.py's outputs per sample gathered back into whole sequences, in order."""
    run_dir = two_process_runs()["cp"]
    predictions = {}
    for layout in ("single", "cp"):
        eval_dir = tmp_path / layout
        run_eval(
            f"ckpt_path={run_dir}",
            "split=val",
            "predict=true",
            f"parallel={layout}",
            eval_dir=eval_dir,
        )
        predictions[layout] = torch.load(eval_dir / "predictions.pt", weights_only=True)
    single, cp = predictions["single"], predictions["cp"]
    assert torch.equal(cp["indices"], single["indices"])
    torch.testing.assert_close(cp["outputs"], single["outputs"], rtol=0, atol=1e-5)


def test_cp_is_a_degree_of_the_layout():
    layout = Layout.of(8, dp_shard=-1, cp=2, tp=2)
    assert layout == Layout(dp_shard=2, cp=2, tp=2) and layout.dp == 2
    assert layout.label() == "fsdp2xcp2xtp2"
    # tp varies fastest, then cp: ranks 0 and 2 are one sequence's cp pair.
    assert [layout.coordinates(rank)["cp"] for rank in range(4)] == [0, 0, 1, 1]
    assert {layout.dp_rank(rank) for rank in range(4)} == {0}
    with pytest.raises(ConfigError, match=r"multiply to 4 \(pp 1 x dp_replicate 1 x dp_shard 1"):
        Layout.of(2, pp=1, dp_replicate=1, dp_shard=1, cp=2, tp=2)


class ArangePositions(nn.Module):
    """Causal attention over positions made in the forward pass, as cp cannot split them."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Embedding(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.position(torch.arange(tokens.shape[1], device=tokens.device))
        q = x.expand(tokens.shape[0], 1, -1, -1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)


def test_positions_made_in_the_forward_pass_are_refused_and_a_buffer_is_split():
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with pytest.raises(ConfigError, match=r"torch.arange\(8\) .* a buffer named `positions`"):
        check_attention(ArangePositions().to("meta"), tokens)
    with torch.device("meta"):
        model = GPT(input_shape=(8,), num_classes=16, n_layer=1, n_head=2, n_embd=8)
    check_attention(model, tokens)  # GPT's TokenEmbedding keeps its positions in a buffer
    assert "0.positions" not in model.state_dict()  # not saved: any layout's are single's
