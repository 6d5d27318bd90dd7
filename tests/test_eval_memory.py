"""Evaluation needs no more memory than training: measured peaks of real training steps and of
an evaluation batch after them (`src/launch/memory_check.py`), on a GPT with a large vocabulary,
whose evaluation forward makes (batch, sequence, vocabulary) logits."""

from __future__ import annotations

import numpy as np
import pytest

from src.launch.memory_check import measured_peaks_mb

VOCAB, SEQ_LEN = 2048, 64


@pytest.fixture
def token_file(tmp_path):
    """40,000 random tokens: 562 training windows of 64 and 62 validation ones (the last tenth)."""
    path = tmp_path / "train.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, VOCAB, size=40_000, dtype=np.uint16).tofile(path)
    return path


def test_evaluation_peaks_no_higher_than_training(compose_config, token_file):
    """Training batches of 8; the old default evaluation batch (512) took all 62 validation
    windows in one forward: 62 x 64 x 2048 logits, above training's whole peak. The default now
    evaluates in training's micro-batch."""
    gpt = (
        *("model=gpt", "task=language_model", "data=tokens", f"data.path={token_file}"),
        *(f"data.seq_len={SEQ_LEN}", f"data.vocab_size={VOCAB}", "trainer.batch_size=8"),
        "logger=none",
    )
    old_default = measured_peaks_mb(compose_config(*gpt, "trainer.eval_batch_size=512"))
    assert old_default["evaluation"]["Total"] > 1.5 * old_default["training"]["Total"]

    peaks = measured_peaks_mb(compose_config(*gpt))
    assert peaks["evaluation"]["Total"] <= peaks["training"]["Total"]
