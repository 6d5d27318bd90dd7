"""Models named after known ones start as their references do: GPT-2's initialisation puts an
untrained language model's loss at ln(vocabulary), and AdamW leaves biases and norms undecayed."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import checkpoint, metrics, run_train
from omegaconf import OmegaConf

from src.components.models import GPT, Transformer
from src.components.tasks import loss_sum

VOCAB = 4096


@pytest.mark.parametrize(
    "model", [("model=gpt",), ("model=transformer", "model.hidden=64", "model.heads=4")]
)
def test_an_untrained_language_model_starts_at_ln_vocabulary(tmp_path, model):
    run_train(
        *model,
        "data=synthetic_tokens",
        "task=language_model",
        f"data.vocab_size={VOCAB}",
        "data.seq_len=16",
        "data.num_samples=64",
        "trainer.batch_size=8",
        "trainer.max_steps=1",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "logger=none",
        run_dir=tmp_path,
    )
    first_loss = metrics(tmp_path)[0]["train/loss"]
    assert abs(first_loss - math.log(VOCAB)) < 0.3


def test_a_gpt2_124m_wide_model_starts_at_ln_vocabulary():
    """Two blocks of gpt2_124m's width and heads, at GPT-2's vocabulary."""
    shape = OmegaConf.load("conf/model/gpt2_124m.yaml").model
    vocab, length = 50257, 32
    torch.manual_seed(0)
    model = GPT((length,), vocab, n_layer=2, n_head=shape.n_head, n_embd=shape.n_embd)
    tokens = torch.randint(vocab, (2, length + 1))
    with torch.no_grad():
        loss = loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
    assert abs(loss.item() - math.log(vocab)) < 0.3


def test_gpt2_initialisation_scales_the_residual_projections_by_depth():
    torch.manual_seed(0)
    layers, width = 6, 256
    model = GPT((8,), 512, n_layer=layers, n_head=4, n_embd=width)
    embedding, head = model[0].token, model[-1][1]
    assert head.weight is embedding.weight
    assert embedding.weight.std().item() == pytest.approx(0.02, rel=0.02)
    block = model[1]
    residual_std = 0.02 / math.sqrt(2 * layers)
    for projection in block.residual_projections():
        assert projection.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.attention.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    biases = [module.bias for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert all(not bias.any() for bias in biases if bias is not None)

    torch.manual_seed(0)
    transformer = Transformer((8,), 512, hidden=width, depth=layers, heads=4)
    assert transformer[-1][1].weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("decay_1d", [False, True])
def test_adamw_decays_matrices_only_unless_told(tmp_path, decay_1d):
    run_train(
        "model=gpt",
        "data=synthetic_tokens",
        "task=language_model",
        "data.num_samples=64",
        "trainer.batch_size=8",
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "logger=none",
        *(["optimizer.decay_1d=true"] if decay_1d else []),
        run_dir=tmp_path,
    )
    groups = checkpoint(tmp_path)["optimizer"]["param_groups"]
    dims = [param.dim() for param in GPT((32,), 64, n_layer=2, n_head=2, n_embd=64).parameters()]
    if decay_1d:
        assert [group["weight_decay"] for group in groups] == [0.01]
        return
    decayed, undecayed = groups
    assert (decayed["weight_decay"], undecayed["weight_decay"]) == (0.01, 0.0)
    assert len(decayed["params"]) == sum(dim >= 2 for dim in dims)  # the tied head once
    assert len(undecayed["params"]) == sum(dim < 2 for dim in dims)


def test_a_checkpoint_of_other_optimizer_groups_is_refused_in_one_line(tmp_path):
    """adamw's checkpoints from before decay_1d have one group: resuming them under two groups
    would put each Adam state on another parameter."""
    tiny = ("data.num_samples=64", "trainer.batch_size=8", "trainer.eval_every=0", "logger=none")
    run_train(*tiny, "trainer.max_steps=1", "optimizer.decay_1d=true", run_dir=tmp_path)
    result = run_train(
        *tiny, "trainer.max_steps=2", "trainer.resume=auto", run_dir=tmp_path, check=False
    )
    assert result.returncode == 2
    assert "optimizer has parameter groups of [10] parameters, this run's [5, 5]" in result.stdout
