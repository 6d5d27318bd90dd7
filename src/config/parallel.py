"""Schemas of `conf/parallel/`: how the work is spread over devices."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from src.config.base import ConfigError, choices

Backend = choices("Backend", "gloo nccl", __name__)
Offload = choices("Offload", "none cpu", __name__)


def at_least_one(config: Any, *keys: str) -> None:
    """ConfigError, in one line, for the first of the parallel settings `keys` below 1."""
    for key in keys:
        if getattr(config, key) < 1:
            raise ConfigError(f"parallel.{key} must be at least 1, got {getattr(config, key)}")


@dataclass(frozen=True)
class NodeRange:
    """The nodes of a job, from `parallel.nodes`: `least` to `most`, equal unless it is elastic."""

    least: int
    most: int

    @property
    def elastic(self) -> bool:
        return self.least < self.most


def node_range(nodes: int | str) -> NodeRange:
    """`parallel.nodes` read: N, or MIN:MAX for an elastic job; ConfigError in one line for any
    other form. (N below 1 is `at_least_one`'s to refuse.)"""
    found = re.fullmatch(r"(\d+)(?::(\d+))?", str(nodes).strip())
    if found is None:
        raise ConfigError(
            f"parallel.nodes={nodes}: give a number of nodes, or MIN:MAX (e.g. 1:2) for an "
            "elastic job that goes on when nodes are lost"
        )
    least, most = int(found[1]), int(found[2] or found[1])
    if found[2] is not None and not 1 <= least < most:
        raise ConfigError(
            f"parallel.nodes={nodes}: MIN:MAX needs 1 <= MIN < MAX (e.g. 1:2); for a fixed "
            "number of nodes give one number"
        )
    return NodeRange(least, most)


AUTO = "auto"  # parallel=auto: the planner (src/planning/planner.py) chooses the strategy


@dataclass
class ParallelConfig:
    """How the work is spread over devices: `_target_` is the strategy class (src/parallel/),
    built with these settings and the device type; `name` labels the runs."""

    _target_: str = "src.parallel.strategies.single.Single"
    name: str = "single"
    devices: int = 1
    """Devices per node: GPUs on CUDA; replicas, processes or stages on CPU."""
    nodes: Any = 1
    """>1: run train.py on every node with the same master_addr/master_port (strategies with
    one process per replica). MIN:MAX (e.g. 1:2): an elastic job, which starts on MAX nodes and
    goes on with as few as MIN when nodes are lost (`DistributedConfig.max_restarts`). Here, as
    the strategy's setting, it is the nodes the job runs on now (`node_range`)."""
    chosen_by: str | None = None
    """Set by parallel=auto: why the planner chose this strategy (also in summary.json)."""

    def __post_init__(self) -> None:
        """Each setting's range, checked where it is defined (`build_strategy` makes the object,
        before any work)."""
        self.nodes = node_range(self.nodes).most
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
    max_restarts: int = 3
    """An elastic job's (nodes=MIN:MAX) restarts: each failure (a node lost) re-forms the job on
    the nodes left and restarts their ranks from the last checkpoint. A job of a fixed number of
    nodes never restarts: a failure ends it."""
    rejoin: bool = False
    """An elastic job's node that comes back (the same train.py command started on it again)
    joins the job once it has lost a node: the others' ranks stop together after their next
    step that logs, checkpoint, and restart with it from there. false: it is refused (exit 2)."""
    sync_batchnorm: bool = False
    """Make every BatchNorm a SyncBatchNorm: statistics over the global batch, as `single` has,
    instead of each rank's share (one all-reduce per BatchNorm layer per forward pass)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s must be positive, got {self.timeout_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"parallel.max_restarts must be 0 or more, got {self.max_restarts}")
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
class ReducerConfig:
    """DistributedDataParallel's own options, as torch's error messages name them: a layout of
    dp_replicate alone runs DDP (src/parallel/dp_replicate/); any other refuses them set."""

    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm running statistics) to every rank before each
    training forward pass, as torch's DDP does by default; false lets each rank keep its own."""
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
class MeshConfig(StagesConfig, ReducerConfig, DistributedConfig):
    """An N-D layout of one process per rank: degrees whose product is the number of processes
    (parallel.devices / parallel.stages x parallel.nodes); -1 takes the ranks the others leave.
    ddp, fsdp, hybrid, tp, pp, cp, fsdp_tp, fsdp_cp_tp, fsdp_tp_pp, ep and mesh are presets of
    it: dp_replicate alone runs as DDP (src/parallel/strategies/replicated.py), any other layout
    on one DeviceMesh (src/parallel/strategies/mesh.py)."""

    dp_replicate: int = 1
    """Data-parallel replicas: torch's DDP when no other degree is set, else FSDP2's (HSDP with
    dp_shard)."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2): parameters, gradients and optimizer state split this many
    ways."""
    cp: int = 1
    """Context-parallel ranks each sequence is split over (attention as a ring; the cp ranks of
    one data-parallel index read the same samples)."""
    tp: int = 1
    """Tensor-parallel ranks each Linear pair of the model's plan is split over."""
    ep: int = 1
    """Expert-parallel ranks (model=moe): each holds experts / ep whole experts, and its tokens
    go to their experts' ranks and back by all_to_all. Borrowed from dp_shard, which it must
    divide (no processes of its own); -1: all of dp_shard."""
    pp: int = 1
    """Pipeline ranks, each holding `stages_per_rank` stages of the model's blocks."""
    stages: int = 1
    """Pipeline stages within each process, on its own `stages` devices (hybrid: DDP over
    pipelines; with dp_replicate alone): parallel.devices (a multiple of it) / stages processes
    per node."""
    schedule: str = "1F1B"
    """With pp: torch.distributed.pipelining's schedule, by name: GPipe, 1F1B, Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (the last two in a V: rank r
    holds stages r and 2 pp - 1 - r)."""
    microbatches: int = 2
    """Micro-batches each data-parallel share of a micro-step is cut into, with pp or stages (the
    hybrid preset sets 1: the naive schedule)."""
    stages_per_rank: int = 1
    """With pp: stages (virtual stages) per pipeline rank; 2 or more for the looped schedules,
    exactly 2 for the V-shaped ones."""
    sequence_parallel: bool = False
    """With tp: the norms and the residual stream between blocks split along the sequence, each
    block's all-reduce a reduce-scatter and an all-gather (activation memory / tp)."""
    loss_parallel: bool = False
    """With tp: the vocabulary head's logits stay split over the tp ranks into the cross-entropy
    (no rank holds all of them; an untied head)."""
    offload: Offload = Offload.none
    """cpu: FSDP2's CPUOffloadPolicy: each rank's shards of the parameters, gradients and
    optimizer state live in pinned host memory, copied to the GPU unit by unit for compute, and
    the optimizer steps on the CPU (device memory for time). CUDA only: a run on CPU is refused
    (exit 2) rather than run as if offloaded, as is a layout without dp_shard."""

    def __post_init__(self) -> None:
        at_least_one(self, "stages", "stages_per_rank")
        if self.ep < 1 and self.ep != -1:
            raise ConfigError(
                f"parallel.ep must be at least 1, or -1 (all of dp_shard), got {self.ep}"
            )
        if self.devices % self.stages:
            raise ConfigError(
                f"parallel.devices={self.devices} does not divide into processes of "
                f"parallel.stages={self.stages} devices each; make parallel.devices a multiple of "
                "parallel.stages"
            )
        super().__post_init__()
        if self.offload == Offload.cpu and self.dp_shard == 1:
            raise ConfigError(
                "parallel.offload=cpu moves FSDP's shards to the host, but parallel.dp_shard=1 "
                "shards nothing; set parallel.dp_shard above 1 (or -1), or parallel.offload=none"
            )
        self.check_pipeline_settings()

    def check_pipeline_settings(self) -> None:
        """ConfigError, in one line, for a pipeline's settings under a layout without one (ddp,
        fsdp, tp: the schema they share has the keys, which would otherwise do nothing)."""
        unused = ("schedule", "stages_per_rank") if self.pp == 1 else ()
        if self.pp == 1 and self.stages == 1:
            unused += ("microbatches", "split_points", "deferred_batchnorm")
        defaults = {option.name: option.default for option in fields(MeshConfig)}
        changed = [
            f"parallel.{name}={getattr(self, name)}"
            for name in unused
            if getattr(self, name) != defaults[name]
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: pipeline settings, but this layout has no pipeline "
                f"(parallel.pp={self.pp}, parallel.stages={self.stages}); leave them out, or set "
                "parallel.pp (parallel=pp) or parallel.stages (parallel=hybrid)"
            )
