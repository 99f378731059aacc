"""What `serve` says as it starts (its log at info): one thread count, the engine's, and
the context it serves with and why."""

from __future__ import annotations

import pytest

from tests.serve.conftest import Server


def test_serve_logs_one_thread_count_and_its_context(checkpoint) -> None:
    s = Server(checkpoint, "--log-level", "info")  # an API server and an engine process
    try:
        s.log.flush()
        s.log.seek(0)
        log = s.log.read()
    finally:
        s.stop()
    assert log.count("torch intra-op threads") == 1, log
    assert log.count("max_seq_len 2048, the model's own") == 1, log


def _args(**kw):
    import argparse

    base = dict(model="tiny", device="cpu", dtype="auto", max_batch_size=2, max_seq_len=64,
                seed=0, speculative=None, no_capture=False, max_queue=None, threads=None,
                log_level="info", capture_keys=None, data_parallel=1)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_engine_threads_are_configuration_not_the_load_at_start(monkeypatch) -> None:
    """Unset, a CPU engine's threads are the cores serve may use (its affinity) split
    among the engines, never the cores idle at that moment; --threads wins; a GPU engine
    keeps torch's. The launcher fixes the number that every engine then sets."""
    from graphexec.runtime import threads
    from graphexec.serve.server import engine_spec, resolve_threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(threads, "idle_cores", lambda *a, **k: pytest.fail("load sampled"))
    for engines, want in ((1, 6), (2, 3), (4, 1), (8, 1)):
        args = _args(data_parallel=engines)
        assert "6 cores" in resolve_threads(args) and args.threads == want
        assert engine_spec(args).threads == want
    args = _args(threads=5)
    assert resolve_threads(args) == "--threads" and engine_spec(args).threads == 5
    args = _args(device="cuda")
    assert resolve_threads(args) is None and args.threads is None


def test_cpu_server_replays_its_emulated_graphs(restore_threads) -> None:
    """On the CPU the server captures as the library's default does (emulated), so its
    steps replay and graph_replays_total counts them; --no-capture runs them eagerly."""
    import torch

    import graphexec as gx
    from graphexec.serve.engines import EngineStats
    from graphexec.serve.served import build_executor
    from graphexec.serve.server import engine_spec

    for no_capture in (False, True):
        ex, dm = build_executor(engine_spec(_args(no_capture=no_capture, threads=1)))
        assert torch.get_num_threads() == 1  # the spec's number, set as is
        assert bool(ex.graph_keys) != no_capture
        ex.add_request("r", dm.tokenizer.encode("Hi"), gx.SamplingParams(max_tokens=4, seed=1))
        while not ex.idle:
            ex.step()
        st = EngineStats.of(ex, 0)
        assert (st.replays, st.eager) == ((0, st.steps) if no_capture else (st.steps, 0)), st
