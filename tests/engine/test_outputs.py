"""StepOutputs (lazy rows, ready outputs first) and the tools' command lines on the CPU."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import graphexec as gx
from graphexec.app import cli
from graphexec.engine.finish import StepOutputs
from graphexec.request import Request
from tests.engine.scripted import next_outputs

ROOT = Path(__file__).resolve().parents[2]
P = gx.SamplingParams


def test_step_outputs_sequence_and_columns() -> None:
    ex = gx.DecodeExecutor(gx.models.TableModel(100), max_batch_size=4, device="cpu")
    ex.capture(progress=False)
    for i in range(3):
        ex.add_request(f"r{i}", [i + 1], P(seed=i, max_tokens=4, logprobs=1 if i else None))
    first = next_outputs(ex)  # prefill, then the first tokens drawn by the step's graph
    assert len(first) == 3 and all(o.key is not None and o.position == 0 for o in first)
    ex.add_request("late", [9], P(seed=9, max_tokens=2))
    ex.abort("r2")
    outs = ex.step()
    ids = [o.request_id for o in outs]
    assert ids == ["r2", "r0", "r1"]  # waiting outputs first, then decode rows
    assert outs[0].finish_reason == "abort" and outs[-1] == outs[2] and outs[0:2] == list(outs)[0:2]
    # with overlap r2's row is there too: the token it had in flight was dropped (-1)
    assert outs.row_request_ids in (["r0", "r1"], ["r0", "r1", "r2"])
    assert outs.row_token_ids.tolist()[:2] == [outs[1].token_id, outs[2].token_id]
    assert outs.row_token_ids.tolist()[2:] in ([], [-1])
    assert outs[1].logprob is None and outs[2].top_logprobs is not None
    assert all(o.position == 1 for o in outs[1:])
    late = next_outputs(ex)
    while "late" not in late.row_request_ids:  # prefilled behind a step's graph, it decodes
        late = ex.step()  # in the next one (with overlap, reported a call after that)
    assert [(o.request_id, o.position) for o in late][2] == ("late", 0)
    assert late.row_request_ids == ["r0", "r1", "late"] and late[0].position == late[1].position
    assert list(outs) == [outs[i] for i in range(len(outs))]  # the bulk and the single path


def test_len_equals_the_outputs_iterated_when_a_row_reports_nothing() -> None:
    """The one-token fast path yielded every row, whatever its count: len() said 0 while
    iterating gave one output (a row of count 0: its token is dropped)."""
    req = Request("a", P(seed=1), 0, 1, frozenset(), 0)
    rows = [req, dataclasses.replace(req, request_id="b", slot=1)]
    key = gx.GraphKey(gx.SamplerVariant.NO_FILTER, 2, False)
    for counts in ([0, 0], [1, 0], [0, 1], [1, 1]):
        outs = StepOutputs(rows, [(key, 0, 2)], np.array([[5], [6]]), np.array(counts),
                           np.array([0, 3]))  # fmt: skip
        got = list(outs)
        assert len(outs) == len(got) == sum(counts)
        assert [o.token_id for o in got] == [t for t, c in zip((5, 6), counts, strict=True) if c]
        assert [outs[i] for i in range(len(outs))] == got
        assert outs.row_token_ids.tolist() == [5 if counts[0] else -1, 6 if counts[1] else -1]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_determinism_quick_passes_on_the_cpu(capsys, restore_threads) -> None:
    # --quick: spec keys through the draft model alone (its key batches run every spec_k
    # key; the n-gram drafter finds no drafts there); one bucket and one step a key keep it
    # short (about 12 s on a 2-core CPU). In this process (cli.main, what `python -m
    # graphexec` runs; tests/app/test_cli.py runs the installed command): a second process
    # paid ~5 s of imports
    rc = cli.main(["determinism", "--quick", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "0 captured keys never ran" in out and ": 0 mismatches" in out
    assert "/k3 " in out and "0 differences from no speculation" in out
    # progress: per run, counts up to a total that never changes (it jumped: [5/6], [6/10])
    counts: dict[str, list[tuple[int, int]]] = {}
    for label, i, n in re.findall(r"\[(.*?) (\d+)/(\d+)\]", err):
        counts.setdefault(label, []).append((int(i), int(n)))
    assert len(counts) == 2, err  # the runs without and with the draft model
    for seen in counts.values():
        assert seen == [(i, seen[0][1]) for i in range(1, seen[0][1] + 1)], seen
    # the table's columns hold, whatever the key names
    rows = out.splitlines()
    at = next(i for i, line in enumerate(rows) if line.startswith("key "))
    lines = rows[at : rows.index("", at)]
    # a header, then a key a line: 3 variants x logprobs on / off x spec_k 0 / 3, bucket 1
    assert len(lines) == 1 + 3 * 2 * 2 and len({len(line) for line in lines}) == 1, lines


def test_inspect_tool_prints_a_row_per_key() -> None:
    r = run_tool("tools/inspect_graphs.py", "--model", "table", "--max-batch-size", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.split()[:1] in (["no_filter"],
            ["top_k_top_p"], ["default"])]  # fmt: skip
    assert len(rows) == 3 * 2 * 2  # each variant x bucket x logprobs
    assert {line.split()[0] for line in rows} == {"no_filter", "top_k_top_p", "default"}


def test_inspect_on_the_cpu_says_what_it_shows_and_prints_no_cuda_columns(capsys) -> None:
    import argparse

    from graphexec.app.inspection import add_arguments, inspect_graphs, print_emulated_table

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "table", "--max-batch-size", "2", "--device", "cpu"])
    assert inspect_graphs(args) == 0
    ex = gx.DecodeExecutor(gx.models.TableModel(100), max_batch_size=2, device="cpu")
    ex.capture(progress=False)
    ex.add_request("a", [1], P(seed=1, max_tokens=3, min_p=0.1))
    while not ex.idle:
        ex.step()
    print_emulated_table(ex, steps_ran=True)  # what inspect --steps N prints after its run
    out = capsys.readouterr().out
    for table, steps in zip(out.split("cpu: no CUDA")[1:], ([], ["steps"]), strict=True):
        assert "emulated" in table and "Not shown (CUDA only): capture time" in table
        header = next(line for line in table.splitlines() if line.startswith("variant"))
        assert header.split() == ["variant", "bucket", "logprobs", "spec_k", "set"] + steps
        for cuda_only in ("capture s", "kernels", "mem MiB", "replays"):
            assert cuda_only not in header
        rows = [line.split() for line in table.splitlines()
                if line.split()[:1] in (["no_filter"], ["top_k_top_p"], ["default"])]  # fmt: skip
        assert len(rows) == 3 * 2 * 2 and {r[1] for r in rows} == {"1", "2"}
        names = (["no_filter:"], ["top_k_top_p:"], ["default:"])
        legend = {line.split(":")[0].strip(): " ".join(line.split()[1:])
                  for line in table.splitlines() if line.split()[:1] in names}  # fmt: skip
        assert "no min-p" in legend["top_k_top_p"] and "min-p" in legend["default"]
        # one kernel set per variant x logprobs, listed under the table
        sets = {(r[0], r[2]): r[4] for r in rows}
        assert len(set(sets.values())) == 6 and "the sampler kernels each key launches" in table
        blocks: dict = {}  # set label -> its lines
        for line in table.split("Kernel sets:")[1].splitlines():
            if line.startswith("  ") and not line.startswith("   "):
                blocks[line.split()[0]] = []
            if blocks:
                blocks[list(blocks)[-1]].append(line)
        assert set(blocks) == set(sets.values())
        block = " ".join(blocks[sets[("no_filter", "False")]])
        assert "2 launches: no_filter/nolp (buckets 1,2)" in block
        block = " ".join(blocks[sets[("default", "True")]])
        assert "_select_kernel x2" in block and "_raw_logprobs_kernel" in block
        block = " ".join(blocks[sets[("top_k_top_p", "False")]])
        assert "2 launches: top_k_top_p/nolp (buckets 1,2)" in block and "_topk_kernel" in block
        if steps:  # the emulated replays: the min-p request's steps ran default/b1/nolp
            ran = {(r[0], r[1], r[2]): int(r[-1]) for r in rows}
            assert ran[("default", "1", "False")] >= 2 and sum(ran.values()) == ran[
                ("default", "1", "False")]  # fmt: skip


def test_determinism_check_quick_mode_wiring() -> None:
    """--quick fills in the smaller settings only where no flag was given; the full mode
    keeps its defaults (tools/determinism_check.py: a thin wrapper of the package's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("determinism_check",
                                                  ROOT / "tools/determinism_check.py")  # fmt: skip
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    full = tool.parse_args([])
    assert (full.max_batch_size, full.requests, full.key_steps, full.speculative) == (
        None, None, 8, "all")  # fmt: skip
    quick = tool.parse_args(["--quick"])
    assert (quick.max_batch_size, quick.requests, quick.key_steps, quick.speculative) == (
        1, 1, 1, "draft")  # fmt: skip
    assert tool.parse_args(["--quick", "--model", "qwen2.5-0.5b"]).speculative == "ngram"
    mixed = tool.parse_args(["--quick", "--key-steps", "3", "--speculative", "none"])
    assert (mixed.key_steps, mixed.speculative, mixed.requests) == (3, "none", 1)
    helptext = tool.parser().format_help()
    assert "--quick" in helptext and "full" in helptext
