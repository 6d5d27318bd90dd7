"""`hparams_search=optimizer_optuna`: Optuna trials as jobs of a multirun, a study that resumes."""

from __future__ import annotations

import math

import optuna
from helpers import TINY, run_sweep, summary
from omegaconf import OmegaConf


def test_a_search_reports_its_best_trial_and_its_study_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    search = (
        "hparams_search=optimizer_optuna",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=tiny",
        "hydra.sweeper.n_trials=2",
        *TINY,  # its trainer.batch_size is fixed: the search leaves it out
    )
    first, second = tmp_path / "first", tmp_path / "second"
    result = run_sweep(*search, sweep_dir=first)
    assert result.returncode == 0, result.stderr[-4000:]
    # The same study, two more trials, at once: a batch of 2 through the concurrent launcher.
    concurrently = ("hydra/launcher=concurrent", "hydra.sweeper.n_jobs=2")
    result = run_sweep(*search, *concurrently, sweep_dir=second)
    assert result.returncode == 0, result.stderr[-4000:]

    study = optuna.load_study(study_name="tiny", storage=storage)
    assert [trial.state for trial in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    jobs = [first / "0", first / "1", second / "0", second / "1"]
    losses = [summary(job)["final_val_loss"] for job in jobs]
    assert sorted(trial.value for trial in study.trials) == sorted(losses)
    best = OmegaConf.load(second / "optimization_results.yaml")  # over the whole study
    assert math.isclose(best.best_value, min(losses))
    overrides = OmegaConf.load(jobs[losses.index(min(losses))] / ".hydra" / "overrides.yaml")
    assert {f"{key}={value}" for key, value in best.best_params.items()} <= set(overrides)
    assert set(best.best_params) == {"optimizer.lr", "optimizer.weight_decay"}

    # A search renumbers its jobs from 0: its old sweep dir is refused, before any trial.
    result = run_sweep(*search, sweep_dir=first)
    assert result.returncode == 2 and "choose a new hydra.sweep.dir" in result.stderr
    assert len(optuna.load_study(study_name="tiny", storage=storage).trials) == 4
