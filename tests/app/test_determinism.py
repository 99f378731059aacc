"""The determinism tool's output: its tables keep their columns whatever the names, its
progress counts never jump, and a real model runs in the dtype every tool defaults to."""

from __future__ import annotations

import re

from graphexec.app import determinism
from graphexec.app.determinism import Progress, table


def test_the_table_keeps_its_columns_for_long_names() -> None:
    rows = [("draft model (its first 2 of 30 layers), eager", 3, 0),
            ("GraphKey(variant=top_k_top_p, bucket=256, logprobs=True, spec_k=3)", 12345, 7),
            ("alone", 1, 0)]  # fmt: skip
    lines = table(("comparison", "differing streams", "mismatches"), rows).splitlines()
    assert len({len(line) for line in lines}) == 1  # every line as wide
    # the last column right-aligned under its header
    assert [line[-len("mismatches") :].strip() for line in lines] == ["mismatches", "0", "7", "0"]
    assert lines[2].split()[-2:] == ["12345", "7"]


def test_progress_counts_run_up_to_a_total_that_never_changes(capsys) -> None:
    p = Progress("run 2/3: speculative ngram,", 3)
    for what in ("capture and mixed workload", "key a", "key b"):
        p.step(what)
    seen = re.findall(r"\[run 2/3: speculative ngram, (\d+)/(\d+)\]", capsys.readouterr().err)
    assert seen == [("1", "3"), ("2", "3"), ("3", "3")]


def test_a_real_model_runs_in_the_dtype_every_tool_defaults_to() -> None:
    assert determinism.parse_args(["--model", "qwen2.5-0.5b"]).dtype == "auto"


def test_inspect_without_a_model_takes_the_demos_and_says_which(monkeypatch, capsys) -> None:
    """Without --model, inspect runs what the demo runs (SmolLM2 once set up, else
    TinyLM; here a TableModel stands in for it) and first says which model it inspects."""
    import argparse

    import torch

    from graphexec.app import demo, inspection
    from graphexec.models.demo_model import choose_model

    asked = []

    def stand_in(device, dtype, max_seq_len, seed):
        asked.append((device.type, dtype))
        return choose_model("table", device), None

    monkeypatch.setattr(demo, "default_model", stand_in)
    p = argparse.ArgumentParser()
    inspection.add_arguments(p)
    args = p.parse_args(["--max-batch-size", "2", "--device", "cpu"])
    assert args.model is None and args.dtype == "auto"
    inspection.build(args)
    assert asked == [("cpu", "auto")] and torch.device("cpu").type == "cpu"
    assert "Inspecting TableModel on cpu (float32), max batch size 2." in capsys.readouterr().out


def test_each_keys_workload_calls_for_exactly_that_key() -> None:
    """`workload.key_workload` (what the determinism check and the GPU tests replay per
    key): its rows choose exactly the key's variant and logprobs, and fill a batch that
    only the key's bucket serves."""
    import graphexec as gx
    from graphexec.app import workload as wl
    from graphexec.engine.graphs import plan_step
    from graphexec.request import GraphKey

    buckets = (1, 2, 4, 8)
    for v in gx.SamplerVariant:
        for b in buckets:
            for lp in (False, True):
                key = GraphKey(v, b, lp)
                items = wl.key_workload(key, buckets, steps=3)
                assert plan_step([it.params for it in items], buckets) == [
                    (key, slice(0, len(items)))]  # fmt: skip
