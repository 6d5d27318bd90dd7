"""Every place where the template relies on torch or Python beyond their published APIs, each
behind one function with a plain fallback, so that an upgrade that changes them costs speed, not
correctness. `tests/test_torch_internals.py` fails when what they rely on changes.

- `exit_without_teardown`: a finished command ends with `os._exit` after the exit handlers.
- `rank_server_pid`: the forkserver's pid, from multiprocessing's private attribute.
- `forkserver_forked_from_this_process`: multiprocessing's forkserver forked from this process
  instead of started as a new interpreter, through `util.spawnv_passfds`.
- `name_rendezvous_events_cheaply`: swaps torch's stack-walking `get_method_name` in
  `dynamic_rendezvous` for a `sys._getframe` lookup giving the same names.
- `pipeline_warmup_skips_own_rank`: leaves out of a pipeline stage's link warm-up the sends and
  receives between two stages of one rank (the V schedules' middle), which gloo cannot run.

Some uses have no plain fallback and live where they are used. The evaluation of the V pipeline
schedules (`src/parallel/pp/schedules.py`, `skip_backward`) registers torch's custom-action
hook with its private action types; the V schedules' equivalence tests in `tests/test_mesh.py`
fail if that changes. ep's experts (`src/parallel/ep/apply.py`, `local_parameters`) swap
their DTensor parameters for the local tensors in `nn.Module._parameters` while they compute, as
`torch.func.functional_call` swaps parameters; the ep equivalence tests in `tests/test_ep.py`
fail if that changes. Tensor memory, planned and measured, subclasses torch's `MemTracker` and
overrides its private members: the planner's trace (`src/planning/memory_trace.py`) its
`_update_peak_stats` and `_pre_fw_hook` and reads `_mod_tracker`, the runs' `StorageTracker`
(`src/observe/tensor_memory.py`) its `_track`, `_update_and_maybe_create_winfos`, `_update_snap`,
`_update_peak_stats` and `_mod_tracker`; `tests/test_plan.py`'s peaks, planned and measured, and
`tests/test_tensor_memory.py` fail if those change. dp's replica threads run under the caller's
dispatch modes (`src/parallel/replicas/apply.py`, torch's private `_push_mode`);
`tests/test_dp.py`'s threads test fails if that changes. optimizer=muon
(`src/components/muon.py`) repeats torch.optim.Muon's per-matrix step around a gather, calling
torch's private `_zeropower_via_newtonschulz` and `_adjust_lr` (torch.optim._muon);
`tests/test_muon.py`'s comparison with torch.optim.Muon fails if they change.

Ending a finished process without the interpreter's teardown of its modules: a training process
has imported torch, torch._dynamo (every `torch.optim` optimizer does),
sympy, Hydra and W&B. When it exits, Python frees all of their modules object by object, which
can take longer than a short run's training (measured in docs/performance.md). A sweep of short
jobs, and every test, pays it per process.

By then nothing the process owes anyone is left in that teardown: Python has already waited for
its non-daemon threads and run the exit handlers (W&B's, multiprocessing's, ...) when the last
of them, registered first by `exit_without_teardown`, flushes the logs and standard streams and
ends the process with its exit status. Processes forked by multiprocessing (the ranks, loader
workers) end this way already. An exit the process did not reach on its own terms (an uncaught
exception, a message given to `sys.exit`) keeps Python's usual path and report.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import sys
from collections.abc import Iterator

_exit_status: list[int] = []  # set once the block has ended with an exit status of its own


def _end_at_once() -> None:
    if not _exit_status:
        return
    logging.shutdown()  # its own exit handler may be one that runs after this one
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(_exit_status[0])


@contextlib.contextmanager
def exit_without_teardown() -> Iterator[None]:
    """Around a command's whole run: once it returns or calls `sys.exit(code)`, the process ends
    after the exit handlers, skipping the teardown of its modules."""
    atexit.register(_end_at_once)  # exit handlers run last-registered first: this one last
    try:
        yield
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            _exit_status.append(exit.code or 0)
        raise
    _exit_status.append(0)


def rank_server_pid() -> int | None:
    """The running forkserver's pid: Python keeps it in a private attribute (checked on the
    interpreter the project tests, `tests/test_torch_internals.py`). None if a Python stores it
    elsewhere: then a rank started after its server died is not caught at once
    (`end_with_launcher`)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)  # noqa: SLF001


FORKSERVER_PROGRAM = "from multiprocessing.forkserver import main"


@contextlib.contextmanager
def forkserver_forked_from_this_process() -> Iterator[None]:
    """Within it, multiprocessing's forkserver, which it starts as a new interpreter running a
    `-c` program, is a fork of this process running that program: a server whose imports this
    process has done already starts in a moment. For a process with one thread only (a fork keeps
    no others). multiprocessing starts it through `util.spawnv_passfds` (and its resource
    tracker, left as it is); a Python that does otherwise starts a new interpreter, as without."""
    from multiprocessing import util

    spawn = util.spawnv_passfds

    def fork_or_spawn(path: str, args: list[str], passfds: list[int]) -> int:
        if args[-1].startswith(FORKSERVER_PROGRAM):
            return _fork_running_program(args[-1], passfds)
        return spawn(path, args, passfds)

    util.spawnv_passfds = fork_or_spawn
    try:
        yield
    finally:
        util.spawnv_passfds = spawn


def _fork_running_program(program: str, passfds: list[int]) -> int:
    """`util.spawnv_passfds(path, [..., "-c", program], passfds)` as a fork (Linux): the child
    holds only the standard streams and `passfds`, as the new interpreter would, and ends when
    the program does, without this process's exit handlers. Every other file it inherited is
    swapped for /dev/null rather than closed: Python objects of this process still hold those
    numbers, and would otherwise close or write whatever file reuses one."""
    for stream in (sys.stdout, sys.stderr):  # or the server's ranks would write it again
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in {0, 1, 2, devnull, *passfds}:
                os.dup2(devnull, fd)
        os.close(devnull)
        exec(program, {"__name__": "__main__"})  # noqa: S102 - multiprocessing's own program
        status = 0
    except SystemExit as end:  # how the forkserver ends, once every client has gone
        status = end.code if isinstance(end.code, int) else 0
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then exit
        import traceback

        traceback.print_exc()
    finally:
        os._exit(status)


def name_rendezvous_events_cheaply() -> None:
    """torch's c10d rendezvous names each event it records after the method that recorded it,
    found with `inspect.stack()`, twice an event: that reads the source file of every frame on the
    stack, a large part of each multi-process launch on a few CPU cores
    (`scripts/benchmark.py --only startup` measures it). The name is that of the frame `depth` calls
    up, which `sys._getframe` gives without reading anything: the same names, at once."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torchs = getattr(dynamic_rendezvous, "get_method_name", None)
    torchs = getattr(torchs, "__wrapped__", torchs)  # named cheaply already
    if torchs is None or list(inspect.signature(torchs).parameters) != ["depth"]:
        return  # torch names its events otherwise now: leave it to it

    @functools.wraps(torchs)  # keeps torch's as __wrapped__
    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # noqa: SLF001 - inspect.stack's frames
        except ValueError:  # the stack is not that deep
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def pipeline_warmup_skips_own_rank() -> None:
    """Before a schedule's first step, each pipeline stage sends and receives one number to and
    from its neighbour stages, to set up the links. torch 2.11 to 2.14 do so also where the
    neighbour is on the same rank, as the two middle stages of a V schedule (ZBVZeroBubble,
    DualPipeV) are: gloo has no link to its own rank and fails ("Pair is not connected"); NCCL's
    does nothing of use. Those operations are left out: the stages of one rank hand their
    tensors over in memory anyway. torch 2.15 has no such warm-up (nor the method), and this
    steps aside."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    torchs = getattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops", None)
    torchs = getattr(torchs, "__wrapped__", torchs)  # left out already
    if torchs is None:
        return  # torch sets the links up otherwise now: leave it to it

    @functools.wraps(torchs)  # keeps torch's as __wrapped__
    def neighbour_ops(stage: _PipelineStageBase) -> list:
        return [op for op in torchs(stage) if op.group_peer != stage.group_rank]

    _PipelineStageBase._get_init_p2p_neighbors_ops = neighbour_ops
