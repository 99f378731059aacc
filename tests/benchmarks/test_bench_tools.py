"""CPU tests of the step benchmark's tooling: the churn loop of step_churn.py
(bench_step.py --scenario churn) on a small TableModel executor (its numbers are not
performance, only its bookkeeping), bench_step's prefill budget and result file. The
sampler benchmark's tooling is tested in test_bench_sampler.py."""

import json

import bench_step  # noqa: E402
import pytest
import step_churn  # noqa: E402

# ----------------------------------------------------------------------------- churn


def test_churn_section_ends_every_request_once_and_measures_it(one_thread):
    import graphexec as gx

    ex = gx.DecodeExecutor(gx.models.TableModel(1000, seed=0), max_batch_size=8, device="cpu",
                           seed=0)  # fmt: skip
    churn = step_churn.Churn("t", (1, 12), grammar_frac=0.0, abort_frac=0.25)
    section = step_churn.churn_section(ex, (churn,), steps=30, warmup=4, ref_steps=6)
    json.dumps(section)  # the JSON's "churn" section (run_churn adds model, keys, capture)
    assert {"max_batch_size", "steps", "warmup", "ref_steps", "targets"} < set(section)
    (w,) = section["workloads"]
    assert set(w) == {"workload", "churn", "steady", "throughput_ratio", "gap_ratio",
                      "admit_mean_us", "met"}  # fmt: skip
    c, s = w["churn"], w["steady"]
    # every request added ended exactly once (finished or aborted), none overran max_tokens
    assert c["problems"] == [] and s["problems"] == []
    assert c["requests"] == c["ended"] > 8 and c["unended"] == 0
    assert ex.idle and ex.free_slots == 8
    assert c["finished"].get("abort", 0) > 0 and c["finished"].get("length", 0) > 0
    assert c["steps"] == 30 and c["tokens_per_s"] > 0 and c["steps_per_s"] > 0
    assert 1 <= c["mean_batch"] <= 8
    # each measured token is a first token or follows one (a gap), one gap per decode row
    assert c["tokens"] == c["gaps"] + c["first_tokens"] and c["first_tokens"] > 0
    assert c["gaps"] == round(c["mean_batch"] * c["steps"])
    assert 0 < c["gap_mean_us"] <= c["gap_p99_us"]
    assert c["admitted"] > 0 and 0 < c["admit_mean_us"] <= c["admit_p99_us"]
    # the reference: the churn's mean batch, every step, nobody arriving or leaving
    assert s["batch"] == round(c["mean_batch"]) == s["min_batch"] == s["mean_batch"]
    assert s["steps"] == 6 and s["tokens"] == 6 * s["batch"] and s["step_us"] > 0
    assert w["throughput_ratio"] == pytest.approx(c["tokens_per_s"] / s["tokens_per_s"])
    assert w["gap_ratio"] == pytest.approx(c["gap_p99_us"] / s["step_us"])
    assert w["met"]["gap_ratio"] == (w["gap_ratio"] <= 3)
    row = step_churn.churn_markdown(section).splitlines()[-1]
    assert row.startswith("| t | 1..12 | ") and row.count("|") == 13


def test_churn_repeats_report_the_median_run_and_every_ratio(one_thread):
    import graphexec as gx

    ex = gx.DecodeExecutor(gx.models.TableModel(1000, seed=0), max_batch_size=4, device="cpu",
                           seed=0)  # fmt: skip
    churn = step_churn.Churn("t", (1, 6), grammar_frac=0.0, abort_frac=0.0)
    section = step_churn.churn_section(ex, (churn,), steps=8, warmup=2, ref_steps=3, repeats=3)
    json.dumps(section)
    (w,) = section["workloads"]
    assert section["repeats"] == 3 and len(w["repeats"]) == 3
    tps = sorted(r["throughput_ratio"] for r in w["repeats"])
    assert w["throughput_ratio"] == tps[1]  # the median run's row
    gaps = sorted(r["gap_ratio"] for r in w["repeats"])
    assert w["gap_ratio"] == gaps[1] and w["met"]["gap_ratio"] == (gaps[1] <= 3)
    assert ex.idle and ex.free_slots == 4


def test_tracker_flags_second_ends_and_short_length_ends():
    from graphexec import SamplingParams as P
    from graphexec.request import RequestOutput as O

    class Ex:
        def add_request(self, *args):
            pass

    tr = step_churn.Tracker(measuring=True)
    tr.add(Ex(), "a", [1], P(max_tokens=2))
    tr.add(Ex(), "b", [1], P(max_tokens=3))
    end = dict(finished=True, finish_reason="length")
    tr.observe([O("a", 5, 0, 0), O("b", 5, 0, 0)], 1.0)
    tr.observe([O("a", 6, 1, 0, **end), O("b", 6, 1, 0, **end)], 1.5)
    tr.observe([O("a", None, 2, 0, finished=True, finish_reason="abort")], 2.0)
    assert tr.ended == {"a", "b"} and not tr.live
    assert tr.bad == ["b: 'length' after 2 tokens, max_tokens 3",
                      "a: output abort after its end or never added"]  # fmt: skip
    assert tr.rows == [0, 2, 0] and tr.gaps == [0.5, 0.5] and len(tr.ttft) == 2
    assert tr.tokens == 4 and tr.reasons == {"length": 2} and len(tr.admit) == 2


def test_prefill_budget_is_passed_only_when_given(monkeypatch):
    class WithBudget:
        def __init__(self, model, prefill_budget: int = 512):
            pass

    class Without:
        def __init__(self, model):
            pass

    monkeypatch.setattr(bench_step.gx, "DecodeExecutor", WithBudget)
    assert bench_step.prefill_budget(None) == ({}, 512)
    assert bench_step.prefill_budget(64) == ({"prefill_budget": 64}, 64)
    monkeypatch.setattr(bench_step.gx, "DecodeExecutor", Without)
    assert bench_step.prefill_budget(None) == ({}, None)
    with pytest.raises(SystemExit, match="no prefill_budget"):
        bench_step.prefill_budget(64)


def test_churn_only_run_keeps_the_days_steady_rows(tmp_path):
    head = dict(device="Test GPU", date="2026-01-01", torch="t")
    path, _ = bench_step.write(dict(head, rows=[{"batch": 1}], churn={"old": 1}), str(tmp_path),
                               keep_rows=False)  # fmt: skip
    _, merged = bench_step.write(dict(head, torch="u", churn={"new": 1}), str(tmp_path),
                                 keep_rows=True)  # fmt: skip
    with open(path) as f:
        assert json.load(f) == merged == dict(head, torch="u", rows=[{"batch": 1}],
                                              churn={"new": 1})  # fmt: skip
    assert path.endswith("step-test-gpu-2026-01-01.json")
