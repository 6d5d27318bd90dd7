"""Counting tensor memory in a run's first steps (`trainer.count_tensor_memory`, on by default)
measures the run and never changes or breaks it: tensors without a storage of their own (sparse
gradients) are counted by their parts, or left out with one warning."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TINY_SGD, assert_same_losses, strategy_runs, summary
from torch import nn

from src.observe.tensor_memory import StorageTracker

# A sparse embedding's gradients (`tests.odd_models.SparseEmbeddingMLP`) under SGD, the tensor
# memory counted as by default.
SPARSE_EMBEDDING = (
    *(override for override in TINY_SGD if not override.startswith("trainer.count_tensor_memory")),
    "model._target_=tests.odd_models.SparseEmbeddingMLP",
    "data=synthetic_tokens",
    "task=language_model",
    "data.seq_len=8",
    "data.vocab_size=16",
)


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp"])
def test_a_model_with_sparse_gradients_trains_with_its_tensor_memory_counted(strategy):
    runs = strategy_runs(*SPARSE_EMBEDDING, strategies=("dp", "ddp"))

    figures = summary(runs[strategy])
    assert figures["steps"] == 6
    assert all(0 < peak < 1 for peak in figures["tensor_peak_mb"])  # MB: counted, not NaN
    assert_same_losses(runs["single"], runs[strategy])


def current_bytes(tracker: StorageTracker) -> int:
    (snapshot,) = tracker.get_tracker_snapshot("current").values()
    return snapshot["Total"]


def test_a_sparse_gradient_counts_as_its_indices_and_values():
    embedding = nn.Embedding(100, 8, sparse=True)
    tracker = StorageTracker()
    tracker.track_external(embedding)
    with tracker:
        embedding(torch.tensor([1, 2, 2, 5])).sum().backward()
    assert embedding.weight.grad.layout == torch.sparse_coo  # a row per id: 4, uncoalesced
    weight_bytes, index_bytes, value_bytes = 100 * 8 * 4, 4 * 8, 4 * 8 * 4
    assert current_bytes(tracker) == weight_bytes + index_bytes + value_bytes


def test_a_tensor_without_storage_or_sparse_parts_is_left_out_and_said_once(caplog):
    tracker = StorageTracker()
    with caplog.at_level(logging.WARNING), tracker:
        matrices = [torch.eye(3).to_sparse_csr() for _ in range(2)]
    assert len(matrices) == 2 and tracker.get_tracker_snapshot("current") == {}
    warnings = [record.message for record in caplog.records if "sparse_csr" in record.message]
    assert len(warnings) == 1, caplog.text
