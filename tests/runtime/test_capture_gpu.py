"""The capture routine on CUDA: a graph that becomes garbage while another records (in a
reference cycle, as a dropped executor's graphs are) neither breaks the capture nor
the next one."""

from __future__ import annotations

import gc

import pytest
import torch

from graphexec.runtime.capture import GraphCapture

pytestmark = pytest.mark.gpu


def test_a_collection_during_capture_cannot_destroy_an_earlier_graph() -> None:
    cap = GraphCapture(torch.device("cuda"))
    x = torch.zeros(4, device="cuda")
    box = {"graph": cap(lambda: x.add_(1))[0]}
    calls = []

    def fn():
        calls.append(1)
        x.mul_(2)
        if len(calls) == 2:  # recording: the earlier graph becomes cyclic garbage...
            cycle = [box.pop("graph")]
            cycle.append(cycle)
            del cycle
            _ = [[i] for i in range(5000)]  # ...and a collection falls due

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph, _ = cap(fn)
    finally:
        gc.set_threshold(*threshold)
    gc.collect()  # the earlier graph goes now, outside any capture
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [6.0] * 4
    again, _ = cap(lambda: x.sub_(1))  # the pool is still usable
    x.fill_(5)
    again.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [4.0] * 4
