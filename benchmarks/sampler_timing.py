"""How the sampler and verify benchmarks time one call (`Timer`), shared by every method.

CUDA: the median over reps of CUDA-event time per call. Before every call, with
evict_icache, a code-heavy kernel runs on every SM (`icache_evict.py`), so the call starts
with cold instruction caches, as after a model forward; then the L2 is flushed by
*reading* a 256 MiB buffer (more than any L2 holds) and writing 16 KB: the timed call
starts with none of its inputs in L2 and no dirty lines there to write back (the previous
call's outputs and the eviction kernel's scratch are written back during the flush). Runs
made before this change wrote the 256 MiB instead, so every timed call first paid the
write-back of the dirty lines its reads evicted. CPU: perf_counter, no flush.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

FLUSH_BYTES = 256 << 20
FLUSH_DESCRIPTION = "a 256 MiB L2 flush by reading (no dirty lines left) before each call"


class Timer:
    """Median times per call; on CUDA, before each call, with evict_icache the SMs'
    instruction caches are evicted (`icache_evict`), then the L2 is flushed by reading
    FLUSH_BYTES (`flush_l2`: no dirty lines left for the timed call to write back)."""

    def __init__(self, device: torch.device, quick: bool, evict_icache: bool = False,
                 flush: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.budget_s, self.min_reps, self.max_reps = (0.03, 3, 20) if quick else (0.15, 10, 200)
        self.flush = None
        self.evict = None
        if self.cuda and flush:
            # read as [rows, cols] fp32, each row's max into a small sink: one kernel that
            # reads every byte and writes 16 KB (which the next flush evicts again)
            self.flush = torch.ones(4096, FLUSH_BYTES // (4 * 4096), device=device)
            self.flush_sink = torch.empty(4096, device=device)
            self.flush_l2()
            if evict_icache:
                from icache_evict import ICacheEvictor

                self.evict = ICacheEvictor(device)

    def flush_l2(self) -> None:
        """Evict the L2 by reading FLUSH_BYTES: afterwards it holds clean lines only."""
        torch.amax(self.flush, dim=1, out=self.flush_sink)

    def prepare(self) -> None:
        """What runs before each timed call (CUDA): the instruction-cache eviction, if on,
        then the L2 flush."""
        if self.evict is not None:
            self.evict()
        if self.flush is not None:
            self.flush_l2()  # after the eviction kernel: its few written lines go back too

    def _reps(self, est_us: float) -> int:
        n = int(self.budget_s * 1e6 / max(est_us + (80.0 if self.cuda else 0.0), 1.0))
        return max(self.min_reps, min(self.max_reps, n))

    def _cuda_median(self, fn: Callable, reps: int, sync_each: bool) -> float:
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        torch.cuda.synchronize(self.device)
        for start, end in ev:
            self.prepare()
            if sync_each:
                torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)

    def time(self, fn: Callable, sync_each: bool) -> float:
        """Median microseconds per call of fn (already warmed up)."""
        if self.cuda:
            est = self._cuda_median(fn, 3, sync_each)
            return self._cuda_median(fn, self._reps(est), sync_each)
        t0 = time.perf_counter()
        fn()
        times = []
        for _ in range(self._reps((time.perf_counter() - t0) * 1e6)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def capture(self, fn: Callable) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = fn()
        graph.replay()
        torch.cuda.synchronize(self.device)
        return graph, result


def check_tokens(tok: torch.Tensor, V: int) -> str | None:
    tok = tok.reshape(-1)
    lo, hi = int(tok.min()), int(tok.max())
    return None if 0 <= lo and hi < V else f"sampled ids outside [0, {V}): min {lo}, max {hi}"


def error_text(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg if len(msg) <= 600 else msg[:600] + " ..."
