"""A data set streamed through Hugging Face `datasets` (`data=hf_dataset`): its windows hold the
tokens data=text reads from the same records, the ranks' batches together are single's, and a run
resumed from a checkpoint's stream position reads on exactly as the uninterrupted run did, under
single and ddp (each resuming the other's checkpoint). The records are a jsonl file the test
writes: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    SGD,
    TINY,
    assert_goes_on_exactly,
    assert_same_training,
    resumed_sweep_runs,
    shared_run,
    sweep_runs,
)

from src.components.streaming import hf_dataset
from src.components.text import TextSource, text_files
from src.components.tokenizing import document_tokens

pytest.importorskip("datasets")

# Short documents (and a blank one, which data=text skips too), so that windows run across
# documents, and each stream starts a second pass over its records within a run's 6 steps.
DOCUMENTS = [f"doc {i}: the {'cat ' * (i % 3)}sat." for i in range(13)]
DOCUMENTS[7] = "  "
HELD_OUT = 4  # the first 3 validate, the next 1 tests


def records() -> Path:
    """A jsonl file of DOCUMENTS, written once per test session (its path is in the shared
    runs' overrides)."""

    def write(folder: Path) -> None:
        folder.mkdir()
        lines = (json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(DOCUMENTS))
        (folder / "records.jsonl").write_text("".join(lines))

    return shared_run("hf-records", (), write) / "records.jsonl"


def stream(streams: int):
    """data=hf_dataset on `records()` with the char tokenizer, 8 tokens a sample."""
    return hf_dataset(0, str(records()), None, "train", "text", "char", 8, None, 3, 1, streams)


def test_a_stream_holds_the_tokens_data_text_reads_and_resumes_where_it_was():
    """One stream's windows are data=text's documents (its reader, its tokens) after the held-out
    ones, over and over, each window 8 tokens after the one before; 2 ranks' batches interleave
    into single's; and a reader started from another's position, under any rank count, reads
    on as it did, across the stream's passes."""
    data = stream(streams=1)
    documents = list(TextSource(text_files(str(records())), "text", "document"))
    tokens = np.concatenate(
        [document_tokens(data.tokenizer, text) for text in documents[HELD_OUT:]]
    )
    passes = np.tile(tokens, 4)
    inputs, targets = next(data.train.batches(24, 0, 1, 0, None))
    expected = torch.from_numpy(np.stack([passes[8 * i : 8 * i + 9] for i in range(24)]))
    assert len(tokens) < 24 * 8  # a second pass
    assert torch.equal(inputs, expected[:, :-1].long())
    assert torch.equal(targets, expected[:, 1:].long())

    two = stream(streams=2).train
    single = two.batches(4, 0, 1, 0, None)
    batches = [next(single)[0] for _ in range(12)]
    ranks = [two.batches(4, rank, 2, 0, None) for rank in (0, 1)]
    for batch in batches[:3]:
        halves = [next(reader)[0] for reader in ranks]
        assert torch.equal(torch.stack(halves, 1).flatten(0, 1), batch)
    position = {k: v for reader in ranks for k, v in reader.state_dict().items()}
    assert all(
        epoch == 0 and (document, offset) != (0, 0) for epoch, document, offset in position.values()
    )
    for world_size in (1, 2):
        resumed = [two.batches(4, rank, world_size, 3, position) for rank in range(world_size)]
        for batch in batches[3:]:
            halves = [next(reader)[0] for reader in resumed]
            assert torch.equal(torch.stack(halves, 1).flatten(0, 1), batch)
        assert max(epoch for epoch, _, _ in resumed[0].state_dict().values()) >= 1


RUN = (
    *(override for override in TINY if not override.startswith(("data.", "model."))),
    *SGD,
    *("model=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32"),
    *("data=hf_dataset", "data.tokenizer=char", "data.seq_len=8", "data.streams=2"),
    *("data.val_documents=3", "data.test_documents=1", "trainer.batch_size=4"),
    "trainer.checkpoint_every=3",
)


def runs() -> dict[str, Path]:
    """ddp's run and single's, in one sweep. ddp's job goes first: its ranks' server is then
    forked from the sweep's process before any job has read through `datasets` (whose threads
    would leave a new interpreter to start it)."""
    jobs = sweep_runs(*RUN, f"data.path={records()}", "parallel=ddp,single")
    return {key.removeprefix("parallel="): run_dir for key, run_dir in jobs.items()}


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_resumed_stream_reads_on_exactly_under_single_and_ddp(strategy):
    """ddp x2 trains single's weights on the stream; resumed at step 3 from the other's
    checkpoint (ddp's position gathered from its ranks, single's shared out to them), each logs
    single's losses of steps 4 to 6 and ends at its weights."""
    fresh = runs()
    assert_same_training(fresh["single"], fresh["ddp"])
    saved = {
        "parallel=single": fresh["ddp"] / "checkpoints" / "step-000003",
        "parallel=ddp": fresh["single"] / "checkpoints" / "step-000003",
    }
    resumed = resumed_sweep_runs(
        *RUN, f"data.path={records()}", "parallel=ddp,single", resume=saved
    )
    assert_goes_on_exactly(fresh["single"], resumed[f"parallel={strategy}"], [4, 5, 6])
