"""What the template relies on inside torch and Python beyond their published APIs, checked on the
versions it runs on: each test fails if the private thing moved or changed, and the template's
plain fallback when it is missing is tested beside it."""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.torch_version import TorchVersion

from src.runtime.forking import RANKS_IMPORT, end_with_launcher, start_rank_server
from src.runtime.torch_private import name_rendezvous_events_cheaply, pipeline_warmup_skips_own_rank


def parent_pid(queue: multiprocessing.Queue) -> None:
    queue.put(os.getppid())


def parent_and_missing_imports(queue: multiprocessing.Queue) -> None:
    """A rank's parent, and what of `RANKS_IMPORT` it would still import itself."""
    queue.put((os.getppid(), [name for name in RANKS_IMPORT if name not in sys.modules]))


def test_the_rank_server_pid_is_the_parent_of_what_it_forks():
    """`start_rank_server` reads the forkserver's pid from multiprocessing's private attribute:
    it must be the parent of the processes a forkserver context starts (the ranks)."""
    pid = start_rank_server()
    assert isinstance(pid, int)
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    child = context.Process(target=parent_pid, args=(queue,))
    child.start()
    assert queue.get(timeout=60) == pid
    child.join()


def test_without_the_forkservers_pid_ranks_still_end_with_their_server(monkeypatch):
    """Where Python keeps the pid elsewhere, the server starts as before and a rank skips only
    the check for a server that died before it asked to die with it."""
    from multiprocessing import forkserver

    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(forkserver, "_forkserver", object())
    assert start_rank_server() is None
    end_with_launcher(None)  # returns: this process's parent is no rank server


def torchs_namer():
    """torch's own `get_method_name`, also once `launch` has swapped it for the cheap one."""
    namer = dynamic_rendezvous.get_method_name
    return getattr(namer, "__wrapped__", namer)


def test_torch_names_rendezvous_events_with_the_function_launch_replaces():
    torchs = torchs_namer()
    assert torchs.__module__ == dynamic_rendezvous.__name__
    assert list(inspect.signature(torchs).parameters) == ["depth"]
    assert inspect.signature(torchs).parameters["depth"].default == 2
    # torch looks it up in its module at each event, so the module's attribute is what counts.
    assert inspect.getsource(dynamic_rendezvous).count("{get_method_name()}") >= 3


def test_rendezvous_events_keep_the_names_torchs_stack_walk_gives_them(monkeypatch):
    """The cheap namer (`name_rendezvous_events_cheaply`) gives torch's names from every depth,
    the stack's deepest frame and beyond included."""
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs_namer())  # restored after
    name_rendezvous_events_cheaply()
    cheap, torchs = dynamic_rendezvous.get_method_name, torchs_namer()
    assert cheap is not torchs

    def record(depth: int) -> tuple[str, str]:
        return cheap(depth), torchs(depth)

    def next_rendezvous(depth: int) -> tuple[str, str]:
        return record(depth)

    deepest = len(inspect.stack()) + 2  # from the namer: record, next_rendezvous, here
    names = []
    for depth in (1, 2, 3, deepest, deepest + 1):  # a comprehension would be a frame more
        names.append(next_rendezvous(depth))
    assert [cheap for cheap, _ in names] == [walked for _, walked in names]
    assert [cheap for cheap, _ in names][:2] == ["record", "next_rendezvous"]
    assert names[-1][0] == "no_method_name" != names[-2][0]
    name_rendezvous_events_cheaply()  # again: still one cheap namer around torch's
    assert torchs_namer() is torchs


@pytest.mark.parametrize("changed", ["missing", "other signature"])
def test_a_changed_rendezvous_namer_is_left_to_torch(monkeypatch, changed):
    if changed == "missing":
        monkeypatch.delattr(dynamic_rendezvous, "get_method_name")
    else:
        monkeypatch.setattr(dynamic_rendezvous, "get_method_name", lambda frame=None: "own")
    before = getattr(dynamic_rendezvous, "get_method_name", None)
    name_rendezvous_events_cheaply()
    assert getattr(dynamic_rendezvous, "get_method_name", None) is before


def test_torch_warms_up_pipeline_links_before_2_15_only():
    """Which torch needs `pipeline_warmup_skips_own_rank`: 2.11 to 2.14 warm up each stage's
    links in `_get_init_p2p_neighbors_ops`; 2.15 removed it (the V schedules train there
    without the workaround, which steps aside)."""
    before_2_15 = TorchVersion(torch.__version__) < (2, 15)
    assert hasattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops") == before_2_15


def test_a_pipeline_stage_warms_up_no_link_to_its_own_rank(monkeypatch):
    """The V schedules' two middle stages are on one rank: torch 2.11 to 2.14 warm up a link
    between them too, which gloo cannot; `pipeline_warmup_skips_own_rank` leaves those
    operations out and keeps the others (the V schedules' tests in tests/test_mesh.py run it on
    gloo). On a torch without the warm-up, it is tested on one put there."""
    ops = [SimpleNamespace(group_peer=peer) for peer in (0, 1, 1, 0)]
    monkeypatch.setattr(
        _PipelineStageBase, "_get_init_p2p_neighbors_ops", lambda stage: ops, raising=False
    )
    pipeline_warmup_skips_own_rank()
    pipeline_warmup_skips_own_rank()  # again: still once around torch's
    stage = SimpleNamespace(group_rank=1)
    assert _PipelineStageBase._get_init_p2p_neighbors_ops(stage) == [ops[0], ops[3]]


def test_a_pipeline_stage_without_the_warmup_is_left_to_torch(monkeypatch):
    monkeypatch.delattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops", raising=False)
    pipeline_warmup_skips_own_rank()
    assert not hasattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops")


# A process that ends as train.py does (`exit_without_teardown`, entered before torch is
# imported), with the torch modules a training process imports, a compiled function and
# DataLoader workers. A handler registered before torch's runs after them: it reports whether
# torch's exit work had been done by then, just before the process ends without its teardown.
ENDING = """
import atexit, os, sys
registered = []
register = atexit.register
atexit.register = lambda f, *a, **k: (registered.append(f"{f.__module__}.{f.__qualname__}"),
                                      register(f, *a, **k))[1]
from src.runtime.torch_private import exit_without_teardown

def report():
    print("registered", *registered)
    print("loader exit flag", loader_utils.python_exit_status)
    print("compile pool shut down", async_compile._pool_set == set())

with exit_without_teardown():
    atexit.register(report)
    import torch, torch._dynamo, torch.distributed, torch.utils.data
    import torch.utils.data._utils as loader_utils
    from torch._inductor import async_compile
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    for _ in torch.utils.data.DataLoader(range(4), num_workers=1):
        pass
"""
# What torch 2.14.1 registers to run at exit in that process: `exit_without_teardown` relies on
# torch doing its exit work there, before the process ends without its modules' teardown. A new
# or renamed one means torch changed: read what it does at exit before updating this list.
TORCHS_EXIT_HANDLERS = {
    "torch.utils.data._utils._set_python_exit_flag",
    "torch._subclasses.fake_tensor.dump_cache_stats",
    "torch._dynamo.utils.dump_compile_times",
    "torch._dynamo.eval_frame._log_traced_frames",
    "torch._inductor.remote_cache.dump_cache_stats",
    "torch._inductor.compile_worker.tracked_process_pool._queue_stats_report",
    "torch._inductor.async_compile.shutdown_compile_workers",
}


def test_torch_does_its_exit_work_in_exit_handlers_that_run_before_the_early_exit():
    ended = subprocess.run(
        [sys.executable, "-c", ENDING], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert ended.returncode == 0, ended.stderr
    registered, *done = ended.stdout.splitlines()
    assert {name for name in registered.split() if name.startswith("torch.")} == (
        TORCHS_EXIT_HANDLERS
    )
    assert done == ["loader exit flag True", "compile pool shut down True"]


# A process that starts its rank server and reports: whether the server runs this process's
# program (a fork) or multiprocessing's forkserver program (a new interpreter), the parent a rank
# it forks sees, and which of the server's open files were this process's.
SERVER_START = """
import json, multiprocessing, os, sys
{imports}
from src.runtime.forking import start_rank_server
from test_torch_internals import parent_and_missing_imports

def files(pid):  # beyond the standard streams, and /dev/null
    names = set()
    for fd in os.listdir(f"/proc/{{pid}}/fd"):
        try:
            names.add(os.readlink(f"/proc/{{pid}}/fd/{{fd}}") if int(fd) > 2 else os.devnull)
        except FileNotFoundError:  # listdir's own
            pass
    return names - {{os.devnull}}

mine = files(os.getpid())
server = start_rank_server()
context = multiprocessing.get_context("forkserver")
queue = context.Queue()
rank = context.Process(target=parent_and_missing_imports, args=(queue,))
rank.start()
rank_parent, rank_missing = queue.get(timeout=60)
rank.join()
inherited = files(server) & mine
with open(f"/proc/{{server}}/cmdline", "rb") as cmdline:
    program = cmdline.read().split(b"\\0")[-2].decode()
print(json.dumps([server, rank_parent, rank_missing, program, sorted(inherited)]))
"""


@pytest.mark.parametrize(
    ("imports", "forked"), [("import torch._dynamo, src.launch.job", True), ("", False)]
)
def test_a_process_with_the_rank_servers_imports_forks_it_else_starts_a_new_one(imports, forked):
    """A process with one thread that has imported what the rank server imports (a test's
    preloaded train.py run: OMP_NUM_THREADS=1 keeps torch from starting a thread on import) forks
    the server from itself; any other starts a new interpreter.
    Either way the ranks are the server's children, which it forks with the strategies' modules
    imported (`RANKS_IMPORT`), and a forked server holds none of the files it inherited but the
    standard streams (a pipe end kept would hold up its end)."""
    started = subprocess.run(
        [sys.executable, "-c", SERVER_START.format(imports=imports)],
        cwd=ROOT,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            # Kept: the requirements may come from a folder on it (scripts/gpu_check.sh).
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])
            ),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    server, rank_parent, rank_missing, program, inherited = json.loads(started.stdout)
    assert rank_parent == server and rank_missing == []
    assert program.startswith("from multiprocessing.forkserver import main") != forked, program
    assert inherited == []
