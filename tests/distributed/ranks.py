"""Run a function on T gloo ranks (processes) and collect what each returns."""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, path: str, fn, args, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except Exception:
        results[rank] = ("error", traceback.format_exc())
    if torch.cuda.is_initialized():
        # destroying NCCL communicators that CUDA graphs captured can block forever (seen
        # with NCCL 2.28 / torch 2.11 on 2 H100s); the result is stored, so just leave
        os._exit(0)
    dist.destroy_process_group()


def _context():
    """Where CUDA is available, "spawn" (as before: a fresh interpreter a rank). On a CPU
    machine, a fork server that imported torch and graphexec once: each rank (and the
    results' manager) is forked from it, not a new interpreter that imports torch again
    (2-4 s of CPU a process; the gloo tests start about 15 of them). The fork server
    never touches CUDA or starts a thread pool, and each rank still sets its own thread
    count and builds its own process group."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "graphexec", __name__])
    return ctx


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on `world` processes; their return values in rank order
    (an exception in any rank is re-raised here with its traceback)."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as d, ctx.Manager() as manager:
        results = manager.dict()
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store, fn, args, results))
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"a rank did not finish in {timeout} s")
        out = [results.get(r, ("error", "no result")) for r in range(world)]
    errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(out) if s != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [v for _, v in out]


class WithNccl:
    """`fn(rank, world, *args, group=g)` on rank's own GPU, `g` a new NCCL group of every
    rank (run_ranks' default group is gloo); pass it to run_ranks in place of fn."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, rank: int, world: int, *args):
        torch.cuda.set_device(rank)
        return self.fn(rank, world, *args, group=dist.new_group(backend="nccl"))
