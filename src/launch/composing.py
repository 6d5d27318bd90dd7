"""A run's config composed once instead of twice, for the Hydra entry points (`train.py`,
`eval.py`):

    with composing_once():
        main()                   # a @hydra.main function

`@hydra.main` composes the whole config once only to read `hydra.mode` (`Hydra.get_mode`, in
MULTIRUN mode: a config such as `hparams_search=optimizer_optuna` may set it, and make a plain
command a sweep), then again to run it. In a forked test run of the tiny MLP that first
composition was a third of the process's CPU time (0.1 s of 0.37 s). Here `get_mode` composes
the config as the run will, and the run takes that one, with the `hydra.mode=RUN` that Hydra adds
when the config sets no mode (`hydra._internal.utils._run_app`). A command whose overrides sweep
(`-m parallel=single,ddp`) cannot compose as a run: it keeps Hydra's two compositions.

This relies on Hydra's private `hydra._internal.hydra.Hydra`, which `_run_hydra` looks up when
called; `tests/test_config.py` checks that the config composed once is the one Hydra composes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hydra._internal import hydra as hydra_internal
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig

# What Hydra appends to a run's overrides when its config sets no mode.
RUN_MODE_OVERRIDE = "hydra.mode=RUN"


class ComposingOnce(hydra_internal.Hydra):
    """Hydra, handing the config `get_mode` composed (or the error composing it raised) to the
    run that asks for it next."""

    composed: tuple[tuple[str, ...], DictConfig | Exception] | None = None

    def get_mode(self, config_name: str | None, overrides: list[str]) -> Any:
        try:
            if sweeps(overrides):
                return super().get_mode(config_name, overrides)
            cfg = self.compose_config(
                config_name, overrides, RunMode.RUN, with_log_configuration=True
            )
        except Exception as error:  # noqa: BLE001 - the run's own composition would raise it
            mode = super().get_mode(config_name, overrides)  # unless the config sets a mode
            self.composed = ((*overrides, RUN_MODE_OVERRIDE), error) if mode is None else None
            return mode
        self.composed = ((*overrides, RUN_MODE_OVERRIDE), cfg) if cfg.hydra.mode is None else None
        return cfg.hydra.mode

    def compose_config(
        self,
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        with_log_configuration: bool = False,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        composed, self.composed = self.composed, None
        if composed is None or run_mode != RunMode.RUN or composed[0] != tuple(overrides):
            return super().compose_config(
                config_name,
                overrides,
                run_mode,
                with_log_configuration,
                from_shell,
                validate_sweep_overrides,
            )
        cfg = composed[1]
        if isinstance(cfg, Exception):
            raise cfg
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append(RUN_MODE_OVERRIDE)
        return cfg


def sweeps(overrides: list[str]) -> bool:
    """Whether an override sweeps (`key=a,b`, `key=range(...)`): no run composes those."""
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    return any(override.is_sweep_override() for override in parsed)


@contextlib.contextmanager
def composing_once() -> Iterator[None]:
    """Within the block, `@hydra.main` functions compose a run's config once."""
    hydra_class = hydra_internal.Hydra
    hydra_internal.Hydra = ComposingOnce
    try:
        yield
    finally:
        hydra_internal.Hydra = hydra_class
