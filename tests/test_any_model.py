"""Models the template did not write train under the strategies: a plain `nn.Module` that loops
over a `ModuleList` (tests/odd_models.py's LoopMLP, the shape of most research code), Hugging
Face transformers' Llama and GPT-2, and timm's image models, each through the real `train.py`
and held to `single` under SGD (losses and final weights within 1e-5)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    TINY_SGD,
    assert_goes_on_exactly,
    assert_same_training,
    checkpoint,
    reference_run,
    run_train,
    strategy_runs,
    summary,
)
from odd_models import LoopMLP
from omegaconf import OmegaConf

from src.components.hf import causal_lm
from src.components.model_contract import model_blocks, model_target, settle_model_settings
from src.config.base import ConfigError
from src.parallel.cp.apply import check_attention

transformers = pytest.importorskip("transformers")
TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])
timm = pytest.importorskip("timm")

# model=mlp's own keys (TINY's model.hidden and model.depth) are left out of LoopMLP's.
LOOP_MLP = (*TINY_SGD, "model._target_=tests.odd_models.LoopMLP", "+model.width=32")
LOOP_MLP = (*LOOP_MLP, "+model.layers=3", "trainer.accumulate=2", "trainer.grad_clip=0.05")
TINY_TOKENS = ("data.seq_len=8", "data.vocab_size=16", "data.num_samples=600")
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


def without_mlp_sizes(overrides: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(o for o in overrides if not o.startswith(("model.hidden=", "model.depth=")))


# The libraries' models are held to single by their training alone: no evaluation passes.
TRAINING_ONLY = (*without_mlp_sizes(TINY_SGD), "trainer.eval_every=0", "trainer.test=false")
LLAMA = (
    *TRAINING_ONLY,
    "model=hf_causal_lm",
    *TINY_TOKENS,
    "model.sizes.hidden_size=32",
    "model.sizes.intermediate_size=64",
)
GPT2 = (
    *LLAMA,
    "model.config=gpt2",
    # Llama's size names (the schema's) are GPT-2's too, through its config's attribute map.
    *(f"+model.sizes.{key}=0.0" for key in DROPOUTS),
)
IMAGES = (*TRAINING_ONLY, "data.image_shape=[3,16,16]", "data.input_dim=768")
TIMM = (*IMAGES, "model=timm")


# model_parallel and hybrid cut it into stages traced by torch (pp's cut), in one process.
LOOP_MLP_STRATEGIES = ("dp", "dp_criterion", "ddp", "fsdp", "mesh", "model_parallel", "hybrid")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", LOOP_MLP_STRATEGIES)
def test_a_plain_module_with_a_module_list_trains_like_single(strategy):
    runs = strategy_runs(*LOOP_MLP, strategies=LOOP_MLP_STRATEGIES)
    assert_same_training(runs["single"], runs[strategy])


# pp's stages of LoopMLP, traced by torch (not an nn.Sequential), under a one-stage and a looped
# schedule (its 3 blocks as 4 stages would be too few: 2 per rank of 2 takes 4 blocks); the 60
# validation samples in batches of 7 end with a smaller batch, traced for its own shape.
PP = ("parallel=pp", "parallel.microbatches=4", "trainer.eval_batch_size=7")
LOOP_MLP_PP = (*LOOP_MLP, *PP)


@pytest.mark.equivalence
@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_plain_module_with_a_module_list_trains_like_single_in_pipeline_stages(
    checkpoint_format, tmp_path
):
    """Saved at step 3 in either format, single's keys; resumed from it, the run goes on as
    single's did."""
    saving = (
        *LOOP_MLP_PP,
        "trainer.checkpoint_every=3",
        f"trainer.checkpoint_format={checkpoint_format}",
    )
    run_train(*saving, run_dir=tmp_path / "pp")
    reference = reference_run(*LOOP_MLP)
    assert_same_training(reference, tmp_path / "pp")
    assert summary(tmp_path / "pp")["pipeline"]["stages"] == 2
    resume = tmp_path / "pp" / "checkpoints" / "step-000003"
    run_train(*saving, f"trainer.resume={resume}", run_dir=tmp_path / "resumed")
    assert_goes_on_exactly(reference, tmp_path / "resumed", [4, 5, 6])


@pytest.mark.equivalence
def test_a_plain_module_trains_like_single_under_a_looped_schedule(tmp_path):
    """Saved sharded, stages 0 and 2 on one rank: the checkpoint reads back in single's key
    order (its recorded `state_dict_keys`), not in the order its ranks wrote."""
    four_blocks = (*(o for o in LOOP_MLP if o != "+model.layers=3"), "+model.layers=4")
    looped = ("parallel.schedule=Interleaved1F1B", "parallel.stages_per_rank=2")
    run_train(*four_blocks, *PP, *looped, "trainer.checkpoint_format=sharded", run_dir=tmp_path)
    assert_same_training(reference_run(*four_blocks), tmp_path)


LLAMA_STRATEGIES = ("ddp", "fsdp", "tp", "fsdp_tp", "cp")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", LLAMA_STRATEGIES)
def test_a_transformers_llama_trains_like_single(strategy):
    """tp splits it by its config's own styles (`base_model_tp_plan`: q, k, v, gate and up
    colwise, o and down rowwise); cp gives each rank its tokens' `position_ids` in the whole
    sequence, and its attention runs causal in torch's ring."""
    runs = strategy_runs(*LLAMA, strategies=LLAMA_STRATEGIES)
    assert_same_training(runs["single"], runs[strategy])
    assert "model.layers.0.self_attn.q_proj.weight" in checkpoint(runs[strategy])["model"]


@pytest.mark.parametrize("config", ["llama", "mistral"])
def test_cp_takes_transformers_models_of_full_causal_layers_and_refuses_sliding_windows(config):
    """On fake tensors transformers makes its masks whole: those of a model that declares
    every layer full causal (`supports_context_parallel`) are taken as causal; Mistral's
    sliding window is refused in one line."""
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    sizes["num_key_value_heads"] = 2
    with torch.device("meta"):
        model = causal_lm((8,), 16, config=config, sizes=sizes)
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    if config == "llama":
        assert len(check_attention(model, tokens)) == 2  # an SDPA call a layer
        return
    with pytest.raises(ConfigError, match="an explicit attn_mask mask; .* supports_context_par"):
        check_attention(model, tokens)


@pytest.mark.equivalence
def test_a_transformers_llama_in_pipeline_stages_trains_like_single_or_is_refused(tmp_path):
    """torch 2.15's tracer cuts it at its layers, as 2.14's does with transformers 5.25, and it
    trains like single; 2.14's with transformers 5.23 traced a rotary embedding stage that cannot
    run: refused in one line, before any work."""
    result = run_train(*LLAMA, *PP, run_dir=tmp_path, check=False)
    if result.returncode == 2 and TORCH < (2, 15):
        output = result.stdout + result.stderr
        assert "parallel.pp: torch's pipeline tracer cannot cut LlamaForCausalLM" in output
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(reference_run(*LLAMA), tmp_path)


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "fsdp_tp"])
def test_a_transformers_gpt2_trains_like_single(strategy):
    """tp splits it by the styles the template registers (src/parallel/tp/gpt2_styles.py): its
    Conv1D weights are [in, out], and c_attn's q, k and v columns are regrouped into whole heads
    per rank; its checkpoints hold single's columns."""
    runs = strategy_runs(*GPT2, strategies=("ddp", "fsdp", "tp", "fsdp_tp"))
    assert_same_training(runs["single"], runs[strategy])


GPT2_STAGES = ("pp", "model_parallel")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", GPT2_STAGES)
def test_a_transformers_gpt2_with_its_tied_head_trains_like_single_in_pipeline_stages(strategy):
    """Cut at transformer.h by torch's tracer, its head (tied to the token embedding) on the
    last stage: pp's two processes each hold a copy, their gradients summed; model_parallel's
    stages share the one tensor."""
    runs = strategy_runs(*GPT2, "trainer.checkpoint_format=full", strategies=GPT2_STAGES)
    assert_same_training(runs["single"], runs[strategy])
    figures = summary(runs[strategy])
    assert figures.get("pipeline", figures)["stages"] == 2  # pp's report nests its stages


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_transformers_image_classifier_trains_like_single(strategy):
    """An encoder (transformers' ViT) with task=classification."""
    vit = (*IMAGES, "model=hf_image_classifier", "model.sizes.hidden_size=32")
    runs = strategy_runs(*vit, strategies=("ddp", "fsdp"))
    assert_same_training(runs["single"], runs[strategy])


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pp"])
def test_a_timm_vit_trains_like_single(strategy):
    """Under pp, cut at its blocks by torch's tracer; the graph traced on the meta device runs
    on the CPU (`pp/cut.py`'s `retarget`)."""
    vit = ("model.name=test_vit", "+model.sizes.img_size=16")
    runs = strategy_runs(*TIMM, *vit, strategies=("ddp", "fsdp", "pp"))
    assert_same_training(runs["single"], runs[strategy])


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_timm_resnet_trains_like_single_with_its_batch_statistics_synced(tmp_path, strategy):
    resnet = (*TIMM, "model.name=test_resnet")
    synced = (f"parallel={strategy}", "parallel.devices=2", "parallel.sync_batchnorm=true")
    run_train(*resnet, *synced, run_dir=tmp_path)
    assert_same_training(reference_run(*resnet), tmp_path)


def test_a_llama_saved_by_transformers_trains_under_fsdp_and_exports_back_to_transformers(
    tmp_path,
):
    """model.pretrained: a `save_pretrained` folder's config and weights, not random ones; the
    checkpoint exported to a folder is one that transformers' `from_pretrained` loads, to the
    trained model's logits."""
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path / "llama")
    run_dir = tmp_path / "run"
    overrides = (*LLAMA, "trainer.max_steps=1", "parallel=fsdp", "parallel.devices=2")
    run_train(*overrides, f"model.pretrained={tmp_path / 'llama'}", run_dir=run_dir)
    assert summary(run_dir)["strategy"] == "fsdp"
    # One SGD step from the saved weights: close to them, far from a random start.
    weights = checkpoint(run_dir)["model"]
    start = saved.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert (weights["model.layers.0.mlp.up_proj.weight"] - start).abs().max() < 0.01

    exported = tmp_path / "exported"
    export_command = [sys.executable, "-m", "src.checkpoint.store", "export", run_dir, exported]
    subprocess.run(export_command, cwd=ROOT, check=True, capture_output=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    saved.load_state_dict(weights)
    tokens = torch.randint(0, 16, (2, 8))
    torch.testing.assert_close(loaded(tokens).logits, saved(tokens).logits, rtol=0, atol=1e-5)


def test_blocks_are_found_as_the_most_numerous_members_of_module_lists():
    with torch.device("meta"):
        loop = LoopMLP((4,), 3, 8, 3)
        resnet = timm.create_model("resnet18", num_classes=10)
        llama = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(hidden_size=32, num_hidden_layers=3, vocab_size=16)
        )
    assert model_blocks(loop) == ["layers.0", "layers.1", "layers.2"]
    # Two BasicBlocks in each of its four stages' Sequentials.
    assert model_blocks(resnet) == [f"layer{stage}.{i}" for stage in range(1, 5) for i in (0, 1)]
    assert model_blocks(llama) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert model_blocks(llama, "model.layers") == model_blocks(llama)
    assert model_blocks(llama, ["LlamaDecoderLayer"]) == model_blocks(llama)
    with pytest.raises(ConfigError, match="model.blocks=model.nosuch: the model has no module"):
        model_blocks(llama, "model.nosuch")
    with pytest.raises(ConfigError, match="no module of the model is one of these classes"):
        model_blocks(llama, ["NoSuchLayer"])


def test_another_target_does_not_get_the_options_own_keys(compose_config):
    cfg = compose_config(*LOOP_MLP)
    settle_model_settings(cfg)
    assert OmegaConf.to_container(cfg.model) == {
        "_target_": "tests.odd_models.LoopMLP",
        "width": 32,
        "layers": 3,
    }
    assert model_target(cfg.model).__qualname__ == "LoopMLP"
