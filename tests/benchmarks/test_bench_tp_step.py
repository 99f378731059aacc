"""benchmarks/bench_tp_step.py end to end on the CPU (gloo, float32, a tiny Llama config):
each world's rows, the speedup over T = 1 and the collectives' time; its numbers are not
performance, only its rows and columns."""

import json

from tests.interpreter import ensure_interpreter

ensure_interpreter()  # the executor imports triton: set the interpreter first (no CUDA here)

import bench_tp_step  # noqa: E402

from tests.benchmarks.test_bench_model import TINY, config  # noqa: E402


def test_tp_step_bench_runs_on_gloo(tmp_path, capsys):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(config("llama-3.2-1b", **TINY)))
    res = bench_tp_step.main(["--model", str(cfg), "--device", "cpu", "--worlds", "1", "2",
                              "--batches", "1", "3", "--steps", "3", "--prompt-len", "5",
                              "--max-seq-len", "64", "--out", str(tmp_path)])  # fmt: skip
    rows = {(r["world"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    for (w, b), r in rows.items():
        assert r["wall_us"] > 0 and r["failed"] == {}
        assert r["speedup"] == rows[(1, b)]["wall_us"] / r["wall_us"]
        assert (r["reduce_us"] > 0) == (w > 1)
    assert res["device"] == "cpu" and res["dtype"] == "float32"
    assert (tmp_path / f"tp-step-tiny-cpu-{res['date']}.json").is_file()
    assert "| 2 | 3 |" in capsys.readouterr().out
