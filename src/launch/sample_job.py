"""One `python sample.py` job: a checkpoint's language model, restored on one device as eval.py
restores it (any layout's checkpoint, or an exported weights file), continues a prompt; the
samples are printed, decoded by the run's tokenizer (`<run>/tokenizer/`), or as token ids for a
run without one (synthetic tokens), then the tokens per second.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.export import run_tokenizer
from src.components.generation import Sampling, generate
from src.components.precision import autocast
from src.components.tasks import LanguageModel
from src.components.tokenizer import Tokenizer, load_tokenizer
from src.config.base import ConfigError
from src.config.job import JobConfig, job_config
from src.parallel.base import Strategy
from src.training.build import Blueprint, build_checked_parts
from src.training.checks import check_settings
from src.training.evaluator import checkpoint_blueprint, restored_model

log = logging.getLogger(__name__)
FILE_PREFIX = "FILE:"  # prompt=FILE:<path>
SEPARATOR = "-" * 40  # between samples, as nanoGPT's sample.py prints them


def run_sample(cfg: DictConfig) -> list[str]:
    """Generate `cfg.num_samples` continuations of `cfg.prompt`, print them and the speed;
    returns them as printed. Every check comes before the model's weights are read."""
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ConfigError(
            "ckpt_path is required: a run folder, a checkpoint folder, best / last (of "
            "run_dir=<run folder>, or of the newest run in outputs/), or an exported file"
        )
    sampling = checked_sampling(cfg)
    cfg.trainer.compile = False  # the cache's shapes change every token
    cfg.trainer.activation_checkpointing = "none"
    cfg.trainer.resume = None
    job = job_config(cfg)  # typed once, here
    strategy = check_settings(job, None)
    if strategy.name != "single":
        raise ConfigError(
            f"sample.py generates on one device: leave parallel={strategy.name} out (a "
            "checkpoint of any layout loads on one)"
        )
    data, task, meta_model = build_checked_parts(job, strategy)
    if not isinstance(task, LanguageModel):
        raise ConfigError(
            f"sample.py needs a language model (task=language_model), but {cfg.ckpt_path} holds "
            f"a {type(meta_model).__name__} for {type(task).__name__.lower()}: it has no next "
            "token to generate"
        )
    blueprint = checkpoint_blueprint(job, data, task, meta_model, "sample from")
    tokenizer = saved_tokenizer(blueprint.checkpoint)
    prompt = prompt_ids(cfg.prompt, tokenizer, data.num_classes)
    strategy.setup()
    try:
        samples, speed = generated(job, strategy, blueprint, prompt, sampling)
    finally:
        strategy.teardown()
    texts = [tokenizer.decode(ids) if tokenizer else " ".join(map(str, ids)) for ids in samples]
    print(f"\n{SEPARATOR}\n".join(texts), flush=True)
    log.info("%s", speed)
    return texts


def checked_sampling(cfg: DictConfig) -> Sampling:
    for key, least in (("max_new_tokens", 1), ("num_samples", 1), ("top_k", 1)):
        if cfg[key] is not None and cfg[key] < least:
            raise ConfigError(f"{key} must be at least {least}, got {cfg[key]}")
    if cfg.temperature < 0:
        raise ConfigError(f"temperature must be 0 (greedy) or more, got {cfg.temperature}")
    return Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k)


def saved_tokenizer(checkpoint: Path) -> Tokenizer | None:
    """The tokenizer of the checkpoint's run, if it saved one."""
    folder = run_tokenizer(checkpoint)
    return load_tokenizer(folder) if folder is not None else None


def prompt_ids(prompt: str, tokenizer: Tokenizer | None, vocab: int) -> list[int]:
    """The token ids of `prompt` (`FILE:<path>`: that file's text); without a tokenizer, the
    ids it lists. Empty: the end-of-text token (what a document follows), 0 without one."""
    if prompt.startswith(FILE_PREFIX):
        path = Path(prompt.removeprefix(FILE_PREFIX)).expanduser()
        if not path.is_file():
            raise ConfigError(f"prompt={prompt}: no file {path}")
        prompt = path.read_text()
    if tokenizer is not None:
        try:
            ids = [int(i) for i in tokenizer.encode(prompt)] or [tokenizer.eot]
        except ValueError as error:  # a character the char tokenizer does not know
            raise ConfigError(f"prompt: {error}") from None
    else:
        try:
            ids = [int(word) for word in prompt.split()] or [0]
        except ValueError:
            raise ConfigError(
                "prompt: the run has no tokenizer (synthetic tokens): give token ids separated "
                "by spaces, e.g. prompt='1 2 3'"
            ) from None
    if not all(0 <= i < vocab for i in ids):
        raise ConfigError(f"prompt: token ids must be 0 to {vocab - 1} (the model's vocabulary)")
    return ids


def generated(
    job: JobConfig, strategy: Strategy, blueprint: Blueprint, prompt: list[int], sampling: Sampling
) -> tuple[list[list[int]], str]:
    """The prompt and its continuations, token ids, `num_samples` of them, and the speed they
    were made at."""
    cfg = job.cfg
    model = restored_model(job, strategy, blueprint).eval()
    device = strategy.devices[0]
    prompts = torch.tensor([prompt] * cfg.num_samples, device=device)
    vocab = blueprint.data.num_classes  # a padded vocabulary's extra tokens are never drawn
    context = blueprint.data.input_shape[-1]
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    with autocast(strategy.device_type, job.trainer.precision):
        tokens = generate(
            model,
            prompts,
            sampling,
            context,
            lambda out: LanguageModel.logits(out)[..., :vocab],
            cfg.cache,
        )
    strategy.synchronize()
    seconds = time.perf_counter() - start
    made = cfg.num_samples * sampling.max_new_tokens
    way = "key/value cache" if cfg.cache and hasattr(model, "new_cache") else "no cache"
    speed = (
        f"{cfg.num_samples} sample(s) x {sampling.max_new_tokens} tokens in {seconds:.2f} s: "
        f"{made / seconds:.1f} tokens/s ({way}, {device})"
    )
    return tokens.tolist(), speed
