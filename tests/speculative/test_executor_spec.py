"""The executor with speculation: every seeded stream equals the one without it."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

import graphexec as gx
from graphexec.engine.graphs import GraphKey
from graphexec.params import SamplerVariant
from graphexec.speculative.ngram import TOKEN_WORD, TokenHistory, ngram_drafts

V = 300


def _model(seed: int = 0) -> gx.models.TableModel:
    return gx.models.TableModel(V, seed=seed, scale=9.0)


def _params() -> list[gx.SamplingParams]:
    P = gx.SamplingParams
    return [
        P(temperature=0.0, max_tokens=30, seed=1),
        P(temperature=0.8, top_p=0.9, max_tokens=25, seed=2, frequency_penalty=0.3),
        P(temperature=1.0, top_k=5, max_tokens=40, seed=3, logprobs=2),
        P(temperature=0.5, min_p=0.1, max_tokens=33, seed=4, repetition_penalty=1.2,
          presence_penalty=0.4, stop_token_ids=(7,)),
        P(temperature=0.9, logit_bias={11: 3.0, 12: 3.0}, max_tokens=17, seed=5),
        P(temperature=0.0, max_tokens=21, seed=6, logprobs=0),
    ]  # fmt: skip


def run(spec, mode=None, model=None, batch=8, params=None, arrive_every=2):
    """Streams {request_id: [(token, position, finish_reason, logprob)]}, steps, stats."""
    ex = gx.DecodeExecutor(model or _model(), max_batch_size=batch, device="cpu",
                           speculative=spec, seed=0)  # fmt: skip
    ex.capture(progress=False)
    rng = random.Random(1)
    queue = list(enumerate(params or _params()))
    streams: dict[str, list] = {}
    steps = 0
    while queue or not ex.idle:
        if queue and steps % arrive_every == 0 and ex.free_slots:
            i, p = queue.pop(0)
            prompt = [rng.randrange(V) for _ in range(12)] + [1, 2, 3, 1, 2, 3]
            ex.add_request(f"r{i}", prompt, p)
        for o in ex.step(mode):
            row = (o.token_id, o.position, o.finish_reason, o.logprob, o.top_logprobs)
            streams.setdefault(o.request_id, []).append(row)
        steps += 1
    return streams, steps, ex.stats


def tokens(streams):
    return {k: [(t, p, f) for t, p, f, *_ in v] for k, v in streams.items()}


@pytest.fixture(scope="session")  # data: worksteal interleaving rebuilt a module-scoped one
def baseline():
    return run(None)


DRAFTERS = {
    "ngram": lambda: "ngram",
    "equal-model": lambda: _model(0),
    "other-model": lambda: _model(5),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("k", [1, 3])
def test_strict_speculation_never_changes_a_stream(baseline, drafter, k):
    spec = gx.SpeculativeConfig(k, drafter=DRAFTERS[drafter]())
    streams, steps, stats = run(spec)
    assert tokens(streams) == tokens(baseline[0])
    # positions are consecutive and every request ends exactly once
    for v in streams.values():
        assert [p for _, p, *_ in v] == list(range(len(v)))
        assert [f is not None for *_, f, _, _ in v].count(True) == 1
    if drafter == "equal-model":
        assert stats.accepted == stats.drafted > 0


def test_equal_draft_model_cuts_steps_by_k_plus_1(baseline):
    k = 4
    params = [gx.SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=41)
              for s in range(4)]  # fmt: skip
    base = run(None, params=params, arrive_every=1)
    streams, _, stats = run(gx.SpeculativeConfig(k, drafter=_model(0)), params=params,
                            arrive_every=1)  # fmt: skip
    assert tokens(streams) == tokens(base[0])
    # 41 tokens: 8 runs of k + 1 = 5, then one (a run never passes max_tokens)
    assert stats.drafted == stats.accepted == 4 * 8 * k
    # the last arrival decodes from step 4 on: 41 steps without drafts, 9 with (steps
    # launched: with overlap the loop makes one call more, to collect the last)
    assert (base[2].steps - 4, stats.steps - 4) == (41, 9)


@pytest.mark.parametrize("drafter", ["ngram", "equal-model"])
def test_replay_equals_eager_with_speculation(drafter):
    spec = gx.SpeculativeConfig(3, drafter=DRAFTERS[drafter]())
    replay, _, stats = run(spec)
    eager, _, _ = run(gx.SpeculativeConfig(3, drafter=DRAFTERS[drafter]()), mode="eager")
    assert replay == eager  # tokens and logprobs, bit for bit
    assert any(k.spec_k == 3 for k in stats.replays if stats.replays[k])


def test_logprobs_under_speculation_match_plain_decoding(baseline):
    streams, _, _ = run(gx.SpeculativeConfig(3, drafter=_model(0)))
    for rid, v in baseline[0].items():
        for (t, _, _, lp, top), (t2, _, _, lp2, top2) in zip(v, streams[rid], strict=True):
            assert t == t2
            if lp is None:
                assert lp2 is None
            else:
                assert lp2 == pytest.approx(lp, rel=1e-6, abs=1e-6)
                assert [i for i, _ in top] == [i for i, _ in top2]


def test_rejection_mode_runs_and_respects_limits(baseline):
    for drafter in ("ngram", _model(0), _model(5)):
        spec = gx.SpeculativeConfig(3, drafter=drafter, verify="rejection")
        streams, _, stats = run(spec)
        for (_, v), p in zip(sorted(streams.items()), _params(), strict=True):
            assert len(v) <= p.max_tokens
            assert all(0 <= t < V for t, *_ in v)
            assert v[-1][2] in ("length", "stop")
        assert stats.accepted <= stats.drafted
    # greedy rows accept exactly the argmax: the greedy streams (of the last run: the other
    # model as drafter) equal plain decoding
    for rid in ("r0", "r5"):
        assert tokens(streams)[rid] == tokens(baseline[0])[rid]


def test_stops_inside_a_run_truncate_it():
    # a stop id that the plain stream emits mid-way: the speculative stream ends at it too
    base = run(None, params=[gx.SamplingParams(temperature=0.7, seed=9, max_tokens=60)])[0]
    toks = [t for t, *_ in base["r0"]]
    stop = toks[len(toks) // 2]
    p = gx.SamplingParams(temperature=0.7, seed=9, max_tokens=60, stop_token_ids=(stop,))
    plain = run(None, params=[p])[0]["r0"]
    spec = run(gx.SpeculativeConfig(5, drafter=_model(0)), params=[p])[0]["r0"]
    assert tokens({"a": spec}) == tokens({"a": plain})
    assert spec[-1][0] == stop and spec[-1][2] == "stop"
    assert len(spec) == toks.index(stop) + 1


def test_requests_without_drafts_ride_in_the_same_step():
    # n-gram over a prompt without repeats and a high-temperature stream: few drafts; every
    # step is keyed spec_k = 3 when some row drafted and 0 otherwise
    streams, _, stats = run(gx.SpeculativeConfig(3))
    used = {k.spec_k for k, n in stats.replays.items() if n}
    assert used <= {0, 3}
    assert stats.drafted > 0


def test_every_draft_draw_takes_one_argument_layout():
    """A strict draft model's K draws per step pass the sampler the same layout at every
    offset: the drafts so far as one [b, K] id block (-1 past them) and a contiguous mask.
    On the GPU a narrower block or a mask slice is another specialisation of each Triton
    kernel, compiled anew (about a minute each for the row kernels)."""
    k = 3
    ex = gx.DecodeExecutor(_model(), max_batch_size=4, device="cpu", seed=0,
                           speculative=gx.SpeculativeConfig(k, drafter=_model(0)))  # fmt: skip
    step = ex.runner.step
    calls = []

    def spy(logits, slot_ids, positions, table, out, bitmask, *args, count_ids=None, **kw):
        calls.append((None if count_ids is None else tuple(count_ids.shape[1:]),
                      None if count_ids is None else count_ids.stride(),
                      bitmask.is_contiguous()))  # fmt: skip
        return inner(logits, slot_ids, positions, table, out, bitmask, *args,
                     count_ids=count_ids, **kw)  # fmt: skip

    inner = step.sampler.sample_fn
    object.__setattr__(step.sampler, "sample_fn", spy)
    ex.capture(progress=False)
    ex.add_request("a", [1, 2, 3, 1, 2, 3], gx.SamplingParams(
        temperature=0.8, seed=1, max_tokens=12, frequency_penalty=0.5))  # fmt: skip
    while not ex.idle:
        ex.step("eager")
    drafts = [c for c in calls if c[0] is not None]
    assert len(drafts) >= 2 * k  # every offset of two draft steps at least
    assert {(w, stride[1]) for w, stride, _ in drafts} == {((k,), 1)}
    assert all(contiguous for *_, contiguous in calls)


def test_graph_keys_carry_spec_k():
    ex = gx.DecodeExecutor(_model(), max_batch_size=4, device="cpu",
                           speculative=gx.SpeculativeConfig(2))  # fmt: skip
    ex.capture(progress=False)
    assert {k.spec_k for k in ex.graph_keys} == {0, 2}
    ex = gx.DecodeExecutor(_model(), max_batch_size=4, device="cpu",
                           speculative=gx.SpeculativeConfig(2, drafter=_model(1)))  # fmt: skip
    ex.capture(progress=False)
    assert {k.spec_k for k in ex.graph_keys} == {2}
    assert str(GraphKey(SamplerVariant.DEFAULT, 4, True, 2)) == "default/b4/lp/k2"
    with pytest.raises(ValueError, match="spec_k"):
        GraphKey(SamplerVariant.DEFAULT, 4, True, -1)


def test_speculative_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        gx.SpeculativeConfig(0)
    with pytest.raises(ValueError, match="verify"):
        gx.SpeculativeConfig(2, verify="greedy")
    with pytest.raises(ValueError, match="drafter"):
        gx.SpeculativeConfig(2, drafter="eagle")
    with pytest.raises(ValueError, match="drafter"):
        gx.SpeculativeConfig(2, drafter=object())
    with pytest.raises(ValueError, match="ngram_min"):
        gx.SpeculativeConfig(2, ngram_min=3, ngram_max=2)
    wrong = gx.SpeculativeConfig(2, drafter=gx.models.TableModel(V + 1))
    with pytest.raises(ValueError, match="vocab"):
        gx.DecodeExecutor(_model(), max_batch_size=2, device="cpu", speculative=wrong)
    with pytest.raises(ValueError, match="speculative"):
        gx.DecodeExecutor(_model(), max_batch_size=2, device="cpu", speculative={"k": 2})


def test_ngram_drafts_take_the_longest_latest_match():
    h = np.array([1, 2, 3, 4, 5, 1, 2, 3])
    assert ngram_drafts(h, 3, 4, 1) == [4, 5, 1]
    # "2 3" occurs twice; the latest occurrence wins, and a 3-gram beats a 1-gram
    h = np.array([2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3])
    assert ngram_drafts(h, 2, 3, 1) == [7, 6]
    assert ngram_drafts(np.array([1, 2, 3]), 4, 4, 1) == []
    assert ngram_drafts(np.array([5]), 4, 4, 1) == []
    assert ngram_drafts(np.array([4, 4]), 4, 4, 1) == [4]
    assert ngram_drafts(np.array([1, 2, 1, 2]), 4, 4, 3) == []  # below ngram_min
    hist = TokenHistory([1, 2])
    hist.extend([3, 4, 5])
    assert hist.tokens.tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("alphabet", [[1, 2, 3], [0, 1, 256, 65536, 65537, 16777216], [7]])
def test_history_drafts_equal_the_array_definition(alphabet):
    """TokenHistory.drafts (a backward byte search) against ngram_drafts on random
    histories, grown as the executor grows them; the second alphabet makes byte patterns
    that match across token boundaries (which must not count)."""
    rng = np.random.default_rng(len(alphabet))
    for _ in range(60):
        tokens = rng.choice(alphabet, size=int(rng.integers(1, 12))).tolist()
        hist = TokenHistory(tokens)
        for _ in range(8):
            for k, hi, lo, w in ((3, 4, 1, 64), (2, 3, 2, 64), (5, 2, 1, 64), (3, 3, 1, 5)):
                assert hist.drafts(k, hi, lo, w) == ngram_drafts(hist.tokens, k, hi, lo, w), (
                    hist.tokens.tolist(), k, hi, lo, w)  # fmt: skip
            more = rng.choice(alphabet, size=int(rng.integers(1, 4)))
            if rng.random() < 0.5:
                hist.extend(more.tolist())
            else:  # as the executor extends it: a row of a step's runs, as words
                hist.extend(more.astype(TOKEN_WORD))
    h = TokenHistory([1, 0, 0, 0, 0, 1, 5, 256])  # bytes of "256" inside "1, 0"
    assert h.drafts(2, 1, 1, 64) == ngram_drafts(h.tokens, 2, 1, 1) == []


def test_the_window_bounds_the_search():
    h = np.array([4, 5, 6, 0, 0, 0, 0, 4])
    assert ngram_drafts(h, 2, 2, 1) == [5, 6]
    assert ngram_drafts(h, 2, 2, 1, window=5) == []  # the earlier 4 is out of the window
    assert TokenHistory(h.tolist()).drafts(2, 2, 1, 8) == [5, 6]
    assert TokenHistory(h.tolist()).drafts(2, 2, 1, 5) == []
    with pytest.raises(ValueError, match="ngram_window"):
        gx.SpeculativeConfig(2, ngram_window=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(3))
def test_device_drafts_equal_the_array_definition(seed, device):
    """NgramHistory.drafts (in the captured step: every row of a batch at once, static
    shapes) against ngram_drafts on each row's history, with windows shorter and longer
    than the histories, allowances from 0 to k, and stale tokens past each history."""
    from graphexec.speculative.ngram_device import NgramHistory

    rng = np.random.default_rng(seed)
    slots, max_len = 9, 40
    for _ in range(60):
        hi = int(rng.integers(1, 6))
        lo, k, w = int(rng.integers(1, hi + 1)), int(rng.integers(1, 6)), int(rng.integers(2, 50))
        dev = NgramHistory(slots, max_len, torch.device(device), hi, lo, w)
        dev.tokens.random_(0, 3)  # what earlier occupants left
        lens = rng.integers(1, max_len + 1, size=slots - 1)
        hists = [rng.integers(0, int(rng.integers(1, 5)), size=n) for n in lens]
        for s, h in enumerate(hists):
            dev.tokens[s, : len(h)] = torch.from_numpy(h).to(torch.int32)
        allow = rng.integers(0, k + 1, size=slots - 1)
        order = torch.from_numpy(rng.permutation(slots - 1))
        lengths, allowed = torch.from_numpy(lens)[order], torch.from_numpy(allow)[order]
        d, used = (x.cpu() for x in dev.drafts(order.to(device), lengths.to(device),
                                                allowed.to(device), k))  # fmt: skip
        for r, s in enumerate(order.tolist()):
            want = ngram_drafts(hists[s], int(allow[s]), hi, lo, min(w, max_len))
            assert d[r, : used[r]].tolist() == want and (d[r, used[r] :] == -1).all(), (s, want)


SCHEMA = {
    "type": "object",
    # one digit: the object completes within max_tokens, so its parse is checked
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "n"],
    "additionalProperties": False,
}


def _grammar_run(spec):
    tok = gx.Tokenizer.cl100k()
    model = gx.models.TableModel(tok.vocab_size, seed=0, scale=6.0)
    ex = gx.DecodeExecutor(model, max_batch_size=4, device="cpu", tokenizer=tok, seed=0,
                           buckets=[4], speculative=spec)  # fmt: skip
    ex.capture(progress=False)
    P = gx.SamplingParams
    params = [
        P(temperature=0.7, seed=1, max_tokens=20, grammar=gx.Grammar.json_schema(SCHEMA)),
        P(temperature=0.0, seed=2, max_tokens=16, grammar=gx.Grammar.regex("(ab)+c")),
        P(temperature=1.0, seed=3, max_tokens=12),
    ]
    for i, p in enumerate(params):
        ex.add_request(f"g{i}", tok.encode("ab ab ab ab"), p)
    out: dict[str, list] = {}
    while not ex.idle:
        for o in ex.step():
            out.setdefault(o.request_id, []).append(o)
    return out, ex.stats


@pytest.fixture(scope="session")
def grammar_base():
    """The grammar requests without speculation (shared by both drafters' tests)."""
    return _grammar_run(None)[0]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_grammar_requests_under_speculation(drafter, grammar_base):
    tok = gx.Tokenizer.cl100k()
    vocab = tok.vocab_size
    draft = "ngram" if drafter == "ngram" else gx.models.TableModel(vocab, seed=0, scale=6.0)
    base = grammar_base
    spec, stats = _grammar_run(gx.SpeculativeConfig(2, drafter=draft))
    for rid in base:
        assert [o.token_id for o in spec[rid]] == [o.token_id for o in base[rid]]
    text = tok.decode([o.token_id for o in spec["g1"] if o.token_id != tok.eos_token_id])
    assert re.fullmatch("(ab)+c", text)
    assert spec["g0"][-1].finish_reason == "stop"
    body = tok.decode([o.token_id for o in spec["g0"] if o.token_id != tok.eos_token_id])
    assert set(json.loads(body)) == {"answer", "n"}
    assert stats.drafted > 0


def test_tiny_lm_verify_equals_decode():
    m = gx.models.TinyLM(64, seed=0, dim=32, layers=1, heads=2, max_seq_len=16)
    m.bind(3, "cpu")
    m.prefill(0, torch.tensor([1, 2, 3]))
    m.prefill(1, torch.tensor([4, 5]))
    ids = torch.tensor([[7, 8, 9], [10, 11, 12]])
    pos = torch.tensor([3, 2])
    slots = torch.tensor([0, 1])
    ver = m.verify(ids, pos, slots)
    m.prefill(0, torch.tensor([1, 2, 3]))
    m.prefill(1, torch.tensor([4, 5]))
    for t in range(3):
        assert torch.equal(ver[:, t], m.decode(ids[:, t], pos + t, slots))
