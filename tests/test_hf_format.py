"""GPT-2's weights in, the Hugging Face format out: a transformers GPT-2 (random, 2 layers,
written by `save_pretrained`: no network) starts `model=gpt` through train.py's
`trainer.init_from`; a run exported as a folder loads in transformers' `AutoModelForCausalLM` to
the same logits and generates in its text-generation pipeline with the run's tokenizer (a
tiktoken one converted: the same ids); a model with no exact counterpart is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY_GPT_SGD, TINY_SGD, reference_run, run_train, write_trained_tiktoken
from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.checkpoint.export import save_pretrained
from src.components.models import GPT
from src.components.tokenizer import TiktokenTokenizer, TransformersTokenizer, save_for_transformers
from src.config.base import ConfigError
from src.config.model import MoEConfig, TransformerConfig
from src.training.init_from import check_init_weights, load_init_weights

transformers = pytest.importorskip("transformers")

WORDS = ["<|endoftext|>", *"abcdefghijklmno"]  # the tokenizer's vocabulary: 16 tokens
SIZES = {"n_layer": 2, "n_head": 2, "n_embd": 32}
SEQ_LEN = 8  # fewer than the GPT-2's 16 positions: init_from keeps the first 8
IDS = torch.randint(0, len(WORDS), (3, SEQ_LEN), generator=torch.Generator().manual_seed(0))
# TINY_GPT_SGD's GPT is the GPT-2's shape with GPT-2's GELU; a learning rate of 0 keeps the
# weights it starts from, to compare with the GPT-2's after export.
FROM_GPT2 = (*TINY_GPT_SGD, "model.gelu=tanh", "optimizer.lr=0", "trainer.max_steps=2")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """A random 2-layer transformers GPT-2 (every parameter drawn, biases and norms too: a
    name mapped wrongly shows) in a folder written by its `save_pretrained`."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, **SIZES)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    return folder


def transformers_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(IDS).logits


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of WORDS, built offline, as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {word: i for i, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token=WORDS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=WORDS[0])
    TransformersTokenizer(fast, "words").save(folder)  # as a run saves it


def export(source: Path, target: Path) -> subprocess.CompletedProcess:
    """`python -m src.checkpoint.store export <source> <target>`, as a user runs it."""
    command = [sys.executable, "-m", "src.checkpoint.store", "export", str(source), str(target)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("weights", ["folder", "model.safetensors"])
def test_gpt_computes_gpt2_s_logits_from_its_weights(gpt2, weights):
    path = gpt2 if weights == "folder" else gpt2 / weights
    with torch.device("meta"):
        check_init_weights(GPT((SEQ_LEN,), len(WORDS), gelu="tanh", **SIZES), path, strict=True)
    model = GPT((SEQ_LEN,), len(WORDS), gelu="tanh", **SIZES).eval()

    load_init_weights(model, path, strict=True, announce=False)

    assert model[-1][1].weight is model[0].token.weight  # the head still tied
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), transformers_logits(gpt2), atol=1e-4, rtol=0)


def test_a_run_from_gpt2_s_weights_exports_back_to_transformers_with_its_tokenizer(tmp_path, gpt2):
    run_dir, exported = tmp_path / "run", tmp_path / "exported"
    result = run_train(*FROM_GPT2, f"trainer.init_from={gpt2}", run_dir=run_dir)
    assert f"trainer.init_from: starting from the weights of {gpt2}" in result.stdout
    write_tokenizer(run_dir / "tokenizer")  # where the run keeps its tokenizer

    assert export(run_dir, exported).returncode == 0

    assert (exported / "tokenizer.json").is_file()
    torch.testing.assert_close(
        transformers_logits(exported), transformers_logits(gpt2), atol=1e-4, rtol=0
    )
    generate = transformers.pipeline("text-generation", model=str(exported))
    text = generate("a b c", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("a b c") and len(text) > len("a b c")  # 4 more words, unspaced


# Text the tiktoken tokenizer is trained on and then tokenizes: words, contractions, numbers,
# runs of spaces and newlines, letters and spaces beyond ASCII, and the end-of-text token.
TEXTS = [
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer 1234567 slings and arrows",
    "  two spaces,\ttabs\t\tand lines \n\n  ending in spaces  ",
    "Ünïcödé façade: naïve\u00a0café,\u3000東京, emoji 😀!",  # Unicode's spaces too
    "one document<|endoftext|>the next",
]


def test_a_tiktoken_tokenizer_is_exported_as_transformers_reads_it_with_its_ids(
    tmp_path, monkeypatch
):
    """A run's tiktoken encoding (GPT-2's kind) as the export writes it: AutoTokenizer gives
    tiktoken's ids (the end-of-text token's too, as GPT-2's own transformers tokenizer does) and
    decodes them to the same text; without transformers, one line names it."""
    pytest.importorskip("tiktoken")
    bpe = write_trained_tiktoken(tmp_path / "bpe.tiktoken", " ".join(TEXTS * 8))
    tokenizer = TiktokenTokenizer.of_file(bpe, str(bpe))
    tokenizer.save(tmp_path / "run")
    save_for_transformers(tmp_path / "run", tmp_path / "exported")

    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")

    assert exported.eos_token_id == tokenizer.eot and len(exported) == tokenizer.vocab_size
    for text in TEXTS:
        ids = tokenizer.encoding.encode(text, allowed_special="all")
        assert exported(text)["input_ids"] == ids, text
        assert exported.decode(ids) == tokenizer.decode(ids) == text
    plain = TEXTS[2]  # no special token: the run's own encode
    assert exported(plain)["input_ids"] == tokenizer.encode(plain).tolist()
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ValueError) as refused:
        save_for_transformers(tmp_path / "run", tmp_path / "without")
    assert str(refused.value) == (
        f"the export of the tiktoken tokenizer in {tmp_path / 'run'} needs transformers: "
        "pip install transformers"
    )


@pytest.mark.parametrize(
    "options",
    [{"bias": False}, {"gelu": "tanh", "tie_weights": False, "vocab_multiple": 8}],
    ids=["no-biases-erf", "tanh-untied-padded"],
)
def test_a_gpt_saved_as_gpt2_computes_its_logits_in_transformers(tmp_path, options):
    torch.manual_seed(0)
    model = GPT((SEQ_LEN,), len(WORDS), **SIZES, **options).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)

    model.save_pretrained(tmp_path)

    with torch.no_grad():
        torch.testing.assert_close(model(IDS), transformers_logits(tmp_path), atol=1e-4, rtol=0)


def test_a_model_without_a_gpt2_counterpart_is_refused_in_one_line(tmp_path):
    result = export(reference_run(*TINY_SGD), tmp_path / "exported")

    assert result.returncode == 2
    assert result.stderr == (
        "error: MLP has no Hugging Face format (transformers' models and model=gpt or gpt2_124m "
        "have one): export it to a .safetensors or .pt file\n"
    )
    for schema in (TransformerConfig, MoEConfig):  # a head with a bias; mixtures of experts
        config = {"model": OmegaConf.to_container(OmegaConf.structured(schema))}
        with pytest.raises(ConfigError, match="has no Hugging Face format"):
            save_pretrained({}, {**config, "input_shape": [SEQ_LEN], "num_classes": 16}, tmp_path)


def test_the_finetune_experiment_takes_gpt2_s_weights(tmp_path, compose_config):
    """`experiment=finetune_gpt2` (its sizes cut to a random 2-layer GPT-2's) builds the GPT that
    GPT-2's weights fit: GPT-2's vocabulary, positions and GELU."""
    cfg = compose_config(
        "experiment=finetune_gpt2",
        f"data.path={tmp_path}",
        *(f"model.{name}={size}" for name, size in SIZES.items()),
    )
    config = transformers.GPT2Config(vocab_size=cfg.data.vocab_size, n_positions=1024, **SIZES)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    with torch.device("meta"):
        model = instantiate(
            cfg.model, input_shape=(cfg.data.seq_len,), num_classes=config.vocab_size
        )

    check_init_weights(model, tmp_path / "gpt2", strict=True)

    assert cfg.trainer.init_from == "hf:gpt2" and cfg.optimizer.lr == 3e-5
