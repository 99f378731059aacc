"""DecodeExecutor on the CPU: keys, padding, slot reuse, stops, abort, errors, invariance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphexec as gx
from graphexec.app import workload as wl
from graphexec.engine.graphs import GraphKey
from graphexec.params import SamplerVariant as SV
from tests.engine.scripted import drain, next_outputs, tokens

P = gx.SamplingParams
V = 300


def make(max_batch_size: int = 8, **kw) -> gx.DecodeExecutor:
    ex = gx.DecodeExecutor(gx.models.TableModel(V, seed=0, max_seq_len=kw.pop("max_seq_len", 256)),
                           max_batch_size=max_batch_size, device="cpu", seed=11, **kw)  # fmt: skip
    if ex.cuda_graphs:
        ex.capture(progress=False)
    return ex


def test_capture_makes_every_key_once_largest_bucket_first() -> None:
    """Every variant has its own kernels (top_k_top_p: top-k first), so its own graphs."""
    ex = make(8)
    keys = ex.graph_keys
    assert len(keys) == len(set(keys)) == 4 * 3 * 2 and keys[0].bucket == 8
    assert set(keys) == {GraphKey(v, b, lp) for v in SV for b in (1, 2, 4, 8)
                         for lp in (False, True)}  # fmt: skip
    assert [k.bucket for k in keys] == sorted((k.bucket for k in keys), reverse=True)
    assert len(make(256).graph_keys) == 20 * 3 * 2


def test_named_keys_are_captured_and_replayed() -> None:
    ex = gx.DecodeExecutor(gx.models.TableModel(V, seed=0), max_batch_size=8, device="cpu",
                           seed=11)  # fmt: skip
    named = [GraphKey(SV.TOP_K_TOP_P, b, False) for b in (1, 4)] + [GraphKey(SV.DEFAULT, 4, False)]
    ex.capture(named, progress=False)
    assert ex.graph_keys == [named[1], named[2], named[0]]
    ex.add_request("a", [1], P(top_k=5, seed=1, max_tokens=2))
    ex.step()
    assert ex.stats.replays[GraphKey(SV.TOP_K_TOP_P, 1, False)] == 1


@pytest.mark.parametrize(
    "params, key",
    [
        ([P(seed=1), P(temperature=0.0, seed=2)], GraphKey(SV.NO_FILTER, 2, False)),
        ([P(seed=1), P(top_k=5, seed=2), P(seed=3)], GraphKey(SV.TOP_K_TOP_P, 4, False)),
        ([P(seed=1, logprobs=0)] + [P(top_p=0.5, seed=2)] * 4, GraphKey(SV.DEFAULT, 8, True)),
        ([P(min_p=0.1, seed=1), P(top_k=3, seed=2, logprobs=2)], GraphKey(SV.DEFAULT, 2, True)),
        ([P(temperature=0.0, min_p=0.1, seed=1)], GraphKey(SV.NO_FILTER, 1, False)),  # greedy
    ],
)  # fmt: skip
def test_step_replays_the_key_of_the_batch(params: list[gx.SamplingParams], key: GraphKey) -> None:
    ex = make(8)
    for i, p in enumerate(params):
        ex.add_request(f"r{i}", [i + 1], dataclasses.replace(p, max_tokens=3))
    outs = next_outputs(ex)  # the prefill, then the first tokens drawn by the key's graph
    assert {o.key for o in outs} == {key} and {o.position for o in outs} == {0}
    assert ex.stats.replays[key] == sum(ex.stats.replays.values()) == ex.stats.steps


def test_padding_rows_never_touch_real_or_free_slots() -> None:
    ex = make(8)
    for i in range(3):  # bucket 4: one padding row
        ex.add_request(f"r{i}", [5, i], P(seed=i, max_tokens=4, presence_penalty=0.5))
    st = ex.slots
    drain(ex)
    # requests are released; before the next flush their rows still show their history
    assert st.positions[:3].tolist() == [4, 4, 4]
    assert st.tensors.token_counts[:3].sum(1).tolist() == [4, 4, 4]
    free = list(range(3, st.padding_slot + 1))  # never-used slots and the padding slot
    assert st.positions[free].eq(0).all() and st.last_token[free].eq(0).all()
    assert st.tensors.token_counts[free].eq(0).all()


def test_slot_reuse_leaks_nothing() -> None:
    probe = P(temperature=0.9, seed=99, max_tokens=12, presence_penalty=1.0, frequency_penalty=0.5,
              repetition_penalty=1.5, logprobs=2)  # fmt: skip
    fresh = make(4)
    fresh.add_request("probe", [7, 8, 9], probe)
    want = drain(fresh)["probe"]
    ex = make(4)
    for i in range(4):  # fill every slot with other state first
        ex.add_request(
            f"o{i}",
            [i + 1] * 5,
            P(
                top_k=9,
                seed=i,
                max_tokens=6 + i,
                logprobs=3,
                logit_bias={7: 5.0},
                frequency_penalty=2.0,
            ),
        )
    drain(ex)
    ex.add_request("probe", [7, 8, 9], probe)
    got = drain(ex)["probe"]
    assert [(o.token_id, o.logprob, o.top_logprobs) for o in got] == [
        (o.token_id, o.logprob, o.top_logprobs) for o in want
    ]


def test_request_tokens_do_not_depend_on_batch_row_or_bucket() -> None:
    probe = P(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, logprobs=3)
    ex = make(16)
    ex.add_request("probe", [3, 4], probe)
    alone = drain(ex)["probe"]
    for n_before, n_after in [(1, 0), (4, 2), (9, 6)]:
        ex = make(16)
        for i in range(n_before):
            ex.add_request(f"a{i}", [i], P(min_p=0.1, seed=i, max_tokens=3 + i))
        ex.add_request("probe", [3, 4], probe)
        for i in range(n_after):
            ex.add_request(f"b{i}", [i], P(temperature=0.0, seed=i, max_tokens=20))
        got = drain(ex)["probe"]
        assert tokens(got) == tokens(alone)
        top = [(t, v) for o in got for t, v in o.top_logprobs]
        want = [(t, v) for o in alone for t, v in o.top_logprobs]
        assert [t for t, _ in top] == [t for t, _ in want]
        assert [v for _, v in top] == pytest.approx([v for _, v in want], rel=1e-6)


def test_top_k_top_p_batches_get_the_tokens_of_default() -> None:
    """A top-k workload replays top_k_top_p's own graphs (top-k first) and draws exactly
    the tokens (and logprobs) it draws when every row is served by default's: the same
    workload with one min-p row beside it."""

    def params(i: int, min_p: float = 0.0) -> gx.SamplingParams:
        return P(temperature=0.7 + 0.1 * (i % 3), top_k=(5, 1, 40)[i % 3],
                 top_p=(1.0, 0.8, 0.95)[i % 3], seed=i, max_tokens=8, min_p=min_p,
                 logprobs=2 if i % 2 else None)  # fmt: skip

    items = [wl.WorkItem(f"r{i}", (i + 1, 2), params(i), 0, "topk") for i in range(9)]
    own_ex = make(16)
    own = wl.run(own_ex, items)
    # a min-p row (all its tokens kept: min-p 1e-30) puts every step on default's graphs
    dflt = wl.run(make(16), items + [wl.WorkItem("m", (3,), params(0, 1e-30), 0, "minp")])
    assert {k.variant for k in wl.outputs_per_key(dflt) if k} == {SV.DEFAULT}
    dflt.outputs.pop("m")
    assert wl.compare(own, dflt) == []
    assert {k.variant for k in wl.outputs_per_key(own) if k} == {SV.TOP_K_TOP_P}
    assert {k.variant for k in own_ex.graph_keys} == set(SV)


def test_eager_and_emulated_replay_are_identical() -> None:
    items = wl.mixed_workload(24, V, seed=3)
    a = wl.run(make(8), items)
    b = wl.run(make(8), items, mode="eager")
    assert wl.compare(a, b) == []
    assert sum(k is not None for k in wl.outputs_per_key(a)) >= 3  # several keys replayed


def test_batches_larger_than_the_largest_bucket_run_in_chunks() -> None:
    items = wl.mixed_workload(12, V, seed=4, spread=0)
    small = wl.run(make(12, buckets=(1, 2, 4)), items)
    assert max(k.bucket for k in wl.outputs_per_key(small) if k) == 4
    assert wl.compare(small, wl.run(make(12), items)) == []


def test_stop_conditions_and_finish_reasons() -> None:
    ex = make(4)
    ex.add_request("len", [1], P(seed=1, max_tokens=3))
    ex.add_request("greedy", [2], P(temperature=0.0, seed=2, max_tokens=6))
    outs = drain(ex)
    assert [o.finish_reason for o in outs["len"]] == [None, None, "length"]
    third = tokens(outs["greedy"])[2]
    ex.add_request("stop", [2], P(temperature=0.0, seed=2, max_tokens=6, stop_token_ids=(third,)))
    outs2 = drain(ex)
    assert tokens(outs2["stop"]) == tokens(outs["greedy"])[:3]
    assert outs2["stop"][-1].finish_reason == "stop"


def test_model_sequence_limit_finishes_with_length() -> None:
    ex = make(4, max_seq_len=8)
    ex.add_request("r", [1, 2, 3], P(seed=3, max_tokens=50))
    outs = drain(ex)["r"]
    assert len(outs) == 5 and outs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt_token_ids must hold 1 to 7"):
        ex.add_request("long", list(range(9)), P(seed=1))


def test_a_prompt_that_fills_the_context_is_refused_naming_the_prompt() -> None:
    """It was admitted, emitted one token unfinished, then was released silently."""
    ex = make(4, max_seq_len=8)
    with pytest.raises(ValueError, match="prompt_token_ids must hold 1 to 7 tokens"):
        ex.add_request("full", list(range(8)), P(seed=1))
    ex.add_request("room", list(range(7)), P(seed=1, max_tokens=50))  # room for one token
    (o,) = drain(ex)["room"]
    assert o.position == 0 and o.finished and o.finish_reason == "length"
    assert ex.idle and ex.free_slots == 4


def test_eos_of_the_tokenizer_stops() -> None:
    tok = gx.Tokenizer.cl100k()
    ex = gx.DecodeExecutor(gx.models.TableModel(tok.vocab_size), max_batch_size=2, device="cpu",
                           tokenizer=tok)  # fmt: skip
    ex.add_request("r", [1], P(seed=1, logit_bias={tok.eos_token_id: 50.0}))
    (o,) = drain(ex)["r"]
    assert o.token_id == tok.eos_token_id and o.finish_reason == "stop" and ex.free_slots == 2


def test_every_eos_id_of_the_tokenizer_stops_and_min_tokens_holds_them_back() -> None:
    tok = gx.Tokenizer.cl100k()
    second = 100  # an ordinary token made a second EOS, as a checkpoint's config may list
    tok.eos_token_ids = (tok.eos_token_id, second)
    ex = gx.DecodeExecutor(gx.models.TableModel(tok.vocab_size), max_batch_size=4, device="cpu",
                           tokenizer=tok)  # fmt: skip
    bias = {second: 50.0}
    ex.add_request("stop", [1], P(seed=1, logit_bias=bias))
    ex.add_request("ignore", [1], P(seed=1, logit_bias=bias, ignore_eos=True, max_tokens=3))
    ex.add_request("min", [1], P(seed=1, logit_bias=bias, min_tokens=2, max_tokens=5))
    outs = drain(ex)
    assert ex.free_slots == 4
    assert [o.token_id for o in outs["stop"]] == [second] and outs["stop"][
        0
    ].finish_reason == "stop"
    assert [o.token_id for o in outs["ignore"]] == [second] * 3
    assert outs["ignore"][-1].finish_reason == "length"
    m = [o.token_id for o in outs["min"]]
    assert second not in m[:2] and m[2] == second and outs["min"][-1].finish_reason == "stop"


def test_abort_reports_and_frees_the_slot() -> None:
    ex = make(2)
    ex.add_request("a", [1], P(seed=1, max_tokens=50))
    ex.add_request("b", [1], P(seed=2, max_tokens=5))
    seen: list[gx.RequestOutput] = []
    while sum(o.request_id == "a" for o in seen) < 2:
        seen += ex.step()
    assert ex.abort("a") is True
    assert ex.free_slots == 0  # the abort takes effect at the next step
    outs = ex.step()
    assert ex.free_slots == 1
    ab = [o for o in outs if o.request_id == "a"]
    assert len(ab) == 1 and ab[0].finish_reason == "abort" and ab[0].token_id is None
    assert ab[0].position == 2  # two tokens were reported before it
    assert [o.request_id for o in outs].count("b") == 1
    assert ex.abort("a") is False  # ended and reported: a no-op
    assert ex.free_slots == 1  # nothing changed
    ex.add_request("a", [1], P(seed=1, max_tokens=2))  # the id is free again


class NaNAtPosition(gx.models.TableModel):
    """Rows whose model position is 3 come out all NaN (a model fault at run time)."""

    def decode(self, input_ids, positions, slot_ids):
        logits = super().decode(input_ids, positions, slot_ids)
        return torch.where((positions == 3)[:, None], float("nan"), logits)


def test_invalid_rows_finish_with_error_and_spare_the_others() -> None:
    def run(with_bad: bool) -> dict[str, list[gx.RequestOutput]]:
        ex = gx.DecodeExecutor(NaNAtPosition(V), max_batch_size=4, device="cpu")
        ex.capture(progress=False)
        if with_bad:
            ex.add_request("bad", [1, 2], P(seed=1, max_tokens=10))  # position 3 at its 3rd
        ex.add_request("good", [1, 2, 3, 4, 5], P(seed=2, max_tokens=10))
        return drain(ex)

    outs = run(True)
    bad = outs["bad"]
    assert bad[-1].finish_reason == "error" and bad[-1].token_id is None
    assert "no samplable token" in bad[-1].message and len(tokens(bad)) == 2
    assert tokens(outs["good"]) == tokens(run(False)["good"])


def test_admission_errors_name_the_problem() -> None:
    ex = make(2)
    ex.add_request("a", [1], P(seed=1))
    with pytest.raises(ValueError, match="'a' is already in use"):
        ex.add_request("a", [1], P(seed=1))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        ex.add_request("g", [1], P(seed=1, grammar=gx.Grammar.json()))
    with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, 300\)"):
        ex.add_request("p", [1, 300], P(seed=1))
    with pytest.raises(ValueError, match="prompt_token_ids must hold"):
        ex.add_request("p", [], P(seed=1))
    with pytest.raises(ValueError, match="top_k"):
        ex.add_request("k", [1], P(seed=1, top_k=301))
    ex.add_request("b", [1], P(seed=1))
    assert ex.free_slots == 0
    with pytest.raises(gx.ExecutorFullError, match="0 of 2 slots are free"):
        ex.add_request("c", [1], P(seed=1))
    ex.step()
    assert ex.num_running == 2  # nobody was evicted
    with pytest.raises(ValueError, match="mode"):
        ex.step(mode="fast")


def test_unseeded_requests_get_a_reported_seed_that_replays_them() -> None:
    ex = make(2)
    ex.add_request("u", [4], P(max_tokens=6))
    outs = drain(ex)["u"]
    seed = outs[0].seed
    assert all(o.seed == seed for o in outs)
    ex.add_request("again", [4], P(max_tokens=6, seed=seed))
    assert tokens(drain(ex)["again"]) == tokens(outs)


def test_logprobs_are_of_the_raw_model_distribution() -> None:
    ex = make(4)
    model = ex.model
    prompt = [9, 8, 7]
    ex.add_request("lp", prompt, P(temperature=0.7, seed=3, max_tokens=5, logprobs=4))
    ex.add_request("off", prompt, P(seed=3, max_tokens=5))
    outs = drain(ex)
    assert all(o.logprob is None and o.top_logprobs is None for o in outs["off"])
    last = prompt[-1]
    for o in outs["lp"]:
        pos = torch.tensor([len(prompt) - 1 + o.position])
        ref = torch.log_softmax(model.logits(pos, torch.tensor([last]))[0], -1)
        assert o.logprob == pytest.approx(float(ref[o.token_id]), abs=1e-5)
        assert o.rank == int((ref > ref[o.token_id]).sum()) + 1
        top = torch.topk(ref, 4)
        assert [t for t, _ in o.top_logprobs] == top.indices.tolist()
        assert [v for _, v in o.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
        last = o.token_id


def test_cuda_graphs_off_runs_eagerly() -> None:
    ex = make(2, cuda_graphs=False)
    ex.add_request("a", [1], P(seed=1, max_tokens=3))
    drain(ex)
    assert ex.graph_keys == [] and sum(ex.stats.eager_steps.values()) == 3
    with pytest.raises(RuntimeError, match="cuda_graphs=False"):
        ex.capture()


def test_every_request_gets_exactly_its_tokens_while_others_come_and_go() -> None:
    items = wl.mixed_workload(30, V, seed=1, spread=12)  # arrivals while others run
    trace = wl.run(make(8), items)
    for it in items:
        outs = trace.outputs[it.request_id]
        assert [o.position for o in outs] == list(range(len(outs))), it.request_id
        if outs[-1].finish_reason == "length":
            assert len(outs) == it.params.max_tokens, it.request_id
        assert all(not o.finished for o in outs[:-1]) and outs[-1].finished
