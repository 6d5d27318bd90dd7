"""The Trainer owns the run: its parts are built once, a checkpoint holds model, optimizer and
exactly the train state it gives, and a new Trainer takes that state back. The strategies it
holds have what the trainer, checkpointing and the planner call."""

from __future__ import annotations

import ast
import inspect

import pytest
from helpers import STRATEGIES, parallel_config
from hydra.utils import instantiate

from src.checkpoint.store import CheckpointedStrategy, load_checkpoint, saved_checkpoints
from src.parallel import build_strategy
from src.parallel.base import PlannedStrategy, Strategy, TrainingStrategy
from src.training.build import check_config
from src.training.trainer import Trainer

TINY = (
    "model.hidden=8",
    "model.depth=1",
    "data.input_dim=8",
    "data.num_samples=200",
    "trainer.batch_size=8",
    "trainer.max_steps=4",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=2",
    "logger=none",
)


def counted(init, built: list):
    def count(task, *args, **kwargs):
        built.append(task)
        init(task, *args, **kwargs)

    return count


def test_the_task_is_built_once_and_the_checkpoint_holds_the_train_state(
    compose_config, tmp_path, monkeypatch
):
    cfg = compose_config(*TINY)
    strategy = check_config(cfg, tmp_path)
    task_class, built = type(instantiate(cfg.task)), []
    monkeypatch.setattr(task_class, "__init__", counted(task_class.__init__, built))
    with Trainer(cfg, tmp_path, strategy) as trainer:
        summary = trainer.train()
        state = trainer.state_dict()
    assert len(built) == 1
    assert summary["steps"] == 4 and state["step"] == 4
    saved = load_checkpoint(saved_checkpoints(tmp_path)[-1])
    assert set(saved) == {"model", "optimizer", *state}
    assert saved["step"] == 4 and saved["config"] == state["config"]


def test_a_new_trainer_goes_on_from_the_saved_train_state(compose_config, tmp_path):
    cfg = compose_config(*TINY)
    with Trainer(cfg, tmp_path, check_config(cfg, tmp_path)) as trainer:
        trainer.train()
    resumed = compose_config(*TINY, "trainer.max_steps=6", "trainer.resume=auto")
    with Trainer(resumed, tmp_path, check_config(resumed, tmp_path)) as trainer:
        assert trainer.step == 4
        trainer.train()
        assert trainer.state_dict()["step"] == 6
    assert load_checkpoint(saved_checkpoints(tmp_path)[-1])["step"] == 6


def test_train_takes_no_parameter_but_the_trainer_and_calls_backward_through_one_function():
    """From train.py's main: sweep's job, job.run, Trainer.train, forward_backward, backward."""
    assert list(inspect.signature(Trainer.train).parameters) == ["self"]
    called = {
        node.func.id if isinstance(node.func, ast.Name) else node.func.attr
        for node in ast.walk(ast.parse(inspect.getsource(Trainer.train).strip()))
        if isinstance(node, ast.Call)
    }
    assert "forward_backward" in called


@pytest.mark.parametrize("option", STRATEGIES)
def test_every_strategy_is_what_the_trainer_checkpointing_and_planner_call(option):
    """Each `parallel=` option, built with every input its constructor takes, has the members
    of the three Protocols its callers hold it by."""
    devices = {"single": 1, "hybrid": 4}.get(option, 2)
    settings = {"devices": devices, **({"stages": 2} if option == "hybrid" else {})}
    strategy = build_strategy(parallel_config(option, **settings), "cpu", "bf16", None)
    assert strategy.precision == "bf16" and strategy.ranks is None
    for protocol in (TrainingStrategy, CheckpointedStrategy, PlannedStrategy):
        assert isinstance(strategy, protocol), protocol.__name__
    # Each shipped one can be planned: it has a cost model (priced once `check_model` has run).
    assert type(strategy).cost_model is not Strategy.cost_model
