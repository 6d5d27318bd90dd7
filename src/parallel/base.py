"""The interface between the shared training loop and a way of spreading work over devices.

The trainer (`src/training/`) calls only what is below and never asks which strategy it holds.
Three Protocols name each caller's part: `TrainingStrategy` (the trainer and its loop),
`CheckpointedStrategy` (`src/checkpoint/store.py`) and `PlannedStrategy` (the planner); `Strategy`
implements all three, with defaults for a strategy of one process. What a layout costs is not
the strategy's to compute: `cost_model` hands the planner an object that does (`CostModel`), so a
strategy without one still runs.

Before any work (in the launching process):
    strategy = Strategy(cfg.parallel, device_type, precision, ranks)
                                                       checks the settings, touches no device;
                                                       precision: trainer.precision; ranks: the
                                                       ranks torchrun, srun or `launch` started,
                                                       this process among them (None: it runs
                                                       alone)
    strategy.check_batch(micro_batch)                  the global micro-batch splits as needed
    strategy.check_accumulate(accumulate)              micro-steps per optimizer step work here
    strategy.check_visible_gpus()                      enough GPUs for the job, or for this rank
    strategy.check_model(model, inputs)                the model (built on the meta device) fits,
                                                       given a batch of meta inputs; pipelines
                                                       choose their stage boundaries here (every
                                                       training process gets its strategy from
                                                       these checks, see `check_config`)
    strategy.processes_per_node                        how many local processes the job needs;
                                                       more than 1 makes `train.py` launch them
In each training process:
    strategy.setup()                   process group, this process's devices, threads
    model = strategy.wrap(model)       place / replicate / split a plain `nn.Sequential`
    strategy.unwrap(model)             the plain model again (its parameters and state_dict keys
                                       are the same as `single`'s)
    strategy.trained_parameters(model) the parameters this process trains, the optimizer's (all
                                       of the plain model's, but a pp rank's own stages')
    strategy.clip_grad_norm(ps, limit) their gradients scaled to a total norm of at most `limit`,
                                       the norm over the whole model's (`trainer.grad_clip`)
    rank, world_size                   this process's rank and the job's processes
    data_shard, data_shards            the share of each global batch this process reads, of
                                       how many (the data-parallel processes: the loader feeds
                                       each `global batch / data_shards` samples; their gradients
                                       are averaged; tp and pp peers read the same share)
    job_devices                        every device the job computes on (for MFU)
    is_main                            the one process that logs and writes files
Per micro-step:
    with strategy.grad_sync(model, enabled):         False on accumulation steps that do not
        out = strategy.apply(model, x, y, fn)        step the optimizer (DDP's no_sync)
        (out[0] / count).backward()                  fn gives [loss sum, correct predictions]
    `x` and `y` are tensors or tuples/lists/dicts of tensors (`src/components/batches.py`); the
    model takes `x` as one argument, `fn` the outputs and `y` as they are.
    `apply` runs the forward pass however the strategy likes (scattered, pipelined, ...), calls
    `fn(outputs, targets)` where the outputs are, and returns the sum of `fn`'s results over the
    parts as one tensor. `fn` always returns sums (see `src/components/tasks.py`), so dividing by
    the number of targets gives the exact mean over the batch, whatever the split.
Checkpoints (every process calls these; the main one writes the file):
    strategy.model_state_dict(model)                 the full state_dict, single's keys
    strategy.optimizer_state_dict(model, optimizer)  the full optimizer state, single's format
    strategy.load_optimizer_state_dict(model, optimizer, state)   the inverse, on resume
    A full checkpoint's model weights are loaded into the plain model before `wrap`.
    strategy.sharded_checkpoints                     whether it writes and reads `sharded` ones:
    strategy.sharded_state_dict(model, optimizer)    this process's part (DCP's state_dict APIs)
    strategy.load_sharded(model, optimizer, path)    read it back, into the wrapped model, any
                                                     number of processes having written it
                                                     (optimizer None: the model alone; key=:
                                                     another optimizer state alone, `ema`)
    strategy.default_checkpoint_format               what trainer.checkpoint_format=auto means
Once, before training:
    strategy.grad_scaler(enabled, init_scale)   fp16's GradScaler (one that knows how the
                                 gradients are split, where they are)
Now and then:
    strategy.all_reduce_sum(t)   sum over data-parallel processes (on log, eval and checkpoint
                                 steps; every step with trainer.skip_nonfinite)
    strategy.barrier()
    strategy.synchronize()       wait for queued device work (timing)
    strategy.local_peak_memory_mb(*cpu_mb)  (labels, megabytes by measure) for this process's
                                 devices: for each measure, the allocator's peak on CUDA,
                                 its value (`devices.process_peak_memory_mb`) on CPU
    strategy.peak_memory_mb(*cpu_mb)   the same for every device the job used (all processes,
                                 every measure in one gather)
    strategy.report()            strategy-specific figures for summary.json (e.g. bubble)
    strategy.teardown()
For the planner (`src/planning/planner.py`), after check_batch and check_model:
    strategy.cost_model()        what prices its layout (`CostModel`: each device's share of a
                                 step, the bytes and messages sent, the idle share), touching
                                 no device; None: it runs, but cannot be planned
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from src.checkpoint.dcp_state import dcp_state_dict, read_dcp, set_dcp_state
from src.components.batches import Tree
from src.config.base import ConfigError
from src.config.parallel import ParallelConfig
from src.parallel.shares import DeviceShare, Messages, ModelSizes
from src.runtime.ranks import Ranks

LossFn = Callable[[Tree, Tree], torch.Tensor]
"""A task's `sums`: (outputs, targets) -> a 1-D tensor of sums."""


@runtime_checkable
class CostModel(Protocol):
    """What the planner prices a strategy's layout with, once the strategy's `check_model` ran."""

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """What each device holds and runs in a step of `micro_batch` samples."""

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        """Bytes sent per optimizer step (`accumulate` micro-steps), by transfer: what each rank
        sends for collectives, what crosses all stage boundaries for pipelines, what the output
        device exchanges for dp."""

    def idle_fraction(self) -> float:
        """Share of a step each device waits for others (a pipeline's bubble)."""

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """The messages between processes a rank takes part in per optimizer step (one
        process sends none: its devices share its memory, `step_traffic` says how much)."""


@runtime_checkable
class TrainingStrategy(Protocol):
    """What the trainer and its loop call on a strategy (each `Strategy` is one)."""

    name: str
    device_type: str
    devices: list[torch.device]
    processes_per_node: int
    world_size: int
    data_shard: int
    data_shards: int
    job_devices: int
    is_main: bool

    def setup(self) -> None: ...

    def wrap(self, model: nn.Module) -> nn.Module: ...

    def unwrap(self, model: nn.Module) -> nn.Module: ...

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]: ...

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> None: ...

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor: ...

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager: ...

    def grad_scaler(self, enabled: bool, init_scale: float) -> torch.amp.GradScaler: ...

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None: ...

    def load_sharded(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        path: str,
        key: str = "optimizer",
    ) -> None: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def synchronize(self) -> None: ...

    def peak_memory_mb(
        self, *cpu_mb: Callable[[], float]
    ) -> tuple[list[str], list[list[float]]]: ...

    def local_peak_memory_mb(
        self, *cpu_mb: Callable[[], float]
    ) -> tuple[list[str], list[list[float]]]: ...

    def report(self) -> dict[str, Any]: ...

    def teardown(self) -> None: ...


@runtime_checkable
class PlannedStrategy(Protocol):
    """What the planner (`src/planning/planner.py`) calls, touching no device."""

    name: str
    device_type: str
    processes_per_node: int

    def check_batch(self, micro_batch: int) -> None: ...

    def check_accumulate(self, accumulate: int) -> None: ...

    def check_model(self, model: nn.Module, inputs: Tree) -> None: ...

    def cost_model(self) -> CostModel | None: ...


class Strategy:
    """Defaults for a strategy that runs in one process; subclasses override what differs."""

    processes_per_node: int = 1
    rank: int = 0
    world_size: int = 1
    data_shard: int = 0
    data_shards: int = 1  # one process reads the whole batch (dp scatters it within)
    is_main: bool = True
    # One file that single loads; sharded (DCP) needs a plain, DDP or FSDP2 module (or one of
    # DTensors, as the mesh layouts' are).
    sharded_checkpoints: bool = False
    default_checkpoint_format: str = "full"
    spans_nodes: bool = False  # its processes may run on several nodes (parallel.nodes)
    settings_schema: type[ParallelConfig] = ParallelConfig  # what its `cfg` holds

    def __init__(
        self,
        cfg: ParallelConfig,
        device_type: str,
        precision: str = "fp32",
        ranks: Ranks | None = None,
    ):
        self.cfg = cfg
        self.device_type = device_type
        self.precision = precision  # trainer.precision, for strategies that keep parameters in it
        self.ranks = ranks  # the ranks torchrun, srun or `launch` started; None: this one alone
        if cfg.nodes > 1 and not self.spans_nodes:
            raise ConfigError(
                f"parallel={cfg.name} runs in one process, on one node; set parallel.nodes=1, or "
                "use ddp, fsdp or hybrid"
            )
        self.devices: list[torch.device] = []

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def job_devices(self) -> int:
        """Every device the job computes on: `parallel.devices` on each node, whether a process
        drives one of them (ddp, fsdp, the mesh layouts) or several (dp, model_parallel,
        hybrid)."""
        return self.cfg.devices * self.cfg.nodes

    def check_batch(self, micro_batch: int) -> None:
        """Raise ConfigError when a global micro-batch of this size cannot be split here."""
        if micro_batch < 1:
            raise ConfigError(
                f"the micro-batch (trainer.batch_size / trainer.accumulate) is {micro_batch}; "
                "raise trainer.batch_size"
            )

    def check_accumulate(self, accumulate: int) -> None:
        """Raise ConfigError when `trainer.accumulate` micro-steps per optimizer step cannot run
        this way."""

    def check_visible_gpus(self) -> None:
        """Raise ConfigError when too few GPUs are visible: all of `parallel.devices` to a job
        started here, one process's share to each of the `ranks` torchrun or srun started (under
        `srun --gpus-per-task`, a rank sees its own GPUs only)."""
        if self.device_type != "cuda":
            return
        visible = torch.cuda.device_count()
        per_process = self.cfg.devices // self.processes_per_node
        if self.ranks is None and self.cfg.devices > visible:
            raise ConfigError(
                f"parallel.devices={self.cfg.devices} but only {visible} GPU(s) are visible; "
                "lower parallel.devices"
            )
        if per_process > visible:
            raise ConfigError(
                f"each process of parallel={self.name} drives {per_process} GPU(s) but this one "
                f"sees {visible}; give each task {per_process} GPU(s) (srun --gpus-per-task)"
            )

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        """Raise ConfigError when `model` (built on the meta device: shapes, no memory) cannot be
        placed this way, e.g. more stages than blocks; `inputs` are meta tensors shaped like a
        batch, for a forward pass on the meta device."""

    def setup(self) -> None:
        self.devices = self.local_devices()

    def local_devices(self) -> list[torch.device]:
        """The devices this process drives: the first `parallel.devices` of its kind."""
        if self.device_type == "cuda":
            return [torch.device("cuda", i) for i in range(self.cfg.devices)]
        return [torch.device("cpu")] * self.cfg.devices

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """What this process's optimizer steps and the loop clips: every parameter."""
        return list(self.unwrap(model).parameters())

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        raise NotImplementedError

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def grad_scaler(self, enabled: bool, init_scale: float) -> torch.amp.GradScaler:
        """Every process holds whole gradients (replicas' are equal after their all-reduce), so
        each one finds the same inf/NaN and skips the same steps."""
        return torch.amp.GradScaler(self.device_type, init_scale=init_scale, enabled=enabled)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.unwrap(model).state_dict()

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    def sharded_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """`model` and `optimizer` keyed by parameter name, each process holding its own shards
        (a replica's tensors are whole; DCP writes them once), as this process saves them."""
        return self.as_saved(dcp_state_dict(model, optimizer))

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """What of `dcp_state_dict`'s `state` this process writes and reads, in the form DCP is
        to see it: all of it, as it is (a strategy whose tensors are not single's, in layout or
        in extent, says here how they lie in single's)."""
        return state

    def place_loaded(self, state: dict[str, Any], saved: dict[str, Any]) -> None:
        """After DCP has read a checkpoint into `saved` (`as_saved(state)`): copy into `state`
        what DCP read into tensors of their own rather than into views of `state`'s (nothing,
        here)."""

    def load_sharded(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        path: str,
        key: str = "optimizer",
    ) -> None:
        """Load a sharded checkpoint into the wrapped `model` and its `optimizer` (None: the
        model alone, to evaluate it): DCP reads each process's shards of the tensors it is given,
        however many processes wrote them. Another `key` reads the optimizer state saved under
        it (`ema`: the weight average's) into `optimizer`, and the model not again."""
        state = dcp_state_dict(model, optimizer)  # the shapes and shards to fill
        saved = self.as_saved(state)
        read_dcp(saved if key == "optimizer" else {key: saved["optimizer"]}, path)
        self.place_loaded(state, saved)
        set_dcp_state(model, optimizer, state, key)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def synchronize(self) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def peak_memory_mb(self, *cpu_mb: Callable[[], float]) -> tuple[list[str], list[list[float]]]:
        return self.local_peak_memory_mb(*cpu_mb)

    def local_peak_memory_mb(
        self, *cpu_mb: Callable[[], float]
    ) -> tuple[list[str], list[list[float]]]:
        """The labels, one per CUDA device (on CPU, one per process: replicas share its memory),
        and for each measure in `cpu_mb` its megabytes, one per label."""
        if self.device_type == "cuda":
            devices = sorted(set(self.devices), key=lambda d: d.index)
            peaks = [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices]
            return [str(d) for d in devices], [peaks for _ in cpu_mb]
        return [f"cpu:rank{self.rank}"], [[measure()] for measure in cpu_mb]

    def report(self) -> dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    def cost_model(self) -> CostModel | None:
        """None: the strategy runs, and the planner says in one line that it cannot plan it."""
        return None
