"""CPU tests of the benchmark tooling: bench_sampler.py (rows, --append, --resume,
--time-budget) and plot_sampler.targets_table (only torch.* methods and synthetic results;
the graphexec methods are slow under the Triton interpreter); the churn loop of
step_churn.py (bench_step.py --scenario churn) on a small TableModel executor (its numbers
are not performance, only its bookkeeping)."""

import glob
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_sampler  # noqa: E402
import bench_step  # noqa: E402
import plot_sampler  # noqa: E402
import step_churn  # noqa: E402

CPU_ARGS = ["--device", "cpu", "--vocab", "600", "--quick", "--methods", "torch.no_filter"]
F32 = ["--dtypes", "float32", "--shapes", "randn3"]


def run(tmp_path, *args: str) -> dict:
    assert bench_sampler.main([*CPU_ARGS, "--out", str(tmp_path), *args]) == 0
    (path,) = glob.glob(str(tmp_path / "sampler-cpu-*.json"))
    with open(path) as f:
        return json.load(f)


def by_key(result: dict) -> dict:
    keys = [bench_sampler.row_key(r) for r in result["rows"]]
    assert len(keys) == len(set(keys)), "one row per (method, B, V, dtype, shape)"
    return dict(zip(keys, result["rows"], strict=True))


def test_cpu_run_writes_one_row_per_method_dtype_batch_and_shape(tmp_path):
    result = run(tmp_path, "--batch", "1,2", "--dtypes", "float32,bfloat16")
    rows = by_key(result)
    shapes = ("peaked", "randn3", "flat", "ties")
    assert set(rows) == {("torch.no_filter", B, 600, d, s) for B in (1, 2)
                         for d in ("float32", "bfloat16") for s in shapes}  # fmt: skip
    for r in rows.values():
        assert "error" not in r and "warning" not in r
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["floor_us"] > 0
    # no instruction caches evicted off the GPU, and the file says so (run by run too)
    assert result["icache"] is None and result["runs"][-1]["icache"] is None
    assert "instruction caches" not in result["timing"]
    f32 = rows[("torch.no_filter", 2, 600, "float32", "flat")]["floor_us"]
    assert rows[("torch.no_filter", 2, 600, "bfloat16", "flat")]["floor_us"] == pytest.approx(
        f32 / 2, abs=1.5e-3
    )  # bf16 logits: 2 bytes per element
    assert list(result["methods"]) == ["torch.no_filter"]
    assert list(result["params"]["shapes"]) == list(shapes)
    assert len(result["runs"]) == 1 and result["runs"][0]["skipped"] == []


def test_shapes_are_what_they_say():
    import torch
    from sampler_methods import make_logits

    dev = torch.device("cpu")
    flat = make_logits("flat", 2, 4000, torch.float32, dev) / 0.8
    p = torch.softmax(flat, -1)
    assert ((p / p.max(-1, keepdim=True).values) >= 0.05).float().mean() > 0.5  # min-p 0.05
    kept = (torch.sort(p, -1, descending=True).values.cumsum(-1) < 0.9).float().mean()
    assert kept > 0.5  # top-p 0.9 keeps more than half
    assert (make_logits("ties", 2, 50, torch.float32, dev) == 1.0).all()
    peaked = make_logits("peaked", 1, 1000, torch.float32, dev)[0]
    assert torch.allclose(torch.sort(peaked, descending=True).values,
                          -2 * torch.log(torch.arange(1, 1001.0)))  # fmt: skip
    with pytest.raises(ValueError, match="shape"):
        make_logits("round", 1, 10, torch.float32, dev)


def test_default_dtype_is_float32(tmp_path):
    rows = by_key(run(tmp_path, "--batch", "1", "--shapes", "ties"))
    assert set(rows) == {("torch.no_filter", 1, 600, "float32", "ties")}


def test_append_keeps_old_rows_and_replaces_same_key(tmp_path, capsys):
    first = run(tmp_path, "--batch", "1,2", *F32)
    (path,) = glob.glob(str(tmp_path / "sampler-cpu-*.json"))
    b1 = ("torch.no_filter", 1, 600, "float32", "randn3")
    b2 = ("torch.no_filter", 2, 600, "float32", "randn3")
    other = dict(method="x.other", B=5, V=600, dtype="float32", shape="randn3", eager_us=1.0,
                 graph_us=2.0)  # fmt: skip
    for r in first["rows"]:
        if bench_sampler.row_key(r) == b2:
            r["eager_us"] = -1.0  # a marker: must be replaced
    first["rows"].append(dict(other, floor_us=0.5))
    first["first_call_s"]["x.other"] = 9.0
    with open(path, "w") as f:
        json.dump(first, f)
    old_b1 = by_key(first)[b1]

    second = run(tmp_path, "--batch", "2", *F32, "--append")
    rows = by_key(second)
    assert set(rows) == {b1, b2, ("x.other", 5, 600, "float32", "randn3")}
    assert rows[b1] == old_b1  # kept as it was
    assert rows[b2]["eager_us"] > 0  # replaced by the new measurement
    assert second["first_call_s"]["x.other"] == 9.0 and "torch.no_filter" in second["first_call_s"]
    assert len(second["runs"]) == 2 and "--append" in second["runs"][1]["argv"]
    assert "--append: extending" in capsys.readouterr().out

    # --resume skips blocks that already have a row for every selected method and shape
    third = run(tmp_path, "--batch", "1,2", *F32, "--resume")
    assert third["rows"] == second["rows"]
    assert "--resume: 2 blocks already in the file: float32 V=600 B=1,2" in capsys.readouterr().out

    # without --append the file is rewritten from this run's rows only
    fourth = run(tmp_path, "--batch", "2", *F32)
    assert set(by_key(fourth)) == {b2} and len(fourth["runs"]) == 1


def test_time_budget_skips_blocks_and_still_writes(tmp_path, capsys):
    run(tmp_path, "--batch", "1", *F32)
    args = ["--batch", "1,4", "--dtypes", "float32,bfloat16", "--shapes", "randn3", "--append",
            "--time-budget", "0"]  # fmt: skip
    result = run(tmp_path, *args)
    assert set(by_key(result)) == {("torch.no_filter", 1, 600, "float32", "randn3")}
    skipped = [["float32", 600, 1], ["float32", 600, 4], ["bfloat16", 600, 1], ["bfloat16", 600, 4]]
    assert result["runs"][-1]["skipped"] == skipped
    out = capsys.readouterr().out
    assert "skipped 4 blocks: float32 V=600 B=1,4; bfloat16 V=600 B=1,4" in out


# ----------------------------------------------------------------------------- targets

GX, BASE = "graphexec.", "graphexec.top_k_top_p"
GRID = [(B, V) for V in (128256, 151936) for B in (1, 128, 256)]


def floor(B: int, V: int) -> float:
    return 0.2 if B == 1 else B / 128 * (20.0 if V == 128256 else 24.0)


def row(method, B, V, us, shape="randn3", dtype="float32") -> dict:
    r = dict(method=method, B=B, V=V, dtype=dtype, shape=shape, eager_us=None, graph_us=us,
             floor_us=floor(B, V))  # fmt: skip
    return r if us is not None else dict(r, error="boom")


def synthetic() -> dict:
    """no_filter: 1.25x floor worst (flat); top_k_top_p: 2.6x at one point on ties;
    top_p / min_p: V = 151936 missing; +logprobs20 0.35x; cake 2x slower at its worst."""
    rows = []
    for B, V in GRID:
        f = floor(B, V)
        for shape in ("randn3", "flat", "ties"):
            nf = 7.5 if B == 1 else (1.25 if shape == "flat" else 1.1) * f
            tk = 11.0 if B == 1 else (2.6 if (B, V, shape) == (128, 151936, "ties") else 1.8) * f
            rows += [row(GX + "no_filter", B, V, nf, shape), row(BASE, B, V, tk, shape)]
            lp = 2.5 if B == 1 else 0.35 * f
            rows.append(row(BASE + "+logprobs20", B, V, tk + lp, shape))
            cake = tk * (2.0 if (B, V, shape) == (256, 151936, "flat") else 3.0)
            rows.append(row("flashinfer.cake", B, V, cake, shape))
            if V == 128256:
                rows.append(row(GX + "min_p", B, V, 20.0 if B == 1 else 1.7 * f, shape))
                rows.append(row("flashinfer.min_p", B, V, 25.0 if B == 1 else 3.0 * f, shape))
    rows += [row(BASE, 128, 128256, 40.0, dtype="bfloat16"),
             row("flashinfer.cake", 128, 128256, None, dtype="bfloat16")]  # fmt: skip
    return dict(device="Test GPU", date="2026-01-01", rows=rows)


def parse(text: str) -> dict[str, dict[tuple[str, str], tuple[str, str, str]]]:
    """{dtype: {(target, where): (limit, measured, met)}} from targets_table's text."""
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("Targets, "):
            table = out.setdefault(line.split(", ")[1].split()[0], {})
        elif line.startswith("| `"):
            c = [x.strip() for x in line.strip("|").split(" | ")]
            table[(c[0], c[1])] = (c[2], c[3], c[4])
    return out


def test_targets_are_judged_on_the_worst_shape():
    text = plot_sampler.targets_table(synthetic())
    t = parse(text)["float32"]
    big, one, every = ("B >= 128, V in {128256, 151936}", "B = 1, V in {128256, 151936}",
                       "every (B, V, shape)")  # fmt: skip
    assert t[("`graphexec.no_filter`", big)] == ("<= 1.3x floor", "1.25x floor at B=128, "
                                                 "V=128256", "yes")  # fmt: skip
    assert t[("`graphexec.no_filter`", one)] == ("<= 8 us", "7.5 us at B=1, V=128256", "yes")
    assert t[(f"`{BASE}`", big)] == ("<= 2x floor", "2.60x floor at B=128, V=151936", "no")
    assert t[("`graphexec.top_p`", big)] == ("<= 2.5x floor", "not measured", "not measured")
    # partly measured and within the limit: not met, the missing points counted
    assert t[("`graphexec.min_p`", big)] == (
        "<= 2x floor",
        "1.70x floor at B=128, V=128256; 2 not measured",
        "no",
    )
    assert t[("`graphexec.min_p`", one)] == (
        "<= 12 us",
        "20.0 us at B=1, V=128256; 1 not measured",
        "no",
    )
    lp = f"`+logprobs20` over `{BASE}`"
    assert t[(lp, big)][2] == "yes" and t[(lp, big)][1].startswith("0.35x floor")
    # speed-ups shape by shape, against the fastest FlashInfer method for the filter:
    # cake's worst is 2.0x (flat, B = 256, V = 151936): met
    peers = "`flashinfer.cake`, `flashinfer.top_k_top_p_from_logits`"
    assert t[(f"`{BASE}` vs fastest of {peers}", every)] == (
        ">= 1.5x faster",
        "2.00x at B=256, V=151936, flat",
        "yes",
    )
    # min-p: 1.76x at B >= 128 but 1.25x at B = 1 (25 vs 20 us): not met
    assert t[("`graphexec.min_p` vs fastest of `flashinfer.min_p`", every)][1:] == (
        "1.25x at B=1, V=128256, flat",
        "no",
    )
    assert t[("`graphexec.top_p` vs fastest of `flashinfer.top_p`", every)][1] == "not measured"
    assert text.splitlines()[0].startswith("Targets, float32 logits, CUDA-graph replay, worst "
                                           "shape, on Test GPU, 2026-01-01: ")  # fmt: skip
    assert parse(text)["bfloat16"][(f"`{BASE}` vs fastest of {peers}", every)][2] == "not measured"


def test_markdown_names_the_worst_shape():
    table = plot_sampler.markdown_table(synthetic(), 151936)
    line = next(x for x in table.splitlines() if x.startswith(f"| {BASE} |"))
    assert "(2.60x) ties" in line
    assert "error" in plot_sampler.markdown_table(synthetic(), 128256, "bfloat16")


def test_plot_sampler_targets_cli_needs_no_matplotlib(tmp_path, capsys):
    path = tmp_path / "sampler-test.json"
    path.write_text(json.dumps(synthetic()))
    assert plot_sampler.main([str(path), "--targets", "--no-png"]) == 0
    assert capsys.readouterr().out.strip() == plot_sampler.targets_table(synthetic())
    assert not list(tmp_path.glob("*.png"))


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
