"""sample.py: greedy decoding gives the tokens transformers' `generate` gives on the same weights
exported to the HF format, decoded by the run's tokenizer, the prompt read from a file; the key/
value cache changes no token, past the model's positions too; bad input is refused in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY, TINY_GPT_SGD, on_cpu, reference_run
from hydra import compose, initialize_config_dir

from src.checkpoint.export import export
from src.components.generation import Sampling, generate
from src.components.hf import causal_lm
from src.components.models import GPT, Transformer
from src.components.tasks import LanguageModel
from src.components.tokenizer import CharTokenizer, load_tokenizer
from src.config.base import ConfigError
from src.config.schema import register_configs
from src.launch.eval_job import with_saved_run
from src.launch.sample_job import run_sample

transformers = pytest.importorskip("transformers")

SEQ_LEN, VOCAB = 8, 16  # TINY_GPT_SGD's
CHARS = "abcdefghijklmno"  # a char tokenizer of 16 tokens with its end-of-text one


def transformers_greedy(folder: Path, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy `generate`, with its own key/value cache."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def random_model(kind: str) -> torch.nn.Module:
    """A model of TINY_GPT_SGD's shapes with weights large enough that the tokens vary."""
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT((SEQ_LEN,), VOCAB, n_layer=2, n_head=2, n_embd=32)
    elif kind == "transformer":
        model = Transformer((SEQ_LEN,), VOCAB, hidden=32, depth=2, heads=2)
    else:  # transformers' Llama, with its own cache
        sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
        model = causal_lm((SEQ_LEN,), VOCAB, "llama", {**sizes, "intermediate_size": 64})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    return model.eval()


def test_greedy_sample_py_gives_transformers_generate_s_tokens(tmp_path):
    """Through the real sample.py: a run's checkpoint, its char tokenizer, a prompt file."""
    run = tmp_path / "run"
    shutil.copytree(reference_run(*TINY_GPT_SGD), run)
    CharTokenizer(CHARS).save(run / "tokenizer")
    export(run, tmp_path / "hf", "hf")
    (tmp_path / "prompt.txt").write_text("cab")
    command = [
        *(sys.executable, "sample.py", f"ckpt_path={run}", f"prompt=FILE:{tmp_path}/prompt.txt"),
        *("temperature=0", "max_new_tokens=5", "num_samples=2"),
        *on_cpu([f"hydra.run.dir={tmp_path}/sample"]),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    prompts = torch.tensor([[2, 0, 1]] * 2)  # "cab"
    expected = load_tokenizer(tmp_path / "hf").decode(
        transformers_greedy(tmp_path / "hf", prompts, 5)[0].tolist()
    )
    assert result.stdout.startswith(f"{expected}\n{'-' * 40}\n{expected}\n")
    assert "2 sample(s) x 5 tokens in" in result.stdout + result.stderr
    assert "tokens/s (key/value cache, cpu)" in result.stdout + result.stderr


def test_greedy_decoding_matches_transformers_on_random_weights(tmp_path):
    model = random_model("gpt")
    model.save_pretrained(tmp_path)
    prompts = torch.tensor([[3, 1, 4], [1, 5, 9]])

    ours = generate(model, prompts, Sampling(5, 0, None), SEQ_LEN, LanguageModel.logits)

    assert ours.tolist() == transformers_greedy(tmp_path, prompts, 5).tolist()


@pytest.mark.parametrize("kind", ["gpt", "transformer", "hf_llama"])
@pytest.mark.parametrize(
    "sampling", [Sampling(20, 0, None), Sampling(20, 0.8, 5)], ids=["greedy", "sampled"]
)
def test_the_cache_changes_no_token_past_the_model_s_positions_too(kind, sampling):
    model = random_model(kind)
    prompts = torch.tensor([[3, 1, 4], [1, 5, 9]])
    tokens = {}
    for cached in (True, False):
        torch.manual_seed(1)
        tokens[cached] = generate(model, prompts, sampling, SEQ_LEN, LanguageModel.logits, cached)

    assert tokens[True].shape == (2, 23)  # 20 new tokens after 3, on 8 positions
    assert tokens[True].tolist() == tokens[False].tolist()


@pytest.fixture(scope="module")
def sampled_config():
    """sample.py's config as it composes it: the checkpoint's settings under the overrides."""
    register_configs()

    def compose_sample(*overrides: str):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose("sample", overrides=with_saved_run(on_cpu(overrides)))

    return compose_sample


@pytest.mark.parametrize(
    "overrides, message",
    [
        ((), "ckpt_path is required"),
        (("ckpt_path={missing}",), "ckpt_path: no checkpoint folder at"),
        (("ckpt_path={mlp}",), "sample.py needs a language model (task=language_model)"),
        (("ckpt_path={gpt}", "prompt=hello"), "prompt: the run has no tokenizer"),
        (("ckpt_path={gpt}", "prompt='3 16'"), "token ids must be 0 to 15 (the model's vocab"),
        (("ckpt_path={gpt}", "prompt=FILE:{missing}"), "prompt=FILE:"),
        (("ckpt_path={gpt}", "temperature=-1"), "temperature must be 0 (greedy) or more"),
        (("ckpt_path={gpt}", "parallel=ddp"), "sample.py generates on one device"),
    ],
    ids=[
        "no-ckpt-path",
        "no-checkpoint",
        "cannot-generate",
        "not-ids",
        "beyond-vocab",
        "no-prompt-file",
        "temperature",
        "several-devices",
    ],
)
def test_bad_input_is_refused_in_one_line_before_the_weights_are_read(
    tmp_path, sampled_config, overrides, message
):
    paths = {"missing": tmp_path / "missing", "mlp": reference_run(*TINY)}
    paths["gpt"] = reference_run(*TINY_GPT_SGD)
    with pytest.raises(ConfigError) as refused:
        run_sample(sampled_config(*(override.format(**paths) for override in overrides)))
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)
