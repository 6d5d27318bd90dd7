"""The planner's predicted peak memory against the peak measured in real training steps."""

from __future__ import annotations

from benchmarks.workload import (
    compose_config,
)

PLAN_MODELS = {
    "mlp": ("model=mlp", "trainer.batch_size=64"),
    "gpt": (
        "model=gpt",
        "data=synthetic_tokens",
        "task=language_model",
        "data.seq_len=64",
        "trainer.batch_size=16",
    ),
    "resnet": (
        "model=resnet",
        "model.width=8",
        "model.cifar_stem=true",
        "data.image_shape=[3,32,32]",
        "data.num_samples=256",
        "trainer.batch_size=16",
    ),
}
PLAN_STRATEGIES = {
    "single": ("parallel=single",),
    "single, checkpointing": ("parallel=single", "trainer.activation_checkpointing=true"),
    "single, bf16": ("parallel=single", "trainer.precision=bf16"),
    "dp 2": ("parallel=dp", "parallel.devices=2"),
    "dp_criterion 2": ("parallel=dp_criterion", "parallel.devices=2"),
    "model_parallel 2, M=2": ("parallel=model_parallel", "parallel.microbatches=2"),
    "ddp 2": ("parallel=ddp", "parallel.devices=2"),
    "fsdp 2": ("parallel=fsdp", "parallel.devices=2"),
    "hybrid 2x2, M=2": ("parallel=hybrid", "parallel.devices=4", "parallel.microbatches=2"),
    "model_parallel 2": ("parallel=model_parallel",),
}
# The strategies each model is planned under (resnet: those tests/test_plan.py holds it to).
PLAN_CASES = {
    "mlp": [label for label in PLAN_STRATEGIES if label != "model_parallel 2"],
    "gpt": [label for label in PLAN_STRATEGIES if label != "model_parallel 2"],
    "resnet": ["single", "ddp 2", "fsdp 2", "model_parallel 2"],
}


def plan_accuracy() -> None:
    """Predicted against measured peak tensor memory per process (MB), every model x strategy."""
    from src.launch.memory_check import measured_peaks_mb
    from src.planning.planner import MB, plan_all

    print(f"{'model':<6}{'strategy':<24}{'predicted MB':>13}{'measured MB':>13}{'ratio':>8}")
    for model, model_overrides in PLAN_MODELS.items():
        for label in PLAN_CASES[model]:
            cfg = compose_config(*model_overrides, *PLAN_STRATEGIES[label], "logger=none")
            (plan,) = plan_all(cfg, [cfg.parallel])
            measured = measured_peaks_mb(cfg)["training"]["Total"]
            predicted = plan.peak / MB
            ratio = predicted / measured
            print(f"{model:<6}{label:<24}{predicted:>13.2f}{measured:>13.2f}{ratio:>8.3f}")
