"""How `serve` sets up its engine: its thread count and its captured (emulated) graphs.
What it says as it starts (its log at info) is checked on test_server_limits.py's server."""

from __future__ import annotations

import pytest


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


def test_api_servers_listen_on_one_port_and_share_connections_evenly() -> None:
    """On Linux each API server gets its own SO_REUSEPORT socket on the one port, and the
    kernel spreads connections opened at once over them (hashed: 256 connections over 4
    sockets are binomial, mean 64, sd 7; each must take at least 32). One server, or
    another system: one socket."""
    import os
    import socket

    from graphexec.serve.processes import listen_sockets

    one = listen_sockets("127.0.0.1", 0, 1)
    assert len(one) == 1
    one[0].close()
    socks = listen_sockets("127.0.0.1", 0, 4)
    try:
        if os.uname().sysname != "Linux":
            assert len(socks) == 1
            return
        port = socks[0].getsockname()[1]
        assert len(socks) == 4 and {s.getsockname()[1] for s in socks} == {port}
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(256)]
        counts = []
        for s in socks:
            s.setblocking(False)
            n = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                n += 1
            counts.append(n)
        for c in clients:
            c.close()
        assert sum(counts) == 256 and min(counts) >= 32, counts
    finally:
        for s in socks:
            s.close()


def test_engine_nice_reaches_the_engine_process_first_thing(monkeypatch) -> None:
    """--engine-nice: in the spec; the engine process sets it before it builds anything
    (a refusal is a warning and the engine goes on); with no engine process of its own
    (--api-servers 0) it is refused up front."""
    import queue

    from graphexec.runtime import threads
    from graphexec.serve import processes, served
    from graphexec.serve.server import engine_spec, serve

    assert engine_spec(_args()).engine_nice == 0
    spec = engine_spec(_args(engine_nice=-7))
    assert spec.engine_nice == -7
    calls = []

    def build(s):
        calls.append("build")
        raise RuntimeError("stop here")

    monkeypatch.setattr(served, "build_executor", build)
    monkeypatch.setattr(threads, "set_nice", lambda n: calls.append(n) or {})
    ready = queue.Queue()
    processes.engine_main(spec, 0, None, "ipc://unused", [], ready)
    assert calls == [-7, "build"] and ready.get_nowait()[2] == "RuntimeError: stop here"

    def refuse(n):
        raise PermissionError("nice -7: refused")

    calls.clear()
    monkeypatch.setattr(threads, "set_nice", refuse)
    processes.engine_main(spec, 0, None, "ipc://unused", [], ready)
    assert calls == ["build"]
    assert serve(_args(api_servers=0, engine_nice=-7, no_capture=True)) == 2
