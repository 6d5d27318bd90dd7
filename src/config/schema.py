"""Typed schemas for every config group.

Each YAML file under `conf/` starts from one of these schemas, so Hydra rejects a misspelt key or a
value of the wrong type (`trainer.max_steps=abc`) with its own message before any work starts.
Every default has its one source here, with what the setting does in the docstring below it; an
option's YAML file sets only what differs from its schema and what names the choice.
`register_configs()` puts them in Hydra's ConfigStore under `schema/<group>/<name>`; it is called
by `train.py` and the tests, never at import time.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A setting that cannot work; raised before any process or run file is created.

    `train.py` prints its message as one line (no traceback) and exits with `exit_code`, so the
    message names the setting and what to change."""

    exit_code = 2


class Choice(str, Enum):
    """A setting with a fixed set of values: the schema refuses any other while Hydra composes
    the config, naming the values it takes. Members compare equal to their names, and print as
    them."""

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
        return name

    def __str__(self) -> str:
        return self.value


def choices(name: str, values: str) -> type[Choice]:
    """A `Choice` of the space-separated `values`."""
    return Choice(name, values, module=__name__)



def typed(schema: type, node: Any) -> Any:
    """`node` (a composed config group, or a plain dict such as a launched rank's) as an object
    of its `schema` dataclass, which checks its ranges in `__post_init__`. Plain attributes: an
    OmegaConf lookup takes microseconds, and the loop makes several a step."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))

# ----------------------------------------------------------------------------------------- model
# A model is any `nn.Sequential` built by `_target_(input_shape=..., num_classes=..., **sizes)`;
# the block order is what model-parallel strategies split into stages.


@dataclass
class MLPConfig:
    _target_: str = "src.components.models.MLP"
    hidden: int = 256
    """Width of every hidden block."""
    depth: int = 4
    """Hidden Linear+ReLU blocks (the first also flattens its input); with the classifier head,
    depth + 1 blocks for a pipeline to split into stages."""


@dataclass
class ConvNetConfig:
    _target_: str = "src.components.models.ConvNet"
    width: int = 16
    """Channels of every conv block."""
    depth: int = 3
    """Conv blocks (3x3 conv, GroupNorm, ReLU); the first two also pool 2x2, halving the
    height and width."""
    hidden: int = 128
    """Width of the head's hidden layer."""


@dataclass
class GPTConfig:
    _target_: str = "src.components.models.GPT"
    n_layer: int = 2
    """Transformer blocks; with the embedding and the head, n_layer + 2 blocks for a pipeline to
    split into stages."""
    n_head: int = 2
    """Attention heads per block; n_embd must divide by it."""
    n_embd: int = 64
    """Width of the embeddings and of every block (each head gets n_embd / n_head)."""
    tie_weights: bool = True
    """The vocabulary head shares the token embedding's weight (GPT-2 does)."""
    vocab_multiple: int = 1
    """The embedding and head hold the vocabulary rounded up to a multiple of this (64 takes
    GPT-2's 50257 to nanoGPT's 50304): GPU matmuls run faster on such widths. The extra logits
    are never a target, so training pushes them down."""


@dataclass
class FCNConfig:
    _target_: str = "src.components.models.FCN"
    hidden: int = 32
    """Channels of every conv block."""
    depth: int = 3
    """3x3 conv blocks (with GroupNorm and ReLU) at full resolution, before the 1x1 conv to
    per-pixel class logits."""


@dataclass
class ResNetConfig:
    _target_: str = "src.components.resnet.ResNet"
    arch: str = "resnet18"
    """resnet18, resnet34 or resnet50: torchvision's block type and blocks per stage."""
    width: int = 64
    """Channels of the stem and the first stage (the later stages have 2, 4 and 8 times as
    many); torchvision's ResNets have 64."""
    cifar_stem: bool = False
    """A 3x3 stride-1 convolution and no max-pool (for 32x32 inputs such as CIFAR's) instead of
    ImageNet's 7x7 stride-2 convolution and max-pool."""
    weights: str | None = None
    """A local state_dict file to start from (this model's keys or torchvision's ResNet's, e.g.
    saved from `torchvision.models.resnet18()`); None: torchvision's random initialisation.
    Nothing is downloaded."""


@dataclass
class TransformerConfig:
    _target_: str = "src.components.models.Transformer"
    hidden: int = 64
    """Embedding width; it must divide by `heads`."""
    depth: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads per block."""


# ------------------------------------------------------------------------------------------ data
# A dataset builder returns `src.components.data.Data` (train/val/test sets plus their shapes). The
# loader settings are the loop's, not the builder's: `data_builder_config` leaves them out.


@dataclass
class LoaderConfig:
    num_workers: int | None = None
    """DataLoader worker processes per training process, for sets not held in memory as tensors
    (token files) and for augmented ones; None: up to 4 on CUDA, 0 on CPU."""
    pin_memory: bool = True
    """On CUDA, read into pinned memory, so that host-to-device copies do not block the host."""
    persistent_workers: bool = True
    """Keep the workers between evaluations."""
    prefetch_factor: int = 2
    """Batches each worker reads ahead."""
    augment: bool = False
    """Image sets: a random crop and horizontal flip of each training sample, drawn from
    (seed, epoch, sample index), so every strategy and worker count sees the same batches."""
    train_samples: int | None = None
    """Train on the first N training samples only, over and over (debug=overfit: a model that
    cannot overfit a few batches will not learn the whole set); None: all of them."""


@dataclass
class DataConfig(LoaderConfig):
    _target_: str = MISSING
    val_fraction: float = 0.1
    """Share of the samples held out for validation, chosen from the seed."""
    test_fraction: float = 0.1
    """The test split's size. Synthetic sets draw this share of num_samples as test samples
    besides them, from a generator seeded apart (seed + 0x9E3779B9), so that train and val hold
    what they hold without it; a token file's test part is this share of its tokens, just
    before the validation part (unless `test_path` gives a file of its own)."""


@dataclass
class GaussianInputsConfig(DataConfig):
    """What the synthetic sets of Gaussian inputs (classification, regression) share."""

    input_dim: int = 32
    """Features per input, each drawn from a standard normal."""


@dataclass
class SyntheticConfig(GaussianInputsConfig):
    _target_: str = "src.components.data.synthetic_classification"
    num_classes: int = 10
    num_samples: int = 8192
    image_shape: list[int] | None = None
    """Set (e.g. [1, 16, 16]) to generate image-shaped inputs for `model=convnet`."""


@dataclass
class SyntheticTokensConfig(DataConfig):
    _target_: str = "src.components.data.synthetic_tokens"
    vocab_size: int = 64
    """Tokens are 0 .. vocab_size - 1."""
    seq_len: int = 32
    """Input tokens per sample; the targets are the tokens that follow each one."""
    num_samples: int = 4096
    successors: int = 4
    """Tokens that may follow each token (drawn from the seed, as are their probabilities): the
    chain's memory is vocab_size x successors, and a model's loss can fall to its entropy (0.77
    nats on average at 4), far below ln(vocab_size)."""


@dataclass
class SyntheticSegmentationConfig(DataConfig):
    _target_: str = "src.components.data.synthetic_segmentation"
    num_classes: int = 4
    image_shape: list[int] = field(default_factory=lambda: [3, 16, 16])
    num_samples: int = 1024
    ignore_fraction: float = 0.1
    """Share of the pixels labelled `ignore_index` (counted in no figure)."""
    ignore_index: int = -100
    """Keep it task.ignore_index (conf/data/synthetic_segmentation.yaml does)."""


@dataclass
class SyntheticRegressionConfig(GaussianInputsConfig):
    _target_: str = "src.components.data.synthetic_regression"
    output_dim: int = 4
    """Floats per target; the model's output width must match it."""
    num_samples: int = 4096


@dataclass
class TorchvisionSetConfig(LoaderConfig):
    """A set torchvision reads from its published files (`src/components/vision.py`): the test
    part tests, and the training part trains and validates."""

    _target_: str = MISSING
    val_fraction: float = 0.1
    """Share of the training part held out for validation, chosen from the seed."""
    root: str = "data"
    """Folder holding the set's files as torchvision lays them out (the option's file says
    where)."""
    download: bool = False
    """Fetch the files when missing, with torchvision; needs network. Never done unless asked."""


@dataclass
class ImageFolderConfig(LoaderConfig):
    _target_: str = "src.components.vision.image_folder"
    root: str = MISSING
    """Folder holding `train/<class>/<image>`, `val/<class>/<image>` and `test/<class>/<image>`
    (any format PIL reads); without test/, val/ is the test split too."""
    image_size: Any = None
    """[height, width] every image is resized to, or one size for squares (as torchvision's
    Resize takes it); None: the images must all be of one size. (`Any`: OmegaConf's schemas
    cannot say "an int or a list of ints"; the builder checks it.)"""
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """Per-channel mean subtracted from the RGB images (in [0, 1]); ImageNet's by default."""
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """Per-channel standard deviation the images are divided by."""


@dataclass
class TokensConfig(DataConfig):
    _target_: str = "src.components.data.tokens"
    path: str = MISSING
    """A flat uint16 token file, as nanoGPT's prepare scripts write `train.bin`."""
    seq_len: int = 256
    vocab_size: int | None = None
    """None: the files' largest token + 1."""
    test_path: str | None = None
    """A token file of its own for the test split; None: `test_fraction` of `path`."""


def data_builder_config(data: DictConfig) -> DictConfig:
    """The data settings without the loader's (`LoaderConfig`): what the builder takes."""
    loader_keys = {field.name for field in dataclasses.fields(LoaderConfig)}
    return OmegaConf.create({key: data[key] for key in data if key not in loader_keys})


# ------------------------------------------------------------------------------------------ task
# A task turns (outputs, targets) into sums: the loss sum, metric sums, and the count to divide by
# (`src/components/tasks.py`). Your own: any class with `sums`, `count` and `figures`, named by
# _target_.


@dataclass
class TaskConfig:
    _target_: str = "src.components.tasks.Classification"


@dataclass
class LanguageModelConfig(TaskConfig):
    _target_: str = "src.components.tasks.LanguageModel"


@dataclass
class SegmentationConfig(TaskConfig):
    _target_: str = "src.components.tasks.Segmentation"
    ignore_index: int = -100
    """Target pixels with this label count in no loss, accuracy or IoU."""


@dataclass
class RegressionConfig(TaskConfig):
    _target_: str = "src.components.tasks.Regression"


# -------------------------------------------------------------------------------------- parallel


Backend = choices("Backend", "gloo nccl")


def at_least_one(config: Any, *keys: str) -> None:
    """ConfigError, in one line, for the first of the parallel settings `keys` below 1."""
    for key in keys:
        if getattr(config, key) < 1:
            raise ConfigError(f"parallel.{key} must be at least 1, got {getattr(config, key)}")


AUTO = "auto"  # parallel=auto: the planner (src/planning/planner.py) chooses the strategy


@dataclass
class ParallelConfig:
    """How the work is spread over devices: `_target_` is the strategy class (src/parallel/),
    built with these settings and the device type; `name` labels the runs."""

    _target_: str = "src.parallel.single.Single"
    name: str = "single"
    devices: int = 1
    """Devices per node: GPUs on CUDA; replicas, processes or stages on CPU."""
    nodes: int = 1
    """>1: run train.py on every node with the same master_addr/master_port (strategies with
    one process per replica)."""
    chosen_by: str | None = None
    """Set by parallel=auto: why the planner chose this strategy (also in summary.json)."""

    def __post_init__(self) -> None:
        """Each setting's range, checked where it is defined (`build_strategy` makes the object,
        before any work)."""
        at_least_one(self, "devices", "nodes")


@dataclass
class DistributedConfig(ParallelConfig):
    """Settings shared by every strategy that runs one process per replica; trainer.batch_size
    is split over all the processes."""

    backend: Backend | None = None
    """None picks nccl on CUDA and gloo on CPU."""
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    """0 lets the OS choose a free port (single node only)."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective that waits longer ends the job instead of hanging
    (gloo raises; NCCL's watchdog aborts the process). Keep it above the slowest checkpoint
    write: the other ranks wait for rank 0's meanwhile."""
    threads_per_rank: int | None = None
    """Intra-op threads per rank; None divides the cores by the local ranks (or OMP_NUM_THREADS)."""
    sync_batchnorm: bool = False
    """Make every BatchNorm a SyncBatchNorm: statistics over the global batch, as `single` has,
    instead of each rank's share (one all-reduce per BatchNorm layer per forward pass)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be positive, got {self.timeout_s}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ConfigError(
                f"parallel.threads_per_rank must be at least 1 or null, got {self.threads_per_rank}"
            )


@dataclass
class StagesConfig:
    """How a pipeline runs its stages (model_parallel's, and each of hybrid's processes')."""

    microbatches: int = 1
    """1 runs the naive schedule (one stage busy at a time); M>1 runs a GPipe schedule over M
    micro-batches (idle share (S-1)/(M+S-1) for S stages)."""
    split_points: list[int] | None = None
    """Block indices where stages 1.. start, e.g. [2]; None balances stages by parameter count."""
    deferred_batchnorm: bool = False
    """torchgpipe's deferred BatchNorm: with microbatches=M>1 each micro-batch is still
    normalised by itself, but the running statistics are updated once a step, from the whole
    batch's statistics, instead of once per micro-batch."""

    def __post_init__(self) -> None:
        # A mixin ahead of a ParallelConfig in every schema that has it, which checks the rest.
        at_least_one(self, "microbatches")
        if self.deferred_batchnorm and getattr(self, "sync_batchnorm", False):
            raise ConfigError(
                "parallel.deferred_batchnorm=true and parallel.sync_batchnorm=true both replace "
                "BatchNorm; choose one"
            )
        super().__post_init__()


@dataclass
class PipelineConfig(StagesConfig, ParallelConfig):
    pass


@dataclass
class DDPConfig(DistributedConfig):
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm running statistics) to every rank before each
    training forward pass, as torch's DDP does by default; false lets each rank keep its own."""
    # DistributedDataParallel's own options, as torch's error messages name them.
    find_unused_parameters: bool = False
    """Set when some parameters get no gradient in a step (a branch not taken, a frozen head):
    DDP then marks them ready itself instead of waiting for them forever. Costs a graph walk
    per step."""
    static_graph: bool = False
    """The set of parameters used, and the order of their gradients, is the same every step:
    lets DDP skip the per-step search for unused parameters after the first step."""
    gradient_as_bucket_view: bool = False
    """Gradients are views into DDP's all-reduce buckets: one copy less per step, less memory."""
    bucket_cap_mb: float | None = None
    """Size of DDP's gradient buckets (MB); None keeps torch's default (25)."""


@dataclass
class HybridConfig(StagesConfig, DDPConfig):
    stages: int = 2
    """Pipeline stages per process: parallel.devices (a multiple of it) / stages processes per
    node; `microbatches` is per process."""

    def __post_init__(self) -> None:
        at_least_one(self, "stages")
        if self.devices % self.stages:
            raise ConfigError(
                f"parallel.devices={self.devices} does not divide into processes of "
                f"parallel.stages={self.stages} devices each; make parallel.devices a multiple of "
                "parallel.stages"
            )
        super().__post_init__()


@dataclass
class MeshConfig(DistributedConfig):
    """An N-D layout on one DeviceMesh (src/parallel/mesh.py): degrees whose product is the
    number of processes (parallel.devices x parallel.nodes); -1 takes the ranks the others leave."""

    dp_replicate: int = 1
    """Data-parallel replicas (ddp; hsdp with dp_shard > 1)."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2): parameters, gradients and optimizer state split this many
    ways."""
    tp: int = 1
    """Tensor-parallel ranks each Linear pair of the model's plan is split over."""
    pp: int = 1
    """Pipeline ranks, each holding `stages_per_rank` stages of the model's blocks."""
    schedule: str = "1F1B"
    """With pp: torch.distributed.pipelining's schedule, by name: GPipe, 1F1B, Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (the last two in a V: rank r
    holds stages r and 2 pp - 1 - r)."""
    microbatches: int = 2
    """With pp: micro-batches each data-parallel share of a micro-step is cut into."""
    stages_per_rank: int = 1
    """With pp: stages (virtual stages) per pipeline rank; 2 or more for the looped schedules,
    exactly 2 for the V-shaped ones."""
    sequence_parallel: bool = False
    """With tp: the norms and the residual stream between blocks split along the sequence, each
    block's all-reduce a reduce-scatter and an all-gather (activation memory / tp)."""
    loss_parallel: bool = False
    """With tp: the vocabulary head's logits stay split over the tp ranks into the cross-entropy
    (no rank holds all of them; an untied head)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "microbatches", "stages_per_rank")


# --------------------------------------------------------------------------------------- trainer


Precision = choices("Precision", "fp32 bf16 fp16")
Accelerator = choices("Accelerator", "auto cpu cuda")
CheckpointFormat = choices("CheckpointFormat", "auto full sharded")
MatmulPrecision = choices("MatmulPrecision", "auto highest high medium")
MonitorMode = choices("MonitorMode", "min max")
CheckpointErrors = choices("CheckpointErrors", "fail warn")


@dataclass
class TrainerConfig:
    max_steps: int = 300
    """Optimizer steps to run."""
    batch_size: int = 128
    """Global batch per optimizer step, summed over devices and accumulation micro-steps."""
    accumulate: int = 1
    """Micro-steps per optimizer step; the batch must divide by it."""
    log_every: int = 25
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
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them: less memory,
    about one more forward pass of compute."""
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
    """Steps left out of the reported throughput."""
    resume: str | None = None
    """Continue a run: `auto` takes the newest checkpoint of the run folder (pass the old one as
    hydra.run.dir=...; with no checkpoint there yet, the run starts afresh and says so; a finished
    run ends at once), or give a checkpoint folder (`checkpoints/step-*`). Model, optimizer, step
    (hence LR schedule and data order), RNG and W&B run carry on; a cosine schedule stretched by
    another max_steps needs optimizer.schedule_steps."""
    init_from: str | None = None
    """Start a new run (step 0, a fresh optimizer, a new W&B run) from the weights of a checkpoint
    folder, a run folder (its newest checkpoint), an exported `.pt` or `.safetensors` file, or a
    state_dict saved from `torchvision.models.resnet18()` (model=resnet), under any strategy. With
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
    metrics at the last step. After an early stop, the best checkpoint's weights are scored."""
    monitor: str | None = "val/loss"
    """The metric (as metrics.jsonl names it: `val/<figure>` or `train/<figure>` of the task)
    whose best value keeps a checkpoint in `checkpoints/best/`, written at the steps it is logged
    (evaluation steps for val/*) when it improves; null: no best checkpoint."""
    monitor_mode: MonitorMode = MonitorMode.min
    """min: lower is better (losses); max: higher is better (accuracy, IoU)."""
    early_stop_patience: int = 0
    """Stop after this many values of `monitor` in a row without improvement (for val/*:
    evaluations); 0: never stop early."""


    def __post_init__(self) -> None:
        """Each setting's range, checked where it is defined (by `typed`, before any work)."""
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

    @property
    def eval_batch(self) -> int:
        """Samples per evaluation batch, over all devices: `eval_batch_size` or its default."""
        return self.eval_batch_size or self.batch_size // self.accumulate

# ------------------------------------------------------------------------------------- optimizer


Schedule = choices("Schedule", "constant cosine")


@dataclass
class OptimizerConfig:
    """`_target_` builds the optimizer (`_partial_`: given the model's parameter groups later)
    from every setting but `OWN_KEYS`: the name, the learning-rate schedule's and the groups'."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    decay_1d: bool = True
    """Weight decay on tensors of fewer than 2 dimensions too (biases, norms' scales and
    shifts); false gives them a parameter group of their own without decay, as GPT-2 and nanoGPT
    train."""
    name: str = MISSING
    """Labels the optimizer: a checkpoint resumes only under the one it was trained with."""
    schedule: Schedule = Schedule.cosine
    """constant, or cosine (linear warm-up, then cosine decay to min_lr_ratio * lr)."""
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    schedule_steps: int | None = None
    """Steps the cosine decays over (later steps keep its final rate); None: trainer.max_steps.
    Resuming with another trainer.max_steps needs it set, to keep or to stretch the schedule."""


OWN_KEYS = ("name", "decay_1d", "schedule", "warmup_steps", "min_lr_ratio", "schedule_steps")


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    name: str = "sgd"


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "src.components.optimizer.adamw"
    weight_decay: float = 0.01
    decay_1d: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    name: str = "adamw"


# ---------------------------------------------------------------------------------------- logger


WandbMode = choices("WandbMode", "offline online shared disabled")


@dataclass
class LoggerConfig:
    name: str = "none"


@dataclass
class WandbConfig(LoggerConfig):
    name: str = "wandb"
    project: str = "parallel-training"
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    job_type: str | None = None
    mode: WandbMode = WandbMode.offline
    """offline (needs no account or network; `wandb sync <run dir>/wandb/offline-run-*` uploads
    it later), online, shared or disabled; the WANDB_MODE environment variable wins when set."""
    init_timeout_s: float = 60.0
    """How long an online run may take to start before the run logs offline instead."""
    log_checkpoints: bool = False
    """Log the best checkpoint (`checkpoints/best/`, trainer.monitor's) as the run's model
    artifact at the end of training."""


# ------------------------------------------------------------------------------------------ plan


@dataclass
class PlanConfig:
    """What `python plan.py` and `parallel=auto` plan for (`src/planning/planner.py`)."""

    device_memory_gb: float = 80.0
    """Memory of one device (GPU; on CPU, what one process may use)."""
    accelerator: Accelerator = Accelerator.auto
    """The devices planned for: cpu (a row per process), cuda (a row per GPU: dp's output device
    and each pipeline stage apart; no GPU needed to plan), or auto: trainer.accelerator's."""
    strategies: list[str] | None = None
    """Strategies to plan; None: every one (parallel=auto, and plan.py unless an override
    names the parallel option: then that one)."""
    devices: list[int] | None = None
    """Device counts to plan; None: parallel.devices."""
    device_tflops: float = 100.0
    """One device's sustained TFLOP/s, for the predicted step time that ranks the strategies."""
    link_gb_per_s: float = 50.0
    """Bytes per second (GB/s) one device sends to another, for the same."""


    def __post_init__(self) -> None:
        """Each setting's range (checked by `typed`, before any tracing)."""
        if self.device_memory_gb <= 0:
            raise ConfigError(f"plan.device_memory_gb must be above 0, got {self.device_memory_gb}")
        if any(count < 1 for count in self.devices or []):
            raise ConfigError(f"plan.devices must all be at least 1, got {list(self.devices)}")
        if self.link_gb_per_s <= 0 or self.device_tflops <= 0:
            raise ConfigError("plan.link_gb_per_s and plan.device_tflops must be above 0")

# ---------------------------------------------------------------------------------------- config


@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    parallel: Any = MISSING
    trainer: TrainerConfig = MISSING
    optimizer: Any = MISSING
    logger: Any = MISSING
    plan: PlanConfig = field(default_factory=PlanConfig)
    seed: int = 0


@dataclass
class EvalConfig(Config):
    """`python eval.py`'s own settings; the others are the evaluated run's (`SAVED_RUN`)."""

    ckpt_path: str = MISSING
    """A run folder (its newest checkpoint), a checkpoint folder, or `best` / `last`: the run's
    `checkpoints/best`, or its newest `checkpoints/step-*`, of the run in `run_dir`."""
    run_dir: str | None = None
    """The run whose `best` / `last` checkpoint to evaluate; None: the newest run in outputs/."""
    split: str = "test"
    """The data split to evaluate: test, val, ... (the data's own)."""
    predict: bool = False
    """Also write the model's outputs for every sample of the split to predictions.pt."""


# The option of each group that `eval.py` stores from the evaluated checkpoint's config
# (`store_saved_run`); `parallel` is eval.py's own: any layout reads any checkpoint.
SAVED_RUN = "saved_run"
SAVED_GROUPS = ("model", "data", "task", "trainer", "optimizer", "logger")


SCHEMAS = {
    "model": {
        "mlp": MLPConfig,
        "convnet": ConvNetConfig,
        "transformer": TransformerConfig,
        "fcn": FCNConfig,
        "gpt": GPTConfig,
        "resnet": ResNetConfig,
    },
    "data": {
        "synthetic": SyntheticConfig,
        "synthetic_tokens": SyntheticTokensConfig,
        "synthetic_segmentation": SyntheticSegmentationConfig,
        "synthetic_regression": SyntheticRegressionConfig,
        "torchvision_set": TorchvisionSetConfig,
        "image_folder": ImageFolderConfig,
        "tokens": TokensConfig,
    },
    "task": {
        "classification": TaskConfig,
        "language_model": LanguageModelConfig,
        "segmentation": SegmentationConfig,
        "regression": RegressionConfig,
    },
    "parallel": {
        "base": ParallelConfig,
        "distributed": DistributedConfig,
        "ddp": DDPConfig,
        "pipeline": PipelineConfig,
        "hybrid": HybridConfig,
        "mesh": MeshConfig,
    },
    "trainer": {"default": TrainerConfig},
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "logger": {"none": LoggerConfig, "wandb": WandbConfig},
}


def register_configs() -> None:
    """Store the schemas so that YAML files can start from `/schema/<group>/<name>@_here_`."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    store.store(name="eval_schema", node=EvalConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=schema)


def store_saved_run(config: dict[str, Any]) -> None:
    """A run's resolved `config` (a checkpoint's) as the option `saved_run` of each of
    `SAVED_GROUPS` it has: selected by `<group>=saved_run`, a group composes as the run had it, and
    the command line's overrides apply on top, as to any option."""
    store = ConfigStore.instance()
    for group in SAVED_GROUPS:
        if group in config:  # a weights file's config has the model's only
            store.store(group=group, name=SAVED_RUN, node=config[group])


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """`cfg` resolved into plain values, each `Choice` as its name: what checkpoints (read with
    `weights_only`), W&B and the started ranks take."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def composition_error_line(error: Exception) -> str:
    """Hydra's report of a config it cannot compose, in one line: what failed, why, and for a
    misspelt key the closest key there (or all of them); for an unknown option, the options."""
    first, *rest = str(error).splitlines()
    if isinstance(error, MissingConfigException) and error.options:
        return f"{first}; choose one of {', '.join(error.options)}"
    # Hydra's hints: a link to its docs, and `+key=value`, which a typed schema refuses anyway.
    parts = [first] + [line for line in rest if line and not line.startswith(("See ", "To "))]
    if isinstance(error, OverrideParseException) and error.override not in first:
        parts.insert(0, f"Error parsing override '{error.override}'")
    cause = error.__cause__
    if cause is not None:
        parts.append(str(cause).splitlines()[0])
    line = ": ".join(part.rstrip(".") for part in parts)
    node, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if isinstance(node, DictConfig) and isinstance(key, str) and key not in node:
        keys = [str(k) for k in node]
        close = difflib.get_close_matches(key, keys, n=1)
        line += f"; did you mean {close[0]}?" if close else f"; the keys there: {', '.join(keys)}"
    return line
