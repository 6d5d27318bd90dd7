"""The loop's own device work per step, counted (not timed).

On a fast GPU step every op the loop adds around the model is a kernel launch that the host pays
for: on an H200 the template's `single` lost 0.4 ms a step (0.77x a plain loop) when it added 24
ops a step to a plain loop's. Counting ops holds on any machine, unlike a timing."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode

from src.components.data import build_data
from src.training.build import check_config
from src.training.trainer import train

# Tiny, so that the test is quick; the count does not depend on the sizes.
WORKLOAD = (
    "model.hidden=8",
    "model.depth=1",
    "data.input_dim=8",
    "data.num_samples=400",
    "trainer.batch_size=8",
    "trainer.accelerator=cpu",
    "trainer.eval_every=0",
    "trainer.log_every=1000",
    "logger=none",
)
# The accuracy (argmax, eq, sum), the [loss, correct] stack with its backward (a select per
# sum), and the sums detached for the figures, less the plain loop's ones_like (the loop's
# backward starts from the mean loss's gradient, a tensor made once): what the loop needs;
# anything beyond is a regression. It was 11 when the loop ran `(sums[0] / count).backward()`.
MOST_EXTRA_OPS_PER_STEP = 6


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def template_ops(compose_config, steps: int, run_dir: Path) -> collections.Counter:
    cfg = compose_config(*WORKLOAD, f"trainer.max_steps={steps}")
    run_dir.mkdir()
    strategy = check_config(cfg, run_dir)
    with OpCounter() as counter:
        train(cfg, run_dir, strategy)
    return counter.count


def plain_ops(compose_config, steps: int) -> collections.Counter:
    cfg = compose_config(*WORKLOAD)
    data = build_data(cfg.data, cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    optimizer = torch.optim.AdamW(model.parameters())
    batch_size = cfg.trainer.batch_size
    order = torch.randperm(len(data.train))
    with OpCounter() as counter:
        for step in range(steps):
            batch = order[step * batch_size : (step + 1) * batch_size]
            loss = F.cross_entropy(model(data.train.inputs[batch]), data.train.targets[batch])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return counter.count


def per_step(counts: collections.Counter, more_counts: collections.Counter, steps: int) -> float:
    """Ops per step from two runs `steps` apart: what every run does once cancels out."""
    return (more_counts.total() - counts.total()) / steps


def test_the_loop_adds_few_ops_per_step_to_a_plain_loop(compose_config, tmp_path):
    template = per_step(
        template_ops(compose_config, 10, tmp_path / "a"),
        template_ops(compose_config, 20, tmp_path / "b"),
        10,
    )
    plain = per_step(plain_ops(compose_config, 10), plain_ops(compose_config, 20), 10)
    assert 0 <= template - plain <= MOST_EXTRA_OPS_PER_STEP, (template, plain)
