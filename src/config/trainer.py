"""Schema of `conf/trainer/`: the loop's steps, batches, precision, checkpoints and
monitoring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from src.config.base import ConfigError, choices

Precision = choices("Precision", "fp32 bf16 fp16", __name__)
Accelerator = choices("Accelerator", "auto cpu cuda", __name__)
CheckpointFormat = choices("CheckpointFormat", "auto full sharded", __name__)
MatmulPrecision = choices("MatmulPrecision", "auto highest high medium", __name__)
MonitorMode = choices("MonitorMode", "min max", __name__)
CheckpointErrors = choices("CheckpointErrors", "fail warn", __name__)
Recomputation = choices("Recomputation", "none full selective", __name__)
# What trainer.activation_checkpointing's true and false, its values before `selective`, mean.
RECOMPUTATION_OF_BOOL = {True: Recomputation.full, False: Recomputation.none}


@dataclass
class TrainerConfig:
    max_steps: int = 300
    """Optimizer steps to run."""
    batch_size: int = 128
    """Global batch per optimizer step, summed over devices and accumulation micro-steps."""
    accumulate: int = 1
    """Micro-steps per optimizer step; the batch must divide by it."""
    log_every: int = 25
    progress_every_s: float | None = 2.0
    """Evaluation, checkpoint writes and reads and data preparation that run longer than this
    show a progress line with an ETA, at most this often (`src/runtime/progress.py`); null:
    never (training's lines every log_every steps stay)."""
    eval_every: int = 100
    """0 evaluates only at the end."""
    eval_batch_size: int | None = None
    """Samples per evaluation batch, over all devices (split over the ranks as training's are).
    None: the training micro-batch (batch_size / accumulate), so that no evaluation forward is
    larger than a training one, which training runs while it also keeps activations for
    backward and gradients: evaluation needs no more memory than training. In samples, not
    tokens: a sample is as long in evaluation as in training. (Chunking only the loss would not
    do: a vocabulary head's forward makes the whole batch's logits first.) A larger batch
    evaluates in fewer passes at more memory; `python plan.py` predicts that peak too."""
    precision: Precision = Precision.fp32
    """fp32, bf16 (autocast) or fp16 (autocast with loss scaling)."""
    loss_scale_init: float = 65536.0
    """fp16's first loss scale (torch's GradScaler default); the scaler adapts it as it goes."""
    grad_clip: float = 0.0
    """Max global gradient norm; 0 turns clipping off."""
    checkpoint_every: int = 0
    """0 checkpoints only at the end (and when stopped)."""
    checkpoint_format: CheckpointFormat = CheckpointFormat.auto
    """full (one file, gathered on the main process), sharded (torch.distributed.checkpoint:
    every rank writes its own shards; single, ddp, fsdp and the mesh layouts) or auto: sharded
    for fsdp and for a mesh layout that splits the model (tp, pp or dp_shard above 1), else
    full. Either resumes under any strategy and number of processes."""
    keep_checkpoints: int = 2
    """The newest K `checkpoints/step-*` folders are kept (0: all); resume falls back to the one
    before the newest if that cannot be read."""
    async_checkpoint: bool = False
    """Sharded checkpoints are written in the background while training goes on (DCP async)."""
    checkpoint_errors: CheckpointErrors = CheckpointErrors.fail
    """What a checkpoint that cannot be written (a full disk, a failing file system) does: fail
    ends the run (exit code 1), warn logs one warning and trains on, the next checkpoint trying
    again. Either way its staging folder goes and the previous checkpoint is kept."""
    accelerator: Accelerator = Accelerator.auto
    """cpu, cuda, or auto: cuda when a GPU is visible, else cpu."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) (slower on CUDA; turns cudnn.benchmark off)."""
    matmul_precision: MatmulPrecision = MatmulPrecision.auto
    """float32 matmuls: highest (true fp32), high (TF32 on NVIDIA GPUs, ~8x faster) or medium;
    auto is high on CUDA and highest on CPU. Stated in the summary."""
    activation_checkpointing: Any = "none"
    """none; full: each block keeps only its input for backward and runs its forward again
    there (least memory, about one more forward pass of compute); selective: each block keeps
    the outputs of `checkpoint_ops` (its matmuls) and recomputes the rest (memory and compute
    between the two). true and false, the setting's values before selective, are full and none.
    (`Any`: a schema's enum takes no bool.)"""
    checkpoint_ops: list[str] = field(
        default_factory=lambda: [
            *("mm", "addmm", "bmm", "baddbmm"),
            *("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
            *("_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"),
        ]
    )
    """Under activation_checkpointing=selective, the aten ops (`torch.ops.aten.<name>`, every
    overload) whose outputs are kept: by default the matmuls and attention's fused kernels,
    the costly ops to run again (torchtitan's choice)."""
    compile: bool = False
    """torch.compile each block (inductor; the first steps compile, see timing_warmup_steps)."""
    profile: bool = False
    """Record a torch.profiler trace of `profile_steps` steps (after 2 steps) on the main process
    into `profile_trace.json` in the run folder, and to W&B as a file."""
    profile_steps: int = 3
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device (GPU; on CPU, one replica, process or stage) at the run's
    precision, for `mfu` in the summary; None takes it from a table of common GPUs
    (`src/observe/performance.py`), and leaves MFU out for other devices."""
    timing_warmup_steps: int = 5
    """Steps left out of the reported throughput; at least the first 2 where their tensor memory
    is counted (`count_tensor_memory`)."""
    count_tensor_memory: bool = True
    """On CPU, without compile: count tensor memory with torch's MemTracker over the first 2
    training steps and the first evaluation (summary.json's `tensor_peak_mb`, the sweep report's
    `tensor peak MB` beside the planner's prediction). Those passes run slower, under the
    tracker's dispatch; false runs them plain, and a CPU run reports no tensor peak (NaN)."""
    resume: str | None = None
    """Continue a run: `auto` takes the newest checkpoint of the run folder (pass the old one as
    hydra.run.dir=...; with no checkpoint there yet, the run starts afresh and says so; a finished
    run ends at once), or give a checkpoint folder (`checkpoints/step-*`). Model, optimizer, step
    (hence LR schedule and data order), RNG and W&B run carry on; a cosine schedule stretched by
    another max_steps needs optimizer.schedule_steps."""
    init_from: str | None = None
    """Start a new run (step 0, a fresh optimizer, a new W&B run) from the weights of a checkpoint
    folder, a run folder (its newest checkpoint), an exported `.pt` or `.safetensors` file, a
    state_dict saved from `torchvision.models.resnet18()` (model=resnet), or, for model=gpt and
    gpt2_124m, GPT-2's weights: a transformers folder (save_pretrained's), its model.safetensors,
    or `hf:<hub name>` (`hf:gpt2`, downloaded into the hub's cache), under any strategy. With
    trainer.resume, a checkpoint to resume wins: a resumed fine-tune continues."""
    init_strict: bool = True
    """trainer.init_from's keys must be the model's; false loads the keys that fit, keeps the
    model's others as initialised and logs both lists (shapes must match either way)."""
    checkpoint: bool = True
    """false writes no checkpoint at all, not even at the end or when stopped (debug runs), so
    the run cannot be resumed or exported."""
    skip_nonfinite: bool = False
    """Skip optimizer steps whose loss is NaN/inf instead of stopping the run. Checks every step,
    which waits on the device once per step (on GPUs this costs overlap)."""
    test: bool = True
    """After training, score the model on the data's test split (as evaluation does, in batches
    of `eval_batch`): `test_loss`, `test_<figure>` in summary.json, `test/<figure>` in the
    metrics at the last step. After an early stop, the best checkpoint's weights are scored.
    Data without a test split (data.test_fraction=0) needs false."""
    monitor: str | None = "val/loss"
    """The metric (as metrics.jsonl names it: `val/<figure>` or `train/<figure>` of the task)
    whose best value keeps a checkpoint in `checkpoints/best/`, written at the steps it is logged
    (evaluation steps for val/*) when it improves; null: no best checkpoint."""
    monitor_mode: MonitorMode = MonitorMode.min
    """min: lower is better (losses); max: higher is better (accuracy, IoU)."""
    early_stop_patience: int = 0
    """Stop after this many values of `monitor` in a row without improvement (for val/*:
    evaluations); 0: never stop early."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights, `ema = decay * ema + (1 - decay) *
    weights` after each optimizer step (the first step's weights start it), in the strategy's
    own layout (sharded under fsdp); checkpoints save and resume it. null: none. Buffers (batch
    norm's statistics) are the model's own, not averaged."""
    ema_eval: bool = False
    """Score the average (`ema_decay`) instead of the weights: in evaluation, the test pass, the
    best checkpoint's choice, `eval.py` and the export."""

    def __post_init__(self) -> None:
        """Each setting's range, checked where it is defined (by `typed`, before any work)."""
        self.activation_checkpointing = recomputation(self.activation_checkpointing)
        if self.activation_checkpointing == Recomputation.selective and self.compile:
            # Its policy sees the ops of an eager forward; a compiled block's kernels write
            # into the outputs it kept (torch 2.14.1: "Tensor cached during selective
            # activation checkpoint has been mutated").
            raise ConfigError(
                "trainer.activation_checkpointing=selective cannot run with trainer.compile=true; "
                "use activation_checkpointing=full or compile=false"
            )
        for key in (
            "max_steps",
            "batch_size",
            "accumulate",
            "log_every",
            "profile_steps",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} must be at least 1, got {getattr(self, key)}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ConfigError(
                f"trainer.eval_batch_size must be at least 1 (or null), got {self.eval_batch_size}"
            )
        for key in (
            "eval_every",
            "checkpoint_every",
            "grad_clip",
            "timing_warmup_steps",
            "early_stop_patience",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key} must be 0 or more, got {getattr(self, key)}")
        if self.batch_size % self.accumulate:
            raise ConfigError(
                f"trainer.batch_size={self.batch_size} does not divide into "
                f"trainer.accumulate={self.accumulate} micro-batches; make the batch a multiple "
                "of trainer.accumulate"
            )
        if self.progress_every_s is not None and self.progress_every_s < 0:
            raise ConfigError(
                "trainer.progress_every_s must be 0 or more (or null), got "
                f"{self.progress_every_s:g}"
            )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"trainer.peak_tflops must be above 0, got {self.peak_tflops}")
        if self.loss_scale_init <= 0:
            raise ConfigError(
                f"trainer.loss_scale_init must be above 0, got {self.loss_scale_init}"
            )
        if self.keep_checkpoints < 0:
            raise ConfigError(
                "trainer.keep_checkpoints must be 0 (keep all) or more, got "
                f"{self.keep_checkpoints}"
            )
        if self.early_stop_patience and self.monitor is None:
            raise ConfigError(
                f"trainer.early_stop_patience={self.early_stop_patience} watches trainer.monitor, "
                "which is null; name a metric (e.g. trainer.monitor=val/loss) or set "
                "trainer.early_stop_patience=0"
            )
        if self.early_stop_patience and self.eval_every == 0 and self.monitor.startswith("val/"):
            raise ConfigError(
                f"trainer.early_stop_patience={self.early_stop_patience} counts evaluations, but "
                "trainer.eval_every=0 evaluates only after the last step; set trainer.eval_every"
            )
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ConfigError(
                f"trainer.ema_decay must be between 0 and 1 (both excluded; 0.999 is usual) or "
                f"null, got {self.ema_decay}"
            )
        if self.ema_eval and self.ema_decay is None:
            raise ConfigError(
                "trainer.ema_eval=true scores the weight average, but trainer.ema_decay is null; "
                "set trainer.ema_decay (e.g. 0.999) or trainer.ema_eval=false"
            )

    @property
    def eval_batch(self) -> int:
        """Samples per evaluation batch, over all devices: `eval_batch_size` or its default."""
        return self.eval_batch_size or self.batch_size // self.accumulate


def recomputation(value: Any) -> Recomputation:
    """trainer.activation_checkpointing as a `Recomputation` (true and false too)."""
    if isinstance(value, bool):
        return RECOMPUTATION_OF_BOOL[value]
    if value not in Recomputation.__members__:
        names = ", ".join(Recomputation.__members__)
        raise ConfigError(
            f"trainer.activation_checkpointing must be one of {names} (or true, false), "
            f"got {value!r}"
        )
    return Recomputation(value)
