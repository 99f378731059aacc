"""A seeded request's tokens and logprobs are the same bits whatever runs beside it, on the
CPU route of real models (HFTransformer, TinyLM): alone, in a batch, in waves, in another
admission order, replayed and eager, with and without speculation (n-gram and a draft
model, strict), with any prefill budget.

A 512-token vocabulary keeps the torch sampler (most of a CPU step) cheap, so there are
no grammars here (they need the cl100k tokenizer); tests/models/test_hf_gpu.py runs the same
checks with grammars at the Qwen2.5-0.5B shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphexec as gx
from graphexec.app import workload as wl
from graphexec.models.hf_random import random_state_dict

V = 512
# Qwen2: q/k/v biases, grouped-query attention, tied embeddings
QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=V, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
            initializer_range=0.2)  # fmt: skip
DRAFT = dict(QWEN, hidden_size=32, intermediate_size=64)  # a two-layer draft, same vocab


def hf(cfg: dict, seed: int, **kw) -> gx.models.HFTransformer:
    state = random_state_dict(cfg, seed=seed, dtype=torch.float32)
    return gx.models.HFTransformer(cfg, state, dtype=torch.float32, max_seq_len=384, **kw)


MODELS = {
    "hf": (lambda **kw: hf(QWEN, 0, **kw), lambda: hf(DRAFT, 1)),
    "tiny": (lambda **kw: gx.models.TinyLM(V, seed=0, dim=64, max_seq_len=384, **kw),
             lambda: gx.models.TinyLM(V, seed=1, dim=32, max_seq_len=384)),
}  # fmt: skip


def factory(model):
    def make(**options) -> gx.DecodeExecutor:
        ex = gx.DecodeExecutor(model(), max_batch_size=16, device="cpu", seed=0,
                               buckets=(2, 8, 16), **options)  # fmt: skip
        ex.capture(progress=False)
        return ex

    return make


def workload(n: int = 10) -> list[wl.WorkItem]:
    """The mixed kinds (greedy, top-k/top-p, top-p, min-p, penalties, bias, logprobs,
    unseeded; n = 10 holds each of the 7 kinds and two unseeded requests, and with the
    loops fills the largest bucket), prompts of 1..140 tokens (chunked by a 64-token
    budget), and repetitive prompts so the n-gram drafter proposes."""
    items = wl.mixed_workload(n, V, seed=3, max_tokens=(6, 14), prompt_tokens=(1, 140))
    loops = [wl.WorkItem(f"loop{i}", tuple([7, 8, 9, 10, 11] * (4 + i)),
                         gx.SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=50 + i,
                                           max_tokens=10, logprobs=2), 0, "loop")
             for i in range(3)]  # fmt: skip
    return items + loops


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_arrangement_gives_the_same_streams(kind, one_thread) -> None:
    model, draft = MODELS[kind]
    specs = {"ngram": gx.SpeculativeConfig(3, drafter="ngram"),
             "draft model": gx.SpeculativeConfig(3, drafter=draft())}  # fmt: skip
    report = wl.batch_invariance(factory(model), workload(), specs, budgets=(64, 256))
    assert set(report) >= {"alone", "waves", "reversed", "eager", "speculative ngram",
                           "speculative draft model", "prefill budget 64"}  # fmt: skip
    assert {name: bad[:3] for name, bad in report.items() if bad} == {}


def test_speculation_verifies_drafts_in_one_forward(one_thread, monkeypatch) -> None:
    """With speculation the n-gram drafter proposes, and each verify is one forward over
    its B x (K + 1) token rows, not K + 1 decodes."""
    model, _ = MODELS["hf"]
    ex = factory(model)(speculative=gx.SpeculativeConfig(3, drafter="ngram"))
    m = ex.model
    forward, verify = m._forward, m.verify
    calls: list[tuple[tuple[int, int], list[int]]] = []

    def counted_forward(ids, *a, **kw):
        if calls:
            calls[-1][1].append(ids.shape[0])
        return forward(ids, *a, **kw)

    def counted_verify(ids, positions, slots):
        calls.append((tuple(ids.shape), []))
        out = verify(ids, positions, slots)
        calls.append(((0, 0), []))  # forwards after this one (prefill) are not its
        return out

    monkeypatch.setattr(m, "_forward", counted_forward)
    monkeypatch.setattr(m, "verify", counted_verify)
    monkeypatch.setattr(m, "decode", lambda *a: pytest.fail("decode called"))
    items = [dataclasses.replace(it, arrive=0) for it in workload()[-3:]]
    wl.run(ex, items)
    assert ex.stats.drafted > 0
    verifies = [(shape, rows) for shape, rows in calls if shape != (0, 0)]
    assert verifies and all(rows == [shape[0] * shape[1]] for shape, rows in verifies)
    assert any(shape[1] == 4 for shape, _ in verifies)


def test_the_non_invariant_route_replays_but_differs_across_batches(one_thread) -> None:
    """batch_invariant=False (torch's GEMM, K + 1 decodes to verify): replay still equals
    eager and speculation still emits the stream of its batch, but the same check finds
    streams that change with the batch: what the invariant route is for (and proof the
    check above can fail)."""
    assert hf(QWEN, 0).batch_invariant
    make = factory(lambda **kw: hf(QWEN, 0, batch_invariant=False, **kw))
    assert make().model.ops.linear is torch.nn.functional.linear
    report = wl.batch_invariance(make, workload(), {"ngram": gx.SpeculativeConfig(3, "ngram")},
                                 budgets=(64,))  # fmt: skip
    assert report["eager"] == [] and report["speculative ngram"] == []
    assert report["alone"] or report["waves"] or report["prefill budget 64"]
