"""The engine loop (`serve.engine_core`) and an API server's side of it
(`serve.remote`) in one process: engines in threads, the channel as in `serve`
(ZeroMQ ipc sockets, msgpack rows). Outputs must equal the executor's own, field by
field; admission, the waiting FIFO, refusals and aborts keep `AsyncDecodeExecutor`'s
rules; requests spread over engines."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

import graphexec as gx
from graphexec.engine.async_executor import QueueFullError
from graphexec.engine.inbox import ExecutorFullError
from graphexec.request import PromptLogprob, RequestOutput
from graphexec.serve import wire
from graphexec.serve.engine_core import EngineCore
from graphexec.serve.engines import EngineStats
from graphexec.serve.remote import EngineInfo, RemoteEngines
from graphexec.serve.wire import pull_socket, push_socket

SLOTS = 2


@pytest.fixture(scope="module")
def tok():
    return gx.Tokenizer.cl100k()


def executor(tok) -> gx.DecodeExecutor:
    model = gx.models.TableModel(tok.vocab_size, seed=0, max_seq_len=256)
    return gx.DecodeExecutor(model, max_batch_size=SLOTS, device="cpu", tokenizer=tok,
                             overlap=True)  # as the server builds it  # fmt: skip


class Engines:
    """n EngineCores on their own threads and one RemoteEngines over them."""

    def __init__(self, tmp_path, tok, n: int, max_waiting: int) -> None:
        self.ctx = zmq.Context()
        e_addrs = [f"ipc://{tmp_path}/e{i}" for i in range(n)]
        self.server_addr = f"ipc://{tmp_path}/s0"
        self.cores = []
        for i, a in enumerate(e_addrs):
            ex = executor(tok)
            core = EngineCore(ex, i, max_waiting, pull_socket(self.ctx, a),
                              [push_socket(self.ctx, self.server_addr)])  # fmt: skip
            self.cores.append(core)
        self.threads = [threading.Thread(target=c.run, daemon=True) for c in self.cores]
        for t in self.threads:
            t.start()
        self.waited: list[float] = []
        info = EngineInfo(SLOTS, tok.vocab_size, 256)
        self.remote = RemoteEngines(0, self.server_addr, e_addrs, [info] * n,
                                    on_admitted=self.waited.append)  # fmt: skip

    def stop(self) -> None:
        asyncio.run(self.remote.close())
        for c in self.cores:
            c.stopped = True
        for t in self.threads:
            t.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture
def engines(tmp_path, tok):
    made = []

    def make(n: int = 1, max_waiting: int = 4) -> Engines:
        made.append(Engines(tmp_path, tok, n, max_waiting))
        return made[-1]

    yield make
    for e in made:
        e.stop()


def direct(tok, reqs) -> dict[str, list[RequestOutput]]:
    ex = executor(tok)
    out: dict[str, list[RequestOutput]] = {}
    for rid, prompt, p in reqs:  # one at a time, as the test sends them
        ex.add_request(rid, prompt, p)
        while not ex.idle:
            for o in ex.step():
                out.setdefault(o.request_id, []).append(o)
    return out


def fields(o: RequestOutput) -> tuple:
    return (
        o.request_id,
        o.token_id,
        o.position,
        o.seed,
        o.logprob,
        o.rank,
        o.top_logprobs,
        o.finished,
        o.finish_reason,
        o.text,
        o.stop_reason,
        o.prompt_logprobs,
    )


def test_a_row_carries_every_field_but_the_graph_key() -> None:
    o = RequestOutput("r/1", 7, 3, 11, logprob=-0.5, rank=2, top_logprobs=[(4, -0.1), (7, -0.5)],
                      finished=True, finish_reason="stop", text="é", stop_reason="\n",
                      prompt_logprobs=[None, PromptLogprob(5, -1.25, 3, [(1, -0.2)])])  # fmt: skip
    back = wire.output(wire.unpack(wire.pack([wire.row(o)]))[0])
    assert fields(back) == fields(o) and back.key is None
    plain = RequestOutput("r", 9, 0, 1, text="a")
    assert wire.row(plain)[-1] is None and fields(wire.output(wire.row(plain))) == fields(plain)


def test_outputs_equal_the_executors_own(engines, tok) -> None:
    e = engines()
    p1 = gx.SamplingParams(seed=3, max_tokens=6, logprobs=2, temperature=0.9)
    p2 = gx.SamplingParams(seed=4, max_tokens=5, n=2, stop=[" the"], prompt_logprobs=1)
    prompt = tok.encode("one two three")

    async def main():
        got: dict[str, list] = {}
        for rid, p in (("a", p1), ("b", p2)):
            async for o in e.remote.generate(rid, prompt, p):
                got.setdefault(o.request_id, []).append(o)
        return got

    got = asyncio.run(main())
    want = direct(tok, [("a", prompt, p1), ("b", prompt, p2)])
    assert set(got) == {"a", "b/0", "b/1"} == set(want)
    for rid in want:
        assert [fields(o) for o in got[rid]] == [fields(o) for o in want[rid]], rid
    assert e.waited and all(w >= 0 for w in e.waited)


def test_waiting_refusals_and_aborts(engines, tok) -> None:
    e = engines(max_waiting=1)
    long = gx.SamplingParams(seed=1, max_tokens=200, ignore_eos=True)
    short = gx.SamplingParams(seed=2, max_tokens=2)
    prompt = tok.encode("hi")

    async def first(stream):
        return await stream.__anext__()

    async def main():
        r = e.remote
        with pytest.raises(ValueError):  # the executor refuses it: an id past the vocabulary
            await first(r.generate("f", [tok.vocab_size + 5], short))
        a, b = r.generate("a", prompt, long), r.generate("b", prompt, long)  # both slots
        await first(a), await first(b)
        waiter = r.generate("c", prompt, short)  # waits: no free slot
        with pytest.raises(QueueFullError):  # the FIFO holds one
            await first(r.generate("d", prompt, short))
        with pytest.raises(ExecutorFullError, match="never fit"):
            await first(r.generate("e", prompt, gx.SamplingParams(seed=1, max_tokens=2, n=3)))
        await a.aclose()  # aborts a: c gets its slot and runs to its end
        outs = [o async for o in waiter]
        assert outs[-1].finish_reason == "length" and len(outs) == 2
        await b.aclose()
        for _ in range(100):
            if r.stats().free_slots == SLOTS and r.stats().running == 0:
                break
            await asyncio.sleep(0.02)
        return r.stats()

    st = asyncio.run(main())
    assert st.free_slots == SLOTS and st.running == 0 and st.waiting == 0


def test_requests_spread_over_engines_with_the_same_tokens(engines, tok) -> None:
    e = engines(n=2)
    prompt = tok.encode("spread")
    # sent in turn, r0 and r2 go to engine 0, r1 and r3 to engine 1
    reqs = [(f"r{i}", gx.SamplingParams(seed=s, max_tokens=4)) for i, s in enumerate([0, 1, 1, 0])]

    async def main():
        async def run(rid, p):
            return [o.token_id async for o in e.remote.generate(rid, prompt, p)]

        return await asyncio.gather(*(run(rid, p) for rid, p in reqs))

    got = asyncio.run(main())
    assert got[0] == got[3] and got[1] == got[2]  # same seed, the other engine
    assert got[0] != got[1]
    assert all(c.ex.stats.admitted == 2 for c in e.cores)  # least-loaded: two each


class _Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, data, flags=0) -> None:
        self.sent.append(wire.unpack(data))


def test_outputs_carry_the_stats_at_most_every_100_ms() -> None:
    """EngineStats.of cost 30-53 us per step when rebuilt for every OUTPUTS message."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://stats-test")
    ex = gx.DecodeExecutor(gx.models.TableModel(50, seed=0), max_batch_size=2, device="cpu")
    out = _Outbox()
    core = EngineCore(ex, 0, 0, inbox, [out])
    core.owner = {"a": 0}
    row = gx.RequestOutput("a", 3, 0, 1)
    for _ in range(3):
        core._send([row])
    stats = [m[2] for m in out.sent]
    assert stats[0] is not None and stats[1:] == [None, None]
    core._stats_at -= 0.2  # 200 ms later
    core._send([row])
    assert list(out.sent[-1][2]) == list(EngineStats.of(ex, 0).as_tuple())
    core._send([])  # nothing to send: no message, no stats
    assert len(out.sent) == 4
    inbox.close()
    ctx.term()
