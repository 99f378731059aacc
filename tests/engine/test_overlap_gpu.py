"""The pipelined step on CUDA: overlap on = off, replayed and eager, with TableModel and
TinyLM (a real KV cache: a row that stopped runs once more into a slot that is freed and
reused meanwhile), and speculation; the step waits by its event, never a stream sync."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from tests.engine.test_overlap import V, drafted_masks, make, masked, mixed, run

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


def test_a_blocking_wait_gives_the_spinning_waits_outputs() -> None:
    def ex(wait):
        return make(True, device="cuda", model=tiny(), blocking_wait=wait)

    assert run(ex(True), mixed()) == run(ex(False), mixed())


@pytest.mark.parametrize("mode", [None, "eager"])
def test_speculative_overlap_on_cuda(mode) -> None:
    """Plain rows, and mask rows whose n-gram steps split (replayed: the forward and draw
    graphs of `CapturedGraphs.capture_parts`): overlap on = off."""

    def ex(overlap):
        return make(overlap, gx.SpeculativeConfig(3, drafter="ngram"), device="cuda",
                    model=tiny())  # fmt: skip

    assert run(ex(True), mixed(), mode) == run(ex(False), mixed(), mode)
    piped = ex(True)
    assert run(piped, drafted_masks(), mode) == run(ex(False), drafted_masks(), mode)
    assert piped.runner.split_steps > 0 and piped.drafter.drafted > 0


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


def test_split_steps_draw_the_whole_steps_bits_on_a_padded_vocabulary() -> None:
    """Grammar rows make a pipelined step launch as forward, then draw (the split step);
    with a model wider than the tokenizer's vocabulary (100,352 columns, cl100k's 100,277
    ids) its logprobs equal the whole step's bit for bit. The draw must see the logits
    with the model's row stride: Triton specialises strides by alignment, and a sampler
    kernel compiled for an unaligned stride summed rows in another order (last-bit
    logprobs on an H200)."""
    tok = gx.Tokenizer.cl100k()

    def ex(overlap):
        e = gx.DecodeExecutor(gx.models.TinyLM(100_352, seed=0, max_seq_len=64),
                              max_batch_size=8, device="cuda", seed=0, tokenizer=tok,
                              overlap=overlap)  # fmt: skip
        e.capture(progress=False)
        return e

    P = gx.SamplingParams
    gram = gx.Grammar.regex("[a-z ]{4,40}")
    params = [P(seed=i, logprobs=5, max_tokens=24, ignore_eos=True, temperature=0.9)
              for i in range(4)] + [P(seed=9, grammar=gram, max_tokens=24, logprobs=2)]  # fmt: skip

    def outs(e):
        for i, p in enumerate(params):
            e.add_request(f"r{i}", tok.encode(f"prompt {i}:"), p)
        got = {}
        while not e.idle:
            for o in e.step():
                got.setdefault(o.request_id, []).append((o.token_id, o.logprob, o.top_logprobs))
        return got, e.runner.split_steps

    piped, splits = outs(ex(True))
    sync, none = outs(ex(False))
    assert splits > 0 and none == 0  # the pipelined run took the split path
    assert piped == sync
