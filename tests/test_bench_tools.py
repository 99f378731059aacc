"""CPU tests of the sampler benchmark tooling: bench_sampler.py (rows, --append, --resume,
--time-budget) and plot_sampler.targets_table. Only torch.* methods and synthetic results;
the graphexec methods are not run here (they are slow under the Triton interpreter)."""

import glob
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_sampler  # noqa: E402
import plot_sampler  # noqa: E402

CPU_ARGS = ["--device", "cpu", "--vocab", "600", "--quick", "--methods", "torch.no_filter"]


def run(tmp_path, *args: str) -> dict:
    assert bench_sampler.main([*CPU_ARGS, "--out", str(tmp_path), *args]) == 0
    (path,) = glob.glob(str(tmp_path / "sampler-cpu-*.json"))
    with open(path) as f:
        return json.load(f)


def by_key(result: dict) -> dict:
    keys = [bench_sampler.row_key(r) for r in result["rows"]]
    assert len(keys) == len(set(keys)), "one row per (method, B, V, dtype)"
    return dict(zip(keys, result["rows"], strict=True))


def test_cpu_run_writes_one_row_per_method_dtype_and_batch(tmp_path):
    result = run(tmp_path, "--batch", "1,2", "--dtypes", "float32,bfloat16")
    rows = by_key(result)
    assert set(rows) == {
        ("torch.no_filter", B, 600, d) for B in (1, 2) for d in ("float32", "bfloat16")
    }
    for r in rows.values():
        assert "error" not in r and "warning" not in r
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["floor_us"] > 0
    # no instruction caches evicted off the GPU, and the file says so (run by run too)
    assert result["icache"] is None and result["runs"][-1]["icache"] is None
    assert "instruction caches" not in result["timing"]
    f32 = rows[("torch.no_filter", 2, 600, "float32")]["floor_us"]
    assert rows[("torch.no_filter", 2, 600, "bfloat16")]["floor_us"] == pytest.approx(
        f32 / 2, abs=1.5e-3
    )  # bf16 logits: 2 bytes per element
    assert rows[("torch.no_filter", 1, 600, "float32")]["floor_us"] == pytest.approx(
        f32 / 2, abs=1.5e-3
    )
    assert list(result["methods"]) == ["torch.no_filter"]
    assert len(result["runs"]) == 1 and result["runs"][0]["skipped"] == []


def test_default_dtypes_are_float32_and_bfloat16(tmp_path):
    rows = by_key(run(tmp_path, "--batch", "1"))
    assert set(rows) == {("torch.no_filter", 1, 600, d) for d in ("float32", "bfloat16")}


def test_append_keeps_old_rows_and_replaces_same_key(tmp_path, capsys):
    first = run(tmp_path, "--batch", "1,2", "--dtypes", "float32")
    (path,) = glob.glob(str(tmp_path / "sampler-cpu-*.json"))
    b1 = ("torch.no_filter", 1, 600, "float32")
    b2 = ("torch.no_filter", 2, 600, "float32")
    other = dict(method="x.other", B=5, V=600, dtype="float32", eager_us=1.0, graph_us=2.0)
    for r in first["rows"]:
        if bench_sampler.row_key(r) == b2:
            r["eager_us"] = -1.0  # a marker: must be replaced
    first["rows"].append(dict(other, floor_us=0.5))
    first["first_call_s"]["x.other"] = 9.0
    with open(path, "w") as f:
        json.dump(first, f)
    old_b1 = by_key(first)[b1]

    second = run(tmp_path, "--batch", "2", "--dtypes", "float32", "--append")
    rows = by_key(second)
    assert set(rows) == {b1, b2, ("x.other", 5, 600, "float32")}
    assert rows[b1] == old_b1  # kept as it was
    assert rows[b2]["eager_us"] > 0  # replaced by the new measurement
    assert rows[("x.other", 5, 600, "float32")]["graph_us"] == 2.0
    assert second["first_call_s"]["x.other"] == 9.0 and "torch.no_filter" in second["first_call_s"]
    assert len(second["runs"]) == 2 and "--append" in second["runs"][1]["argv"]
    assert "--append: extending" in capsys.readouterr().out

    # --resume skips blocks that already have a row for every selected method
    third = run(tmp_path, "--batch", "1,2", "--dtypes", "float32", "--resume")
    assert third["rows"] == second["rows"]
    assert "--resume: 2 blocks already in the file: float32 V=600 B=1,2" in capsys.readouterr().out

    # without --append the file is rewritten from this run's rows only
    fourth = run(tmp_path, "--batch", "2", "--dtypes", "float32")
    assert set(by_key(fourth)) == {b2} and len(fourth["runs"]) == 1


def test_time_budget_skips_blocks_and_still_writes(tmp_path, capsys):
    run(tmp_path, "--batch", "1", "--dtypes", "float32")
    args = ["--batch", "1,4", "--dtypes", "float32,bfloat16", "--append", "--time-budget", "0"]
    result = run(tmp_path, *args)
    assert set(by_key(result)) == {("torch.no_filter", 1, 600, "float32")}
    skipped = [["float32", 600, 1], ["float32", 600, 4], ["bfloat16", 600, 1], ["bfloat16", 600, 4]]
    assert result["runs"][-1]["skipped"] == skipped
    out = capsys.readouterr().out
    assert "skipped 4 blocks: float32 V=600 B=1,4; bfloat16 V=600 B=1,4" in out


# ----------------------------------------------------------------------------- targets

GX, BASE = "graphexec.", "graphexec.top_k_top_p"
GRID = [(B, V) for V in (128256, 151936) for B in (1, 128, 256)]


def floor(B: int, V: int) -> float:
    return 0.2 if B == 1 else B / 128 * (20.0 if V == 128256 else 24.0)


def row(method: str, B: int, V: int, us: float | None, dtype: str = "float32") -> dict:
    r = dict(method=method, B=B, V=V, dtype=dtype, eager_us=None, graph_us=us)
    r["floor_us"] = floor(B, V)
    return r if us is not None else dict(r, error="boom")


def synthetic() -> dict:
    rows = []
    for B, V in GRID:
        f = floor(B, V)
        nf = 9.0 if B == 1 else (1.45 if (B, V) == (256, 151936) else 1.4) * f
        tk = 11.0 if B == 1 else (2.6 if (B, V) == (128, 151936) else 1.8) * f
        rows += [row(GX + "no_filter", B, V, nf), row(BASE, B, V, tk)]
        lp = 2.5 if B == 1 else (0.35 if (B, V) == (256, 128256) else 0.3) * f
        rows.append(row(BASE + "+logprobs20", B, V, tk + lp))
        if V == 128256:  # min_p: V = 151936 missing
            rows.append(row(GX + "min_p", B, V, 20.0 if B == 1 else (1.5 if B == 128 else 1.7) * f))
        rows.append(row("flashinfer.cake", B, V, tk * (2.0 if (B, V) == (256, 151936) else 3.0)))
        if (B, V) != (1, 128256):
            fi = 5.5 if (B, V) == (256, 151936) else 6.0
            rows.append(row("flashinfer.top_k_top_p_from_logits", B, V, tk * fi))
    # bfloat16: one point; cake only 1.5x slower there; FlashInfer rows all failed
    rows += [
        row(BASE, 128, 128256, 40.0, "bfloat16"),
        row("flashinfer.cake", 128, 128256, 60.0, "bfloat16"),
        row("flashinfer.top_k_top_p_from_logits", 128, 128256, None, "bfloat16"),
    ]
    return dict(device="Test GPU", date="2026-01-01", rows=rows)


def parse(text: str) -> dict[str, dict[tuple[str, str], tuple[str, str, str]]]:
    """{dtype: {(target, where): (limit, measured, met)}} from targets_table's text."""
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("Issue 4 targets, "):
            table = out.setdefault(line.split(", ")[1].split()[0], {})
        elif line.startswith("| `"):
            c = [x.strip() for x in line.strip("|").split(" | ")]
            table[(c[0], c[1])] = (c[2], c[3], c[4])
    assert all(len(t) == 14 for t in out.values())
    return out


def test_targets_table_cells():
    text = plot_sampler.targets_table(synthetic())
    tables = parse(text)
    assert list(tables) == ["float32", "bfloat16"]
    t = tables["float32"]
    big, one, every = "B >= 128, V in {128256, 151936}", "B = 1, V = 128256", "every (B, V)"
    assert t[("`graphexec.no_filter`", big)] == (
        "<= 1.5x floor",
        "1.45x floor at B=256, V=151936",
        "yes",
    )
    assert t[("`graphexec.no_filter`", one)] == ("<= 10 us", "9.0 us at B=1, V=128256", "yes")
    assert t[(f"`{BASE}`", big)] == ("<= 2x floor", "2.60x floor at B=128, V=151936", "no")
    assert t[(f"`{BASE}`", one)] == ("<= 12 us", "11.0 us at B=1, V=128256", "yes")
    assert t[("`graphexec.top_p`", big)] == ("<= 2.5x floor", "not measured", "not measured")
    assert t[("`graphexec.top_p`", one)] == ("<= 15 us", "not measured", "not measured")
    # partly measured and within the limit: not met, the missing points are named
    assert t[("`graphexec.min_p`", big)] == (
        "<= 2x floor",
        "1.70x floor at B=256, V=128256; not measured at B=128, V=151936; B=256, V=151936",
        "not measured",
    )
    assert t[("`graphexec.min_p`", one)] == ("<= 12 us", "20.0 us at B=1, V=128256", "no")
    lp = f"`+logprobs20` (`{BASE}+logprobs20` - `{BASE}`)"
    assert t[(lp, big)] == ("<= 0.5x floor", "0.35x floor at B=256, V=128256", "yes")
    assert t[(lp, one)] == ("<= 3 us", "2.5 us at B=1, V=128256", "yes")
    bm = f"`+bitmask` (`{BASE}+bitmask` - `{BASE}`)"
    assert t[(bm, big)] == ("<= 0.2x floor", "not measured", "not measured")
    assert t[(bm, one)] == ("<= 2 us", "not measured", "not measured")
    # the speed-up rules: worst over every (B, V) of the grid; exactly 2x meets ">= 2x"
    assert t[(f"`{BASE}` vs `flashinfer.cake`", every)] == (
        ">= 2x faster",
        "2.00x at B=256, V=151936",
        "yes",
    )
    assert t[(f"`{BASE}` vs `flashinfer.top_k_top_p_from_logits`", every)] == (
        ">= 5x faster",
        "5.50x at B=256, V=151936; not measured at B=1, V=128256",
        "not measured",
    )
    assert text.splitlines()[0] == (
        "Issue 4 targets, float32 logits, CUDA-graph replay (graph_us) on Test GPU, "
        "2026-01-01: 6 of 14 met"
    )
    b = tables["bfloat16"]
    assert b[(f"`{BASE}` vs `flashinfer.cake`", every)] == (
        ">= 2x faster",
        "1.50x at B=128, V=128256",
        "no",
    )
    assert b[(f"`{BASE}` vs `flashinfer.top_k_top_p_from_logits`", every)] == (
        ">= 5x faster",
        "not measured",
        "not measured",
    )
    assert b[(f"`{BASE}`", one)] == ("<= 12 us", "not measured", "not measured")


def test_plot_sampler_targets_cli_needs_no_matplotlib(tmp_path, capsys):
    path = tmp_path / "sampler-test.json"
    path.write_text(json.dumps(synthetic()))
    assert plot_sampler.main([str(path), "--targets", "--no-png"]) == 0
    assert capsys.readouterr().out.strip() == plot_sampler.targets_table(synthetic())
    assert not list(tmp_path.glob("*.png"))
