"""The pipelined step on CUDA: overlap on = off, replayed and eager, with TableModel and
TinyLM (a real KV cache: a row that stopped runs once more into a slot that is freed and
reused meanwhile), and speculation; the step waits by its event, never a stream sync."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from tests.engine.test_overlap import V, make, masked, mixed, run

pytestmark = pytest.mark.gpu


def tiny():
    return gx.models.TinyLM(V, seed=0, max_seq_len=40)


@pytest.mark.parametrize("mode", [None, "eager"])
@pytest.mark.parametrize("model", [None, tiny])
def test_overlap_gives_the_synchronous_outputs_on_cuda(mode, model) -> None:
    def ex(overlap):
        return make(overlap, device="cuda", model=model() if model else None)

    assert run(ex(True), mixed(), mode) == run(ex(False), mixed(), mode)
    assert run(ex(True), masked(), mode) == run(ex(False), masked(), mode)


def test_speculative_overlap_on_cuda() -> None:
    def ex(overlap):
        return make(overlap, gx.SpeculativeConfig(3, drafter="ngram"), device="cuda",
                    model=tiny())  # fmt: skip

    assert run(ex(True), mixed()) == run(ex(False), mixed())


def test_the_pipelined_step_never_synchronizes_the_stream(monkeypatch) -> None:
    ex = make(True, device="cuda", model=tiny())
    for i in range(8):
        ex.add_request(f"r{i}", [i + 1], gx.SamplingParams(seed=i, max_tokens=40,
                                                           ignore_eos=True))  # fmt: skip
    for _ in range(4):
        ex.step()
    calls = []
    for target in (torch.cuda.Stream, torch.cuda.streams.Stream):
        monkeypatch.setattr(target, "synchronize", lambda self: calls.append(self))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
    outs = [len(ex.step()) for _ in range(10)]
    assert calls == [] and outs == [8] * 10
