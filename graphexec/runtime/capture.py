"""The one capture routine: warm a callable up on a side stream, then capture it into a
CUDA graph of a shared memory pool. The decode graphs (`engine.graphs.CapturedGraphs`)
and a model's prefill graphs (`models.prefill_graphs.PrefillGraphs`) both use it."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch


class GraphCapture:
    """Captures callables into one pool, each warmed up first on one side stream.

    The warm-up runs Triton's JIT and grows the allocator outside the capture. One side
    stream serves every capture: cached blocks belong to a stream, so a new stream per
    capture would leave each warm-up's memory stranded.

    Python's cyclic garbage collector is off while a graph records: a collection could
    free an earlier executor's graph, and destroying a graph is not allowed while a stream
    captures (the capture is invalidated). Captures run in thread-local mode, so CUDA calls
    of the embedding engine's other threads do not invalidate them either. A failed capture
    leaves its pool behind; the next capture starts a fresh one.

    debug: keep each graph's cudaGraph_t (for `CUDAGraph.debug_dump`); instantiated here.
    """

    def __init__(self, device: torch.device, debug: bool = False) -> None:
        self.device = device
        self.debug = debug
        self.pool = None
        self.side = torch.cuda.Stream(device)

    def __call__(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """(graph, what fn returned during the capture: static outputs)."""
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            fn()
        main.wait_stream(self.side)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.debug else torch.cuda.CUDAGraph()
        if self.debug:
            graph.enable_debug_mode()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(main):  # the caller's stream again, even after a failure
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = fn()
        except BaseException:
            self.pool = None
            raise
        finally:
            if collecting:
                gc.enable()
        if self.debug:
            graph.instantiate()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out
