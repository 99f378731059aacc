"""CPU tests of the server load test's bookkeeping (benchmarks/bench_serve.py): what a
point counts in its window, lost and duplicated streams, and the targets' verdicts. The
load test itself runs on the GPU host; its numbers are not measured here."""

import json

import bench_serve  # noqa: E402
import pytest
from serve_clients import Record, Workload  # noqa: E402


def test_summarize_counts_only_the_window_and_flags_lost_and_duplicated_streams() -> None:
    recs = [
        Record(0.5, [1.0, 2.0, 3.0, 4.0], 4, usage=4),  # tokens 2.0 and 3.0 (and its gap) count
        Record(2.1, [2.5, 2.7, 2.9], 4, usage=3),  # one lost, its usage agrees
        Record(2.2, [2.3, 2.4, 2.6, 2.8, 2.95], 4, usage=4),  # one duplicated, usage disagrees
        Record(2.0, [], 4, error="HTTP 503"),  # an error is no stream: counted as an error
    ]
    s = bench_serve.summarize(recs, 2.0, 3.0)
    assert s["tokens"] == 2 + 3 + 5 and s["tokens_per_s"] == pytest.approx(10.0)
    assert (s["lost"], s["duplicated"], s["usage_mismatch"], s["errors"]) == (1, 1, 1, 1)
    assert s["ttft_mean_us"] == pytest.approx((0.4 + 0.1) / 2 * 1e6)  # the two sent inside
    gaps = [1.0, 1.0, 0.2, 0.2, 0.1, 0.2, 0.2, 0.15]
    assert s["gap_mean_us"] == pytest.approx(sum(gaps) / len(gaps) * 1e6)


def test_judge_holds_every_point_to_the_targets_and_the_engines_ratio() -> None:
    def point(tps, gap, lost=0):
        return dict(tokens_per_s=tps, gap_p99_us=gap, lost=lost, errors=0, duplicated=0,
                    usage_mismatch=0)  # fmt: skip

    direct = {64: point(1000, 100), 256: point(2000, 100)}
    server = {64: point(950, 110), 256: point(1900, 130, lost=1)}
    j = bench_serve.judge(direct, server, {256: point(3700, 100)}, dict(ready_less_capture_s=3))
    assert j["tokens_ratio"] == pytest.approx({"64": 0.95, "256": 0.95})
    assert j["gap_ratio"] == pytest.approx({"64": 1.1, "256": 1.3}) and j["lost"] == 1
    assert j["dp_over_one_engine"] == pytest.approx({"256": 3700 / 1900})
    assert j["met"] == dict(tokens_ratio=True, gap_ratio=False, dp=True, lost=False,
                            duplicated=True, ready=True)  # fmt: skip
    assert bench_serve.judge(direct, server, {}, {})["met"]["dp"] is None


POINT = dict(tokens_per_s=1.0, gap_p99_us=1.0, ttft_p99_us=1.0, lost=0, errors=0, duplicated=0,
             usage_mismatch=0)  # fmt: skip


async def _all(args, wl, pool, engines, clients, out, saved):
    for n in clients:
        out[n] = dict(POINT)
        saved()


def test_a_run_cut_short_keeps_the_points_it_measured(tmp_path, monkeypatch) -> None:
    """The JSON is written after every point: a run killed mid-way (a device command's time
    limit) keeps what it measured, marked incomplete; a whole run is marked complete."""
    class Ex:
        vocab_size = 100

    async def direct(ex, args, wl, out, saved):
        for n in args.clients:
            out[n] = dict(POINT)
            saved()

    async def cut(args, wl, pool, engines, clients, out, saved):
        out[clients[0]] = dict(POINT)
        saved()
        raise KeyboardInterrupt  # as a kill after the server's first point

    monkeypatch.setattr(bench_serve, "build", lambda args: (Ex(), {"name": "stub"}))
    monkeypatch.setattr(bench_serve, "direct_points", direct)
    monkeypatch.setattr(bench_serve, "server_points", cut)
    argv = ["--device", "cpu", "--clients", "4", "8", "--workers", "1", "--no-ready",
            "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        bench_serve.main(argv)
    (path,) = tmp_path.glob("serve-cpu-*.json")
    got = json.loads(path.read_text())
    assert got["complete"] is False
    assert list(got["direct"]) == ["4", "8"] and list(got["server"]) == ["4"]
    monkeypatch.setattr(bench_serve, "server_points", _all)
    monkeypatch.setattr(bench_serve, "plot", lambda result, path: None)
    bench_serve.main(argv)
    got = json.loads(path.read_text())
    assert got["complete"] is True and list(got["server"]) == ["4", "8"]


def test_workload_requests_are_seeded_and_exact_length() -> None:
    wl = Workload(prompt_len=16, max_tokens=9, vocab=1000)
    assert wl.prompt(3) == wl.prompt(3) != wl.prompt(4)
    assert len(wl.prompt(3)) == 16 and max(wl.prompt(3)) < 1000
    b = wl.body(3, "m")
    assert b["ignore_eos"] and b["seed"] == 3 and b["max_tokens"] == 9 and b["stream"]


def test_the_client_loop_lag_shows_a_blocked_worker() -> None:
    """A worker loop blocked for 0.2 s (as one that cannot keep up with its streams)
    wakes that late from its ticks; an idle one wakes on time."""
    import asyncio
    import time

    from graphexec.serve.metrics import watch_loop_lag

    async def run(block: bool) -> list[float]:
        lags: list[float] = []
        task = asyncio.create_task(watch_loop_lag(lags.append, until=time.monotonic() + 0.5))
        await asyncio.sleep(0.05)
        if block:
            time.sleep(0.2)  # the loop does nothing else meanwhile
        await task
        return lags

    assert max(asyncio.run(run(True))) >= 0.15
    assert max(asyncio.run(run(False))) < 0.1


def test_server_side_view_reads_each_api_servers_metrics_and_their_difference() -> None:
    """parse / delta over the text the servers render: requests per server, and the
    histograms' p50 / p99 bucket bounds over what happened between two scrapes only."""
    import serve_metrics

    from graphexec.serve.engines import EngineStats
    from graphexec.serve.metrics import ServerMetrics

    ms = [ServerMetrics(api_server=i) for i in range(2)]
    ms[0].ttft.observe(30.0)  # before the point: must not count
    before = {i: serve_metrics.parse(m.render(EngineStats()))[1] for i, m in enumerate(ms)}
    assert serve_metrics.parse(ms[1].render(EngineStats()))[0] == 1
    for v in [0.02] * 60 + [0.2] * 38 + [4.0] * 2:
        ms[0].requests += 1
        ms[0].ttft.observe(v)
    ms[1].requests += 3
    ms[1].loop_lag.observe(0.003)
    after = {i: serve_metrics.parse(m.render(EngineStats()))[1] for i, m in enumerate(ms)}
    d = serve_metrics.delta(before, after)
    assert d["requests_per_server"] == [100, 3]
    t = d["time_to_first_token_seconds"]
    assert (t["p50_s"], t["p99_s"], t["count"]) == (0.025, 5.0, 100)
    assert d["event_loop_lag_seconds"]["p99_s"] == 0.005
    assert d["request_queue_seconds"]["p50_s"] is None
    assert serve_metrics.delta(before, {0: after[0]})["requests_per_server"] == [100]


def test_a_points_server_log_is_what_the_server_wrote_meanwhile(tmp_path) -> None:
    srv = object.__new__(bench_serve.ServeProcess)  # its log only: no server started
    srv.log = tmp_path / "serve.log"
    srv.log.write_text("ready\n")
    _, at = srv.log_since(0)
    with open(srv.log, "a") as f:
        f.write("WARNING engine 0: API server 3 is not reading; a message dropped\nERROR x\n")
    lines, end = srv.log_since(at)
    assert lines == ["WARNING engine 0: API server 3 is not reading; a message dropped", "ERROR x"]
    assert srv.log_since(end) == ([], end)


def test_ttft_parts_split_the_first_token_wait_from_the_trace() -> None:
    """A request's wait split at the request written and the response's headers, over the
    window's requests that have both; connections opened are counted."""
    a = Record(2.0, [2.5], 1, wrote=2.1, headers=2.4, connected=True)
    b = Record(2.2, [2.4], 1, wrote=2.2, headers=2.3)
    old = Record(1.0, [1.5], 1, wrote=1.4, headers=1.45, connected=True)  # before the window
    p = bench_serve.summarize([a, b, old], 2.0, 3.0)["ttft_parts"]
    assert p["send_mean_us"] == pytest.approx(0.05e6)
    assert p["headers_mean_us"] == pytest.approx(0.2e6)
    assert p["first_chunk_mean_us"] == pytest.approx(0.1e6)
    assert p["connections_opened"] == 1
    assert bench_serve.summarize([Record(2.0, [2.5], 1)], 2.0, 3.0)["ttft_parts"] is None


def test_the_load_tests_http_client_reads_chunked_events_and_keeps_its_connection() -> None:
    """serve_http.Connection against a bare HTTP/1.1 server: events split across chunks
    and several in one chunk, the connection kept for the next request, a 503 raised with
    its body, and after a reply with `connection: close` the next request reconnects."""
    import asyncio

    from serve_http import Connection, HTTPError

    chunks = [b'data: {"a": 1}\n\ndata: {"b"', b': 2}\n\n', b"data: [DONE]\n\n"]
    stream = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    replies = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + stream,
               b"HTTP/1.1 503 Busy\r\ncontent-length: 4\r\n\r\nfull",
               b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
               + stream]  # fmt: skip
    seen: list[bytes] = []

    async def serve(reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                seen.append(await reader.readexactly(n))
                writer.write(replies[min(len(seen), 3) - 1])
                await writer.drain()
        except asyncio.IncompleteReadError:  # the client closed
            writer.close()

    async def main() -> list:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        conn = Connection(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        got = []
        for k in range(4):
            stamps: dict = {}
            try:
                got.append([e async for e in conn.post_events("/x", b'{"k": %d}' % k, stamps)])
            except HTTPError as e:
                got.append(str(e))
            got.append((stamps.get("connected", False), stamps["wrote"] <= stamps["headers"]))
        await conn.close()
        await asyncio.sleep(0.05)  # the handlers read the end of their connections
        server.close()
        await server.wait_closed()
        return got, conn.opened

    got, opened = asyncio.run(main())
    events = ['{"a": 1}', '{"b": 2}', "[DONE]"]
    assert got == [events, (True, True), "HTTP 503: b'full'", (False, True),
                   events, (False, True), events, (True, True)]  # fmt: skip
    assert opened == 2 and seen == [b'{"k": %d}' % k for k in range(4)]
