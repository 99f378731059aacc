"""What `serve` says as it starts (its log at info): one thread count, the engine's, and
the context it serves with and why."""

from __future__ import annotations

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
