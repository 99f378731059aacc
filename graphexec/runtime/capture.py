"""The one capture routine: warm a callable up on a side stream, then capture it into a
CUDA graph of a shared memory pool. The decode graphs (`engine.graphs.CapturedGraphs`)
and a model's prefill graphs (`models.prefill_graphs.PrefillGraphs`) both use it. Inside a
capture, `run_if` puts work that a replay may skip into a conditional node."""

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


def run_if(pred: torch.Tensor, body: Callable[[], Any], wanted: bool = True) -> None:
    """Call `body` (it launches work on the current stream). While a CUDA graph captures
    (and `wanted`), its work goes into a conditional node on `pred` (a bool [1] CUDA
    tensor, read when a replay reaches that point): a replay runs it only where pred is
    true. Elsewhere (eager, CPU, a torch or CUDA without conditional nodes) it always runs.
    Only for work that changes nothing where pred is false: no result may depend on the
    skip."""
    graph = _capturing_graph() if wanted else None
    if graph is None:
        body()
        return
    graph.begin_capture_to_if_node(pred)
    try:
        body()
    finally:
        graph.end_capture_to_conditional_node()


def _capturing_graph() -> torch.cuda.CUDAGraph | None:
    """The graph the current stream captures, where conditional nodes can go into it."""
    if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        return None
    get = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    if get is None or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return None
    return get()
