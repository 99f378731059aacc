"""Admission at server rate: add_request is bookkeeping, prompts are prefilled in the step
(one ragged batch, chunked to the budget), first tokens come from the step's sampler,
and none of it changes a request's tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import graphexec as gx
import graphexec.app.workload as wl
from tests.engine.scripted import drain, tokens

P = gx.SamplingParams
V = 300


class Recording(gx.models.TableModel):
    """Records every model call: (method, token count or batch rows, segment lengths)."""

    def __init__(self, vocab_size: int = V, **kw) -> None:
        super().__init__(vocab_size, seed=0, **kw)
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []

    def prefill(self, slot, token_ids, all_logits=False):
        self.calls.append(("prefill", token_ids.numel(), ()))
        return super().prefill(slot, token_ids, all_logits)

    def prefill_batch(self, batch):
        self.calls.append(("prefill_batch", int(batch.token_ids.numel()), batch.lengths))
        return super().prefill_batch(batch)

    def decode(self, input_ids, positions, slot_ids):
        self.calls.append(("decode", input_ids.shape[0], ()))
        return super().decode(input_ids, positions, slot_ids)


def executor(model=None, **kw) -> gx.DecodeExecutor:
    ex = gx.DecodeExecutor(model or gx.models.TableModel(V, seed=0), max_batch_size=8,
                           device="cpu", buckets=(1, 2, 4, 8), **kw)  # fmt: skip
    ex.capture(progress=False)
    return ex


def requests(n: int, seed: int = 0) -> list[tuple[str, list[int], gx.SamplingParams]]:
    rng = random.Random(seed)
    kinds = [P(temperature=0.0), P(temperature=0.9, top_k=20), P(top_p=0.8, logprobs=2),
             P(min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5)]  # fmt: skip
    out = []
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        p = dataclasses.replace(kinds[i % len(kinds)], seed=i, max_tokens=rng.randint(1, 12))
        out.append((f"r{i}", prompt, p))
    return out


def test_add_request_does_no_model_or_device_work() -> None:
    model = Recording()
    ex = executor(model)
    model.calls.clear()
    ex.add_request("a", list(range(1, 20)), P(seed=1, max_tokens=3))
    ex.add_request("b", [5], P(seed=2, max_tokens=3, n=2))
    assert model.calls == [] and not ex.slots._staged and ex.num_running == 0
    assert ex.free_slots == 5  # the slots are promised already
    ex.step()
    assert [c[0] for c in model.calls] == ["prefill_batch", "decode"]
    assert model.calls[0][2] == (18,)  # one batch: "a" minus its last token; "b" needs none


def test_tokens_equal_alone_together_and_while_others_run() -> None:
    reqs = requests(12)
    alone = {}
    for rid, prompt, p in reqs:
        ex = executor()
        ex.add_request(rid, prompt, p)
        alone[rid] = drain(ex)[rid]
    ex = executor()
    for rid, prompt, p in reqs[:8]:  # all admitted before one step
        ex.add_request(rid, prompt, p)
    together = drain(ex)
    items = [wl.WorkItem(rid, tuple(prompt), p, i // 2, "") for i, (rid, prompt, p) in
             enumerate(reqs)]  # fmt: skip
    staggered = wl.run(executor(prefill_budget=7), items).outputs  # arrivals while others run
    for rid, _, _ in reqs:
        want = [(o.token_id, o.logprob) for o in alone[rid]]
        assert [(o.token_id, o.logprob) for o in staggered[rid]] == want, rid
        if rid in together:
            assert [(o.token_id, o.logprob) for o in together[rid]] == want, rid


def test_chunked_prefill_never_passes_the_budget_and_running_streams_keep_going() -> None:
    model = Recording(max_seq_len=256)
    ex = executor(model, prefill_budget=16)
    ex.add_request("run", [1, 2], P(seed=1, max_tokens=40))
    ex.step()
    long_prompt = [(7 * i) % V for i in range(100)]
    ex.add_request("long", long_prompt, P(seed=2, max_tokens=3))
    ex.add_request("short", [3, 4, 5], P(seed=3, max_tokens=3))
    model.calls.clear()
    got = []
    for _ in range(12):
        outs = ex.step()
        assert "run" in [o.request_id for o in outs]  # a token every step
        got += outs
    batches = [c for c in model.calls if c[0] == "prefill_batch"]
    assert all(c[1] <= 16 for c in batches)
    assert sum(c[1] for c in batches) == 99 + 2  # each prompt but its last token, once
    # first come first served: "short" waits behind the long prompt's chunks
    assert batches[0][2] == (16,) and batches[-1][2] == (99 - 6 * 16, 2)
    # 7 chunks, each behind one step of "run" alone (bucket 1); the step after the last
    # chunk decodes all three rows (bucket 4)
    assert [c[:2] for c in model.calls[:15]] == [("decode", 1), ("prefill_batch", 16)] * 6 + [
        ("decode", 1), ("prefill_batch", 5), ("decode", 4)]  # fmt: skip
    ref = executor()
    ref.add_request("long", long_prompt, P(seed=2, max_tokens=3))
    assert tokens([o for o in got if o.request_id == "long"]) == tokens(drain(ref)["long"])


def test_tiny_lm_chunked_prefill_gives_the_unchunked_tokens() -> None:
    def run(budget: int) -> list[gx.RequestOutput]:
        m = gx.models.TinyLM(V, seed=3, dim=32, layers=1, heads=2, max_seq_len=64)
        ex = gx.DecodeExecutor(m, max_batch_size=2, device="cpu", prefill_budget=budget)
        ex.add_request("r", [(11 * i) % V for i in range(40)], P(seed=4, max_tokens=6,
                                                                logprobs=0))  # fmt: skip
        return drain(ex)["r"]

    whole, chunked = run(1024), run(6)
    assert tokens(whole) == tokens(chunked)
    assert [o.logprob for o in chunked] == pytest.approx([o.logprob for o in whole], abs=1e-4)


@pytest.mark.parametrize("when", ["queued", "mid-prefill"])
def test_abort_before_the_first_token_frees_the_slot(when: str) -> None:
    model = Recording(max_seq_len=256)
    ex = executor(model, prefill_budget=8)
    ex.add_request("run", [1], P(seed=1, max_tokens=30))
    ex.step()
    ex.add_request("gone", list(range(1, 60)), P(seed=2, max_tokens=5))
    if when == "mid-prefill":
        ex.step()
        ex.step()
        assert ex.num_running == 2 and ex.free_slots == 6
    ex.abort("gone")
    outs = [o for o in ex.step() if o.request_id == "gone"]
    assert [(o.finish_reason, o.position, o.token_id) for o in outs] == [("abort", 0, None)]
    assert ex.free_slots == 7 and ex.num_running == 1
    before = len([c for c in model.calls if c[0] == "prefill_batch"])
    ex.step()
    assert len([c for c in model.calls if c[0] == "prefill_batch"]) == before  # not resumed
    ex.add_request("gone", [9], P(seed=2, max_tokens=1))  # the id is free again
    assert drain(ex)["gone"][-1].finish_reason == "length"


def test_aborting_the_stream_that_holds_an_n_prefill_restarts_it_for_the_others() -> None:
    prompt = list(range(2, 50))
    ex = executor(gx.models.TinyLM(V, seed=1, dim=32, layers=1, heads=2, max_seq_len=64),
                  prefill_budget=8)  # fmt: skip
    ex.add_request("r", prompt, P(seed=5, max_tokens=4, n=3))
    ex.step()
    ex.abort("r/0")  # its slot holds the partial prefill
    got = drain(ex)
    assert [o.finish_reason for o in got["r/0"]] == ["abort"]
    ref = executor(gx.models.TinyLM(V, seed=1, dim=32, layers=1, heads=2, max_seq_len=64))
    ref.add_request("r", prompt, P(seed=5, max_tokens=4, n=3))
    want = drain(ref)
    for rid in ("r/1", "r/2"):
        assert tokens(got[rid]) == tokens(want[rid]) and len(tokens(got[rid])) == 4


def test_replay_equals_eager_under_churn() -> None:
    items = wl.mixed_workload(24, V, seed=7, spread=10, max_tokens=(1, 16), unseeded_every=0)

    def run(mode):
        ex = executor(prefill_budget=5, seed=0)
        trace, queue, step = {}, list(items), 0
        rng = random.Random(0)
        while queue or not ex.idle:
            while queue and queue[0].arrive <= step and ex.free_slots:
                it = queue.pop(0)
                ex.add_request(it.request_id, list(it.prompt), it.params)
            for o in ex.step(mode):
                trace.setdefault(o.request_id, []).append((o.token_id, o.position, o.logprob,
                                                           o.finish_reason))  # fmt: skip
            live = [r for r in trace if trace[r][-1][3] is None]
            if live and rng.random() < 0.15:
                ex.abort(rng.choice(sorted(live)))
            step += 1
        return trace

    replay, eager = run(None), run("eager")
    assert replay == eager and len(replay) == 24
    assert sum(v[-1][3] == "abort" for v in replay.values()) > 0


def test_prefill_budget_is_checked() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_budget"):
            gx.DecodeExecutor(gx.models.TableModel(V), device="cpu", prefill_budget=bad)


def test_first_token_comes_from_the_decode_of_the_last_prompt_token() -> None:
    model = Recording()
    ex = executor(model)
    ex.add_request("a", [4, 5, 6], P(temperature=0.0, max_tokens=1, logprobs=0))
    (o,) = drain(ex)["a"]
    row = model.logits(torch.tensor([2]), torch.tensor([6]))[0]  # position 2, token 6
    assert o.token_id == int(row.argmax()) and o.key is not None
    assert o.logprob == pytest.approx(float(torch.log_softmax(row, -1).max()), abs=1e-6)


class NoBatchDraft(gx.models.TableModel):
    prefill_batch = None  # a draft model that only has `prefill`


def test_a_draft_model_without_prefill_batch_gets_whole_prompts() -> None:
    prompt = [(5 * i) % V for i in range(1, 30)]
    spec = gx.SpeculativeConfig(2, drafter=NoBatchDraft(V, seed=0))
    ex = executor(speculative=spec, prefill_budget=4)
    assert not ex.prefiller.chunked  # chunks would not reach the draft's state
    ex.add_request("r", prompt, P(seed=3, max_tokens=6))
    ref = executor()
    ref.add_request("r", prompt, P(seed=3, max_tokens=6))
    got = drain(ex)["r"]
    assert got[-1].finish_reason == "length" and tokens(got) == tokens(drain(ref)["r"])


def test_prompt_logprobs_reach_a_request_admitted_while_others_run() -> None:
    ex = executor()
    ex.add_request("run", [1], P(seed=1, max_tokens=20))
    ex.step()
    ex.add_request("lp", [4, 5, 6, 7], P(seed=2, max_tokens=2, prompt_logprobs=1))
    ex.step()  # prefilled behind the running request's decode
    req = ex.requests.running["lp"]  # its logprobs were read after that step's wait
    assert req.prompt_logprobs is not None and len(req.prompt_logprobs) == 4
    first = []
    while not first:  # its first token: the step after the prefill (a call later with overlap)
        first = [o for o in ex.step() if o.request_id == "lp"]
    assert first[0].position == 0 and first[0].prompt_logprobs is req.prompt_logprobs
