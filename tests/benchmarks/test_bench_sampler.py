"""CPU tests of the sampler benchmark's tooling: bench_sampler.py (rows, the read floor,
the real shape's blocks, --append, --resume, --time-budget), the committed real rows, and
plot_sampler's tables and targets on synthetic results. Runs use the torch.* methods only
(the graphexec methods are slow under the Triton interpreter) and floor.read's torch.amax
stand-in (tests/benchmarks/test_bench_floor.py tests the kernel)."""

import glob
import json
import os

import bench_sampler  # noqa: E402
import plot_sampler  # noqa: E402
import pytest
import sampler_shapes  # noqa: E402
import torch

CPU_ARGS = ["--device", "cpu", "--vocab", "600", "--quick", "--methods", "torch.no_filter"]
F32 = ["--dtypes", "float32", "--shapes", "randn3"]
FL, NF = "floor.read", "torch.no_filter"


def run(tmp_path, *args: str, base=CPU_ARGS) -> dict:
    assert bench_sampler.main([*base, "--out", str(tmp_path), *args]) == 0
    (path,) = glob.glob(str(tmp_path / "sampler-cpu-*.json"))
    with open(path) as f:
        return json.load(f)


def by_key(result: dict) -> dict:
    keys = [bench_sampler.row_key(r) for r in result["rows"]]
    assert len(keys) == len(set(keys)), "one row per (method, B, V, dtype, shape)"
    return dict(zip(keys, result["rows"], strict=True))


def test_cpu_run_writes_one_row_per_method_dtype_batch_and_shape(tmp_path):
    result = run(tmp_path, "--batch", "1,2")  # the default dtypes: float32 and bfloat16
    rows = by_key(result)
    shapes = ("peaked", "randn3", "flat", "ties")
    dtypes = ("float32", "bfloat16")
    # floor.read once per (dtype, V, B) block, on its first shape; no real rows at V = 600
    assert set(rows) == {(NF, B, 600, d, s) for B in (1, 2) for d in dtypes for s in shapes} | {
        (FL, B, 600, d, "peaked") for B in (1, 2) for d in dtypes
    }
    for r in rows.values():
        assert "error" not in r and "warning" not in r
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["floor_us"] > 0
        floor = rows[(FL, r["B"], 600, r["dtype"], "peaked")]
        assert r["read_floor_us"] == floor["eager_us"]  # no graphs on the CPU: eager
    assert "torch.amax" in rows[(FL, 1, 600, "float32", "peaked")]["note"]
    # no instruction caches evicted off the GPU, and the file says so (run by run too)
    assert result["icache"] is None and result["runs"][-1]["icache"] is None
    assert "instruction caches" not in result["timing"] and result["flush"] is None
    f32 = rows[(NF, 2, 600, "float32", "flat")]["floor_us"]
    assert rows[(NF, 2, 600, "bfloat16", "flat")]["floor_us"] == pytest.approx(f32 / 2, abs=1.5e-3)
    assert list(result["methods"]) == [FL, NF]
    assert list(result["params"]["shapes"]) == list(shapes)
    assert len(result["runs"]) == 1 and result["runs"][0]["skipped"] == []


def test_shapes_are_what_they_say():
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
    with pytest.raises(ValueError, match="49152"):
        make_logits("real", 1, 600, torch.float32, dev)


def test_real_rows_are_committed_small_and_tiled():
    path = sampler_shapes.REAL_PATH
    assert os.path.getsize(path) < 6e6
    data = sampler_shapes.load_real()
    x, meta = data["logits"], data["meta"]
    n = x.shape[0]
    assert 48 <= n <= 64 and x.shape[1] == 49152 and x.dtype == torch.float16
    assert torch.isfinite(x).all()
    assert sorted(set(meta["temperature"])) == [0.7, 1.0]
    assert all(len(meta[k]) == n for k in ("temperature", "prompt_index", "step", "position"))
    assert len(set(meta["step"])) > 10  # mixed decode positions
    real = sampler_shapes.make_logits("real", n + 3, 49152, torch.bfloat16, torch.device("cpu"))
    assert real.shape == (n + 3, 49152) and real.dtype == torch.bfloat16
    assert torch.equal(real[n + 2], x[2].to(torch.bfloat16))  # row b is stored row b mod n


def test_real_blocks_sit_beside_the_synthetic_grid():
    plan = bench_sampler.plan_blocks(["float32"], [600], [1, 4], ["peaked", "flat"], real=True)
    two = ["peaked", "flat"]
    assert plan == [("float32", 600, 1, two), ("float32", 600, 4, two),
                    ("float32", 49152, 1, ["real"]), ("float32", 49152, 4, ["real"])]  # fmt: skip
    both = bench_sampler.plan_blocks(["bfloat16"], [49152], [2], ["ties"], real=True)
    assert both == [("bfloat16", 49152, 2, ["ties", "real"])]
    assert bench_sampler.plan_blocks(["float32"], [600], [1], [], real=False) == []


def test_real_shape_runs_at_its_vocabulary_only(tmp_path):
    base = ["--device", "cpu", "--quick", "--methods", NF, "--dtypes", "float32"]
    result = run(tmp_path, "--batch", "2", "--shapes", "real", base=base)  # 'real' turns it on
    assert set(by_key(result)) == {(FL, 2, 49152, "float32", "real"),
                                   (NF, 2, 49152, "float32", "real")}  # fmt: skip
    assert "SmolLM2" in result["params"]["shapes"]["real"]
    result = run(tmp_path, "--batch", "1", "--vocab", "600", "--shapes", "ties", "--real",
                 base=base)  # fmt: skip
    assert {k[2:] for k in by_key(result)} == {(600, "float32", "ties"), (49152, "float32", "real")}


def test_append_keeps_old_rows_and_replaces_same_key(tmp_path, capsys):
    first = run(tmp_path, "--batch", "1,2", *F32)
    (path,) = glob.glob(str(tmp_path / "sampler-cpu-*.json"))
    b1, b2 = (NF, 1, 600, "float32", "randn3"), (NF, 2, 600, "float32", "randn3")
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
    floors = {(FL, B, 600, "float32", "randn3") for B in (1, 2)}
    assert set(rows) == {b1, b2, ("x.other", 5, 600, "float32", "randn3")} | floors
    assert rows[b1] == old_b1  # kept as it was
    assert rows[b2]["eager_us"] > 0  # replaced by the new measurement
    assert second["first_call_s"]["x.other"] == 9.0 and NF in second["first_call_s"]
    assert len(second["runs"]) == 2 and "--append" in second["runs"][1]["argv"]
    assert "--append: extending" in capsys.readouterr().out

    # --resume skips blocks that already have a row for every selected method and shape
    third = run(tmp_path, "--batch", "1,2", *F32, "--resume")
    assert third["rows"] == second["rows"]
    assert "--resume: 2 blocks already in the file: float32 V=600 B=1,2" in capsys.readouterr().out
    # a block without its floor.read row is not done
    with open(path, "w") as f:
        json.dump(dict(third, rows=[r for r in third["rows"] if (r["method"], r["B"]) != (FL, 2)]),
                  f)  # fmt: skip
    fourth = run(tmp_path, "--batch", "1,2", *F32, "--resume")
    assert (FL, 2, 600, "float32", "randn3") in by_key(fourth)
    assert "--resume: 1 blocks already in the file: float32 V=600 B=1" in capsys.readouterr().out

    # without --append the file is rewritten from this run's rows only
    fifth = run(tmp_path, "--batch", "2", *F32)
    assert set(by_key(fifth)) == {b2, (FL, 2, 600, "float32", "randn3")}
    assert len(fifth["runs"]) == 1


def test_time_budget_skips_blocks_and_still_writes(tmp_path, capsys):
    run(tmp_path, "--batch", "1", *F32)
    args = ["--batch", "1,4", "--dtypes", "float32,bfloat16", "--shapes", "randn3", "--append",
            "--time-budget", "0"]  # fmt: skip
    result = run(tmp_path, *args)
    assert {k[0] for k in by_key(result)} == {FL, NF}
    assert {k[1:] for k in by_key(result)} == {(1, 600, "float32", "randn3")}
    skipped = [["float32", 600, 1], ["float32", 600, 4], ["bfloat16", 600, 1], ["bfloat16", 600, 4]]
    assert result["runs"][-1]["skipped"] == skipped
    out = capsys.readouterr().out
    assert "skipped 4 blocks: float32 V=600 B=1,4; bfloat16 V=600 B=1,4" in out


# ----------------------------------------------------------------------------- targets

GX, BASE = "graphexec.", "graphexec.top_k_top_p"
BIG = (128256, 151936)
POINTS = [(B, V, s) for V in BIG for B in (1, 128, 256) for s in ("peaked", "randn3", "flat")]
POINTS += [(B, 49152, "real") for B in (1, 128)]


def floor(B: int, V: int) -> float:
    return 0.2 if B == 1 else B / 128 * V / 6400


def row(method, B, V, us, shape, dtype="float32") -> dict:
    r = dict(method=method, B=B, V=V, dtype=dtype, shape=shape, eager_us=None, graph_us=us,
             read_floor_us=floor(B, V), floor_us=2 * floor(B, V))  # fmt: skip
    return r if us is not None else dict(r, error="boom")


def synthetic() -> dict:
    """Against floor.read (floor_us is twice it, unused): no_filter 1.12x on real, 1.25x on
    flat; top_k_top_p 1.5x, 2.6x at one flat point; +logprobs20 0.35x; min_p at V = 128256
    only; top_p nowhere; cake 3x slower than top_k_top_p, 2x at one point."""
    rows = []
    for B, V, s in POINTS:
        f = floor(B, V)
        if s == "peaked" or V == 49152:
            rows.append(row(FL, B, V, f, s))
        nf = {"real": 1.12, "flat": 1.25}.get(s, 1.1)
        tk = 2.6 if (B, V, s) == (128, 151936, "flat") else 1.5
        rows += [row(GX + "no_filter", B, V, 7.5 if B == 1 else nf * f, s),
                 row(BASE, B, V, 11.0 if B == 1 else tk * f, s)]  # fmt: skip
        lp = 2.5 if B == 1 else 0.35 * f
        rows.append(row(BASE + "+logprobs20", B, V, rows[-1]["graph_us"] + lp, s))
        cake = rows[-2]["graph_us"] * (2.0 if (B, V, s) == (256, 151936, "flat") else 3.0)
        rows.append(row("flashinfer.cake", B, V, cake, s))
        if V == 128256:
            rows.append(row(GX + "min_p", B, V, 9.0 if B == 1 else 1.25 * f, s))
            rows.append(row("flashinfer.min_p", B, V, 10.0 if B == 1 else 3.0 * f, s))
    rows += [row(FL, 128, 128256, 20.0, "peaked", "bfloat16"),
             row(BASE, 128, 128256, 40.0, "peaked", "bfloat16"),
             row("flashinfer.cake", 128, 128256, None, "peaked", "bfloat16")]  # fmt: skip
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


TYP, WORST, ONE, EVERY = ("B >= 128, peaked / real", "B >= 128, every shape",
                          "B = 1, every shape", "every (B, V, shape)")  # fmt: skip


def test_targets_are_the_issues_against_the_read_floor():
    text = plot_sampler.targets_table(synthetic())
    t = parse(text)["float32"]
    nf = "`graphexec.no_filter`"
    assert (nf, TYP) not in t  # one limit on every shape
    assert t[(nf, WORST)] == ("<= 1.2x floor", "1.25x floor at B=128, V=128256, flat", "no")
    assert t[(nf, ONE)] == ("<= 8 us", "7.5 us at B=1, V=49152, real", "yes")
    limit, got, met = t[(f"`{BASE}`", TYP)]  # 1.5x at every peaked / real point
    assert (limit, got[:15], met) == ("<= 2x floor", "1.50x floor at ", "yes")
    assert t[(f"`{BASE}`", WORST)] == ("<= 3x floor", "2.60x floor at B=128, V=151936, flat",
                                       "yes")  # fmt: skip
    assert t[(f"`{BASE}`", ONE)][0] == "<= 15 us"
    assert t[("`graphexec.top_p`", WORST)] == ("<= 3x floor", "not measured", "not measured")
    # partly measured and within the limit: not met, the missing points counted
    assert t[("`graphexec.min_p`", TYP)] == (
        "<= 2x floor", "1.25x floor at B=128, V=128256, peaked; 3 not measured",
        "no")  # fmt: skip
    assert t[("`graphexec.min_p`", WORST)][0] == "<= 3x floor"
    assert t[("`graphexec.min_p`", ONE)] == (
        "<= 15 us", "9.0 us at B=1, V=128256, peaked; 4 not measured", "no")  # fmt: skip
    lp = f"`+logprobs20` over `{BASE}`"
    assert (lp, TYP) not in t and t[(lp, WORST)][0] == "<= 0.5x floor"
    assert t[(lp, WORST)][2] == "yes" and t[(lp, WORST)][1].startswith("0.35x floor")
    # speed-ups point by point, against the fastest FlashInfer method for the filter
    peers = "`flashinfer.cake`, `flashinfer.top_k_top_p_from_logits`"
    assert t[(f"`{BASE}` vs fastest of {peers}", EVERY)] == (
        ">= 1.2x faster", "2.00x at B=256, V=151936, flat", "yes")  # fmt: skip
    mp = t[("`graphexec.min_p` vs fastest of `flashinfer.min_p`", EVERY)]
    assert mp[1:] == ("1.11x at B=1, V=128256, peaked", "no")  # 10 vs 9 us
    assert t[("`graphexec.top_p` vs fastest of `flashinfer.top_p`", EVERY)][1] == "not measured"
    assert text.splitlines()[0].startswith("Targets, float32 logits, CUDA-graph replay, floor = "
                                           "floor.read, on Test GPU, 2026-01-01: ")  # fmt: skip
    assert parse(text)["bfloat16"][(f"`{BASE}` vs fastest of {peers}", EVERY)][2] == "not measured"


def test_old_files_fall_back_to_the_copy_floor():
    old = synthetic()
    old["rows"] = [dict(r, read_floor_us=None) for r in old["rows"] if r["method"] != FL]
    text = plot_sampler.targets_table(old)
    assert "floor = copy-bandwidth floor (no floor.read in this file)" in text
    t = parse(text)["float32"]  # floor_us is twice floor.read: every ratio halves
    assert t[("`graphexec.no_filter`", WORST)][1:] == ("0.62x floor at B=128, V=128256, flat",
                                                       "yes")  # fmt: skip
    # a floor.read that failed everywhere: the same fallback, and the heading says so
    failed = dict(old, rows=old["rows"] + [dict(row(FL, 128, 128256, None, "peaked"),
                                                read_floor_us=None)])  # fmt: skip
    assert plot_sampler.targets_table(failed) == text


def test_a_row_is_divided_by_the_floor_of_its_own_run():
    """A later run appended to the file re-timed floor.read at one point (half the first
    run's) and one method there: that method's ratio uses the later floor, every other row
    its own run's (with the least floor they would double); the floor line shows the least."""
    V, B = 49152, 128
    f = floor(B, V)
    redone = {(FL, V, B), (GX + "no_filter", V, B)}
    rows = [r for r in synthetic()["rows"] if (r["method"], r["V"], r["B"]) not in redone]
    rows += [row(FL, B, V, f / 2, "real"),
             dict(row(GX + "no_filter", B, V, 0.6 * f, "real"), read_floor_us=f / 2)]
    res = dict(synthetic(), rows=rows)
    table = plot_sampler.markdown_table(res, V).splitlines()
    assert table[4] == f"| floor.read | 0.2 | {f / 2:.1f} |"
    assert next(x for x in table if x.startswith(f"| {GX}no_filter |")).endswith(
        "| 4.6 (1.20x) real |")  # fmt: skip
    assert next(x for x in table if x.startswith(f"| {BASE} |")).endswith("(1.50x) real |")
    t = parse(plot_sampler.targets_table(res))["float32"]
    assert t[(f"`{BASE}`", TYP)][1].startswith("1.50x floor at ")


def test_markdown_names_the_worst_shape_and_both_floors():
    table = plot_sampler.markdown_table(synthetic(), 151936).splitlines()
    assert table[0] == "float32, V = 151936, graph_us: worst over shapes, us (x floor.read)"
    assert table[4] == "| floor.read | 0.2 | 23.7 | 47.5 |"
    assert table[5] == "| bytes / copy bandwidth | 0.4 | 47.5 | 95.0 |"
    line = next(x for x in table if x.startswith(f"| {BASE} |"))
    assert "(2.60x) flat" in line and FL not in "".join(table[6:])
    assert "error" in plot_sampler.markdown_table(synthetic(), 128256, "bfloat16")


def test_plot_sampler_targets_cli_needs_no_matplotlib(tmp_path, capsys):
    path = tmp_path / "sampler-test.json"
    path.write_text(json.dumps(synthetic()))
    assert plot_sampler.main([str(path), "--targets", "--no-png"]) == 0
    assert capsys.readouterr().out.strip() == plot_sampler.targets_table(synthetic())
    assert not list(tmp_path.glob("*.png"))


def test_a_profile_keeps_the_sampler_kernels_of_replays_prepared_as_timed_calls(monkeypatch):
    """profile_kernels hands kernel_spans the timer's preparation (run before each replay)
    and a filter that keeps the sampler's kernels, not the flush's reduction; each kernel
    becomes a row entry (CUDA itself is not needed to check the wiring)."""
    import sampler_methods
    import step_profile

    seen = {}

    def spans(graph, reps, before, keep):
        seen.update(graph=graph, reps=reps, before=before, keep=keep)
        return [("_stats_kernel", 30.123, 29.877, 0.0), ("_tail_kernel", 5.0, 4.0, 1.0)]

    monkeypatch.setattr(step_profile, "kernel_spans", spans)
    timer = bench_sampler.Timer(torch.device("cpu"), quick=True)
    out = sampler_methods.profile_kernels("g", timer, reps=3)
    assert out == [dict(name="_stats_kernel", us=30.12, own_us=29.88),
                   dict(name="_tail_kernel", us=5.0, own_us=4.0)]  # fmt: skip
    assert seen["graph"] == "g" and seen["reps"] == 3 and seen["before"] == timer.prepare
    keep = seen["keep"]
    assert keep("_stats_kernel") and keep("_kept_kernel_0d1d") and keep("_raw_logprobs_kernel")
    assert not keep("void at::native::reduce_kernel<512, 1>") and not keep("_inputs_kernel")


def test_sampler_config_overrides_are_checked_and_reach_the_triton_rows(monkeypatch):
    import argparse

    import sampler_methods

    from graphexec.sampling.triton import sampler_config as sc

    parse = bench_sampler.sampler_config
    assert parse("tile_blocks=4, num_warps=8,pdl=false") == dict(tile_blocks=4, num_warps=8,
                                                                 pdl=False)  # fmt: skip
    assert parse("") == {}
    for bad, why in (("tile_blocks=3", "tile_blocks must be a power of two"),
                     ("warps=4", "warps"), ("num_warps", "not K=V"),
                     ("num_warps=four", "num_warps: 'four'"),
                     ("stats_registers=8", "stats_registers must be 0 or in 16..255"),
                     ("draw_block=512", "part of the tokens' definition")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse(bad)
    seen = []

    def allocate(B, V, device, cfg, logprobs=False):
        seen.append(cfg)
        raise RuntimeError("stop")

    monkeypatch.setattr(sc.Workspace, "allocate", allocate)
    case = sampler_methods.Case(torch.zeros(2, 64), 2, 64, torch.device("cpu"), "triton",
                                "flat", dict(tile_blocks=2, num_warps=2))  # fmt: skip
    with pytest.raises(RuntimeError, match="stop"):
        sampler_methods._gx(dict(temperature=0.8))(case)
    assert (seen[0].tile_blocks, seen[0].num_warps) == (2, 2)
    assert seen[0].programs == sc.SamplerConfig.default().programs
