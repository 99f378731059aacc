"""The pipelined step (overlap=True) against the synchronous one: the same outputs.

Each workload is driven by what the caller has seen: a request is admitted, or aborted,
once another (or itself) has reported k outputs, so both modes get the same commands at
the same point of each stream, whatever step they fall in. Every field a caller reads
(token, position, logprobs, prompt logprobs, seed, finish reason, stop reason, text) must
agree; every request ends exactly once and nothing follows its end.
"""

from __future__ import annotations

import dataclasses

import pytest

import graphexec as gx
from tests.engine.scripted import EOS, byte_tokenizer

P = gx.SamplingParams
V = EOS + 1
LONG = [5 + i % 50 for i in range(30)]  # with max_seq_len 40: room for 10 tokens


@dataclasses.dataclass
class Event:
    after: tuple[str, int] | None  # (request id, outputs it has reported); None: at once
    add: tuple[str, list[int], gx.SamplingParams] | None = None
    abort: str | None = None


def add(rid: str, prompt: list[int], after=None, **params) -> Event:
    return Event(after, (rid, prompt, P(**params)))


def mixed() -> list[Event]:
    """EOS, stop ids and strings, max_tokens and context limits, logprobs and prompt
    logprobs, n > 1, penalties, greedy, an unseeded request; admissions and aborts (of a
    request, of one stream of n) while steps are in flight."""
    ab = {97: 5.0, 98: 5.0}
    # fmt: off
    return [
        add("eos", [1, 2], seed=1, logit_bias={EOS: 5.0}, max_tokens=30),
        add("stopid", [3], seed=2, stop_token_ids=(97, 98), logit_bias=ab, ignore_eos=True,
            max_tokens=30),
        add("stopstr", [4], seed=3, stop=["aa", "ab", "ba", "bb"], logit_bias=ab,
            ignore_eos=True, max_tokens=40),
        add("len", [5], seed=4, max_tokens=5, logprobs=3, ignore_eos=True),
        add("ctx", LONG, seed=5, max_tokens=50, ignore_eos=True, logprobs=0),
        add("greedy", [6], temperature=0.0, seed=6, max_tokens=9),
        add("n2", [7, 8], seed=7, n=2, max_tokens=7, top_k=20, ignore_eos=True,
            presence_penalty=0.5, logprobs=1),
        add("abort", [9], seed=8, max_tokens=30, ignore_eos=True),
        Event(("abort", 4), abort="abort"),
        add("late", [10], ("len", 3), seed=9, max_tokens=6, frequency_penalty=0.3,
            ignore_eos=True),
        add("late2", [11], ("late", 2), seed=10, max_tokens=4, top_p=0.8, ignore_eos=True),
        # aborted on its last token (max_tokens 3): in flight when the abort comes
        add("lastabort", [12], seed=11, max_tokens=3, ignore_eos=True),
        Event(("lastabort", 2), abort="lastabort"),
        add("after_end", [13], ("late2", 4), seed=12, max_tokens=3, ignore_eos=True),
        add("plp", [14, 15, 16, 17], seed=13, prompt_logprobs=2, logprobs=1, max_tokens=4),
        # prefilled behind steps in flight; its prompt logprobs come with its first token
        add("plp_late", LONG[:12], ("greedy", 3), seed=14, prompt_logprobs=0, max_tokens=3,
            ignore_eos=True),
        add("unseeded", [18], max_tokens=4, ignore_eos=True),  # the executor draws its seed
        Event(("n2/1", 3), abort="n2/0"),
    ]
    # fmt: on


def masked() -> list[Event]:
    """Rows with token masks (a grammar, allowed ids, bad words) beside plain rows."""
    # fmt: off
    return [
        add("gram", [1], seed=1, grammar=gx.Grammar.regex("[0-9]{2,6}x"), max_tokens=12),
        add("allowed", [2], seed=2, allowed_token_ids=[97, 98, 99, EOS], max_tokens=12),
        add("bad", [3], seed=3, bad_words=[[97, 98]], logit_bias={97: 5.0, 98: 5.0},
            max_tokens=12, ignore_eos=True),
        add("plain", [4], seed=4, max_tokens=10, ignore_eos=True),
        add("gram2", [5], ("plain", 3), seed=5, grammar=gx.Grammar.regex("(ab|c)+d"),
            max_tokens=8),
        Event(("gram", 2), abort="gram"),
    ]
    # fmt: on


def make(overlap: bool, speculative=None, device: str = "cpu", model=None,
         **config) -> gx.DecodeExecutor:  # fmt: skip
    model = model or gx.models.TableModel(V, seed=3, max_seq_len=40)
    ex = gx.DecodeExecutor(model, max_batch_size=16, device=device, seed=0,
                           tokenizer=byte_tokenizer(), overlap=overlap,
                           speculative=speculative, **config)  # fmt: skip
    ex.capture(progress=False)
    return ex


def run(ex: gx.DecodeExecutor, events: list[Event], mode=None) -> dict[str, list[tuple]]:
    """Each request's outputs as the fields a caller reads; checks that each ends once."""
    outs: dict[str, list[tuple]] = {}
    ended: set[str] = set()
    todo = list(events)
    while True:
        due = [e for e in todo if e.after is None or len(outs.get(e.after[0], ())) >= e.after[1]]
        for e in due:
            todo.remove(e)
            if e.add is not None:
                ex.add_request(*e.add)
            else:
                ex.abort(e.abort)
        if ex.idle:
            break
        for o in ex.step(mode):
            assert o.request_id not in ended, f"{o.request_id}: output after its end"
            if o.finished:
                ended.add(o.request_id)
            row = (o.token_id, o.position, o.logprob, o.top_logprobs, o.finished,
                   o.finish_reason, o.stop_reason, o.text, o.message, o.prompt_logprobs,
                   o.seed)  # fmt: skip
            outs.setdefault(o.request_id, []).append(row)
    assert not todo, "an event never fired"
    assert ended == set(outs), "a request never ended"
    assert ex.free_slots == ex.max_batch_size and not list(ex.step())  # nothing after idle
    for rid, rows in outs.items():
        pos = [r[1] for r in rows if r[0] is not None]
        assert pos == list(range(len(pos))), rid
    return outs


@pytest.mark.parametrize("mode", [None, "eager"])
def test_overlap_gives_the_synchronous_outputs(mode) -> None:
    sync = run(make(False), mixed(), mode)
    piped = run(make(True), mixed(), mode)
    assert piped == sync
    reasons = {rid: rows[-1][5] for rid, rows in sync.items()}
    # the workload reaches every kind of end it is meant to
    assert reasons["eos"] == reasons["stopid"] == reasons["stopstr"] == "stop"
    assert reasons["len"] == reasons["ctx"] == reasons["late"] == "length"
    assert reasons["abort"] == reasons["lastabort"] == "abort"
    assert len(sync["ctx"]) == 10 and sync["stopstr"][-1][6] in ("aa", "ab", "ba", "bb")
    assert sync["stopid"][-1][6] in (97, 98) and len(sync["abort"]) == 5
    assert {"n2/0", "n2/1", "after_end"} <= set(sync)
    assert (reasons["n2/0"], reasons["n2/1"], reasons["plp_late"]) == ("abort", "length", "length")
    # prompt logprobs with each first token (the first prompt token has none), then none
    for rid, n in (("plp", 4), ("plp_late", 12)):
        first, *rest = sync[rid]
        assert len(first[9]) == n and first[9][0] is None and all(r[9] is None for r in rest)
    assert all(r[10] is not None for r in sync["unseeded"])


def test_replayed_and_eager_pipelined_steps_agree() -> None:
    assert run(make(True), mixed()) == run(make(True), mixed(), "eager")


def test_the_pipelined_step_is_the_default() -> None:
    """On CUDA; the CPU computes a step on the calling thread, so it collects each step in
    the call that launched it unless told otherwise."""
    assert gx.EngineConfig().overlap is None
    assert not gx.DecodeExecutor(gx.models.TableModel(V), max_batch_size=2, device="cpu").overlap
    assert gx.DecodeExecutor(gx.models.TableModel(V), max_batch_size=2, device="cpu",
                             overlap=True).overlap  # fmt: skip
    with pytest.raises(ValueError, match="overlap"):
        gx.EngineConfig(overlap=1)


def spec_config(drafter):
    if drafter is None:
        return None
    d = gx.models.TableModel(V, seed=3, max_seq_len=40) if drafter == "model" else drafter
    return gx.SpeculativeConfig(3, drafter=d)


@pytest.mark.parametrize("drafter", [None, "ngram", "model"])
def test_rows_with_token_masks_give_the_synchronous_outputs(drafter) -> None:
    sync = run(make(False, spec_config(drafter)), masked())
    piped = make(True, spec_config(drafter))
    assert run(piped, masked()) == sync
    # mask rows' steps launched in two parts: masks written while the model ran
    # (`StepRunner.launch_forward`); eager too. A draft model drafts under the masks:
    # its steps collect first
    assert (piped.runner.split_steps > 0) == (drafter != "model")
    if drafter != "model":
        assert run(make(True, spec_config(drafter)), masked(), "eager") == sync
    assert sync["gram2"][-1][5] == "stop" and sync["gram"][-1][5] == "abort"
    assert all(t in (97, 98, 99, EOS) for t, *_ in sync["allowed"] if t is not None)


def drafted_masks() -> list[Event]:
    """Mask rows whose prompts the n-gram drafter continues, and whose masks refuse some
    of those drafts: bad words [97, 98] after a prompt of 97 98 pairs (the drafts propose
    98 after 97), a grammar that allows 97 / 98 pairs only twice, beside a plain row."""
    ab = {97: 6.0, 98: 6.0}
    pairs = [97, 98] * 6
    # fmt: off
    return [
        add("bad", pairs, seed=1, bad_words=[[97, 98]], logit_bias=ab, max_tokens=14,
            ignore_eos=True),
        add("gram", pairs, seed=2, grammar=gx.Grammar.regex("(ab){2}[a-c]{0,8}x"),
            logit_bias=ab, max_tokens=14),
        add("plain", pairs, seed=3, logit_bias=ab, max_tokens=14, ignore_eos=True),
        add("bad2", [5, 97, 98, 97, 98], ("plain", 4), seed=4, bad_words=[[98, 97]],
            logit_bias=ab, max_tokens=10, ignore_eos=True),
    ]
    # fmt: on


@pytest.mark.parametrize("mode", [None, "eager"])
def test_split_speculative_steps_cut_the_drafts_their_masks_refuse(mode) -> None:
    """Pipelined n-gram steps with mask rows split (forward with the drafts matched, the
    masks per offset written from the drafts the host finds, then the draw, cutting each
    row's drafts where its mask refused one): the synchronous outputs, drafts verified on
    the mask rows, and no banned pair emitted."""
    sync_ex = make(False, spec_config("ngram"))
    sync = run(sync_ex, drafted_masks(), mode)
    piped = make(True, spec_config("ngram"))
    assert run(piped, drafted_masks(), mode) == sync
    assert piped.runner.split_steps > 0 and piped.drafter.drafted > 0
    assert piped.drafter.accepted == sync_ex.drafter.accepted
    for rid, banned in (("bad", (97, 98)), ("bad2", (98, 97))):
        toks = [r[0] for r in sync[rid] if r[0] is not None]
        assert toks and all(p != banned for p in zip(toks[:-1], toks[1:], strict=True)), rid
    assert "".join(r[7] for r in sync["gram"]).startswith("abab")


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_speculative_steps_give_the_synchronous_outputs(drafter) -> None:
    def spec():
        d = "ngram" if drafter == "ngram" else gx.models.TableModel(V, seed=3, max_seq_len=40)
        return gx.SpeculativeConfig(3, drafter=d)

    sync = run(make(False, spec()), mixed())
    assert run(make(True, spec()), mixed()) == sync
    plain = run(make(False), mixed())
    # speculation changes no token (a run of K + 1 may reach an end before an abort does)
    for rid, rows in plain.items():
        n = min(len(rows), len(sync[rid])) - 1
        assert [r[:2] for r in rows[:n]] == [r[:2] for r in sync[rid][:n]], rid


def test_the_speculative_step_launches_n_plus_1_before_it_waits_for_n(monkeypatch) -> None:
    """n-gram drafts are made on the device: N + 1 launches before the wait for N, and
    N's stop checks and outputs come after it, with the same tokens."""
    from graphexec.engine import executor as executor_mod
    from graphexec.engine.runner import Launched

    def spec():
        return gx.SpeculativeConfig(3, drafter="ngram")

    calls: list[str] = []
    real_finish = executor_mod.finish

    def finish(*args, **kw):
        calls.append("finish")
        return real_finish(*args, **kw)

    monkeypatch.setattr(executor_mod, "finish", finish)
    real_wait = Launched.wait

    def wait(self, queued=False):
        calls.append("wait")
        return real_wait(self, queued)

    monkeypatch.setattr(Launched, "wait", wait)
    piped, sync = make(True, spec()), make(False, spec())
    real_launch = piped.runner.launch

    def launch(*args, **kw):
        calls.append("launch")
        return real_launch(*args, **kw)

    piped.runner.launch = launch
    for ex in (piped, sync):
        for i in range(3):  # repeating prompts: the n-gram drafter finds drafts
            ex.add_request(f"r{i}", [5 + i, 6, 5 + i, 6], P(seed=i, max_tokens=20))
    outs: dict = {ex: [] for ex in (piped, sync)}
    orders = set()  # piped: each call's launch and finish, in order
    for ex in (piped, sync):
        while True:
            calls.clear()
            outs[ex] += [(o.request_id, o.token_id, o.position, o.finish_reason)
                         for o in ex.step()]  # fmt: skip
            if ex is piped:
                orders.add(tuple(calls))
            if ex.idle:
                break
    assert outs[piped] == outs[sync] and len(outs[sync]) > 3
    assert ("launch", "wait", "finish") in orders
    both = [o for o in orders if {"wait", "launch"} <= set(o)]
    assert both and all(o.index("launch") < o.index("wait") for o in both)
    assert piped.drafter.drafted > 0 and sync.drafter.drafted > 0


def test_outputs_arrive_one_call_late_and_the_stopped_row_runs_once_more() -> None:
    ex = make(True)
    ex.add_request("r", [1], P(seed=1, max_tokens=2))
    ex.add_request("s", [1], P(temperature=0.0, seed=1, max_tokens=9))
    assert list(ex.step()) == [] and not ex.idle  # step 0 launched, nothing collected
    first = [(o.request_id, o.position) for o in ex.step()]
    assert first == [("r", 0), ("s", 0)]
    # r's second token (its last) is in flight: it was not launched a third time
    assert ex.stats.steps == 2
    last = list(ex.step())
    assert [(o.request_id, o.finish_reason) for o in last] == [("r", "length"), ("s", None)]
    assert ex.stats.steps == 3  # s alone


class _FakeEvent:
    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def synchronize(self) -> None:
        self.seen.append(self.name)


def test_a_wait_sleeps_only_with_a_step_queued_behind_it(monkeypatch) -> None:
    """Launched.wait: the blocking-sync twin only when queued work hides its wake-up;
    the executor says so for the pipelined step (speculative too), never for a
    synchronous one."""
    from graphexec.engine.runner import Launched

    seen: list = []
    done = Launched(plan=None, event=_FakeEvent("spin", seen), sleeper=_FakeEvent("sleep", seen))
    done.wait(queued=True)
    done.wait(queued=False)
    done.wait()
    Launched(plan=None, event=_FakeEvent("spin", seen)).wait(queued=True)  # no twin
    assert seen == ["sleep", "spin", "spin", "spin"]

    queued: list[bool] = []
    monkeypatch.setattr(Launched, "wait", lambda self, q=False: queued.append(q))
    ngram = gx.SpeculativeConfig(3, drafter="ngram")
    for overlap, spec, want in ((True, None, True), (False, None, False), (True, ngram, True)):
        ex = make(overlap, spec)
        for i in range(3):
            ex.add_request(f"r{i}", [i + 1, i + 2], gx.SamplingParams(seed=i, max_tokens=12,
                                                                      ignore_eos=True))  # fmt: skip
        queued.clear()
        for _ in range(6):
            ex.step()
        assert queued and set(queued[1:-1]) == {want}, (overlap, spec, queued)


def random_workload(seed: int) -> list[Event]:
    """Requests whose prompts repeat a few ids (the n-gram drafter finds drafts), with
    limits from 1 to 14 tokens and prompts up to the context (max_seq_len 40), stop ids,
    EOS, greedy and sampled rows, logprobs, n = 2; admitted as earlier streams report,
    some aborted mid-run."""
    import random

    rng = random.Random(seed)
    events: list[Event] = []
    streams: list[str] = []  # ids that report outputs (each reports one at least)
    for i in range(10):
        prompt = [rng.choice([5, 6, 7, 97]) for _ in range(rng.choice([1, 3, 8, 20, 38]))]
        kw = dict(seed=i, max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5,
                  temperature=rng.choice([0.0, 0.7, 1.2]), logit_bias={5: 2.0, 6: 2.0})
        if rng.random() < 0.3:
            kw["stop_token_ids"] = (rng.choice([5, 6, 97]),)
        if rng.random() < 0.3:
            kw["logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.2:
            kw.update(n=2)
        after = None if i < 3 else (rng.choice(streams), 1)
        events.append(add(f"w{i}", prompt, after, **kw))
        first = f"w{i}/0" if kw.get("n") else f"w{i}"
        streams.append(first)
        if rng.random() < 0.25:  # aborted once it reported (it may have ended already)
            events.append(Event((first, 1), abort=f"w{i}"))
    return events


@pytest.mark.parametrize("seed", range(6))
def test_random_speculative_workloads_give_the_synchronous_outputs(seed) -> None:
    """The pipelined speculative step (tokens in flight counted as the most a run may
    hold, rows sitting a step out near their limits, drafts made on the device) against
    the synchronous one, and speculation against none: the same outputs."""

    def spec():
        return gx.SpeculativeConfig(3, drafter="ngram", ngram_max=3)

    events = random_workload(seed)
    sync = run(make(False, spec()), events)
    piped = make(True, spec())
    assert run(piped, random_workload(seed)) == sync
    assert piped.drafter.drafted > 0
    plain = run(make(False), random_workload(seed))
    assert set(plain) == set(sync)
    for rid, rows in plain.items():  # the same tokens (a run may pass an abort's point)
        n = min(len(rows), len(sync[rid])) - 1
        assert [r[:2] for r in rows[:n]] == [r[:2] for r in sync[rid][:n]], rid


@pytest.mark.parametrize("drafter", [None, "ngram", "model"])
def test_static_masks_pipeline_and_leave_the_slot_clean(drafter) -> None:
    """allowed_token_ids alone is a static mask: written once after the flush, not a mask
    row of the plan, so its steps pipeline (no split step, no collect-first) and give
    the synchronous outputs; a request that takes its slot afterwards is unmasked."""
    allowed = [97, 98, 99, EOS]

    def events():
        # fmt: off
        return [
            add("a", [1, 2], seed=1, allowed_token_ids=allowed, max_tokens=9, ignore_eos=True),
            add("b", [3], seed=2, max_tokens=30, ignore_eos=True),
            add("c", [4], ("a", 9), seed=3, max_tokens=8, ignore_eos=True),  # a's slot
        ]
        # fmt: on

    def ex(overlap: bool):
        spec = None
        if drafter is not None:
            d = "ngram" if drafter == "ngram" else gx.models.TableModel(V, seed=3, max_seq_len=40)
            spec = gx.SpeculativeConfig(3, drafter=d)
        e = gx.DecodeExecutor(gx.models.TableModel(V, seed=3, max_seq_len=40),
                              max_batch_size=2, device="cpu", seed=0,
                              tokenizer=byte_tokenizer(), overlap=overlap,
                              speculative=spec)  # fmt: skip
        e.capture(progress=False)
        return e

    piped = ex(True)
    sync = run(ex(False), events())
    assert run(piped, events()) == sync
    assert piped.runner.split_steps == 0 and not piped.masks.has(0)
    toks = {rid: [r[0] for r in rows if r[0] is not None] for rid, rows in sync.items()}
    assert set(toks["a"]) <= set(allowed) and len(toks["a"]) == 9
    assert not set(toks["c"]) <= set(allowed)  # the slot's mask was reset
