"""AsyncDecodeExecutor: a duplicate request id is refused without touching the live
stream, and requests beyond the free slots wait in a bounded FIFO (max_waiting)."""

from __future__ import annotations

import asyncio

import pytest

import graphexec as gx
from graphexec.engine.async_executor import QueueFullError

P = gx.SamplingParams
V = 64


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    """Every test runs on the synchronous and on the pipelined step."""
    monkeypatch.setattr(f"{__name__}.OVERLAP", request.param)


OVERLAP = False


def make(n: int) -> gx.DecodeExecutor:
    return gx.DecodeExecutor(gx.models.TableModel(V, seed=0), max_batch_size=n, device="cpu",
                             cuda_graphs=False, overlap=OVERLAP)  # fmt: skip


async def collect(stream) -> list[gx.RequestOutput]:
    return [o async for o in stream]


def test_a_duplicate_id_is_refused_and_the_live_stream_goes_on() -> None:
    async def main():
        ex = make(4)
        aex = gx.AsyncDecodeExecutor(ex)
        live = aex.generate("r", [3], P(seed=1, max_tokens=6))
        first = await live.__anext__()
        for params in (P(seed=2, max_tokens=2), P(seed=2, max_tokens=2, n=2)):
            with pytest.raises(ValueError, match="already in use"):
                await aex.generate("r", [3], params).__anext__()
        rest = await asyncio.wait_for(collect(live), 10)  # it used to hang here
        await aex.close()
        return [first, *rest], ex

    outs, ex = asyncio.run(main())
    assert [o.position for o in outs] == list(range(6)) and outs[-1].finish_reason == "length"
    assert ex.idle and ex.free_slots == 4


def test_requests_wait_for_slots_in_arrival_order_and_the_queue_is_bounded() -> None:
    async def main():
        ex = make(2)
        direct = make(2)
        aex = gx.AsyncDecodeExecutor(ex, max_waiting=2)
        order: list[str] = []

        async def run(rid, p):
            outs = await collect(aex.generate(rid, [3], p))
            order.append(rid)
            return outs

        running = [asyncio.create_task(run(f"a{i}", P(seed=i, max_tokens=8))) for i in (0, 1)]
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(run("w2", P(seed=2, max_tokens=2, n=2))),
                   asyncio.create_task(run("w1", P(seed=3, max_tokens=2)))]  # fmt: skip
        for _ in range(100):
            if aex.num_waiting == 2:
                break
            await asyncio.sleep(0.001)
        assert aex.num_waiting == 2
        with pytest.raises(QueueFullError):
            await aex.generate("x", [3], P(max_tokens=1)).__anext__()
        with pytest.raises(gx.ExecutorFullError):  # never fits
            await aex.generate("y", [3], P(max_tokens=1, n=3)).__anext__()
        got = await asyncio.wait_for(asyncio.gather(*running, *waiting), 20)
        # a waiter that leaves gives up its place
        hold = asyncio.create_task(run("h", P(seed=5, max_tokens=50)))
        hold2 = asyncio.create_task(run("h2", P(seed=6, max_tokens=50)))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(run("gone", P(seed=7, max_tokens=2)))
        await asyncio.sleep(0.01)
        assert aex.num_waiting == 1
        gone.cancel()
        await asyncio.sleep(0.01)
        assert aex.num_waiting == 0
        await asyncio.gather(hold, hold2)
        await aex.close()
        want = {}
        for rid, p in (("w2", P(seed=2, max_tokens=2, n=2)), ("w1", P(seed=3, max_tokens=2))):
            direct.add_request(rid, [3], p)
            while not direct.idle:
                for o in direct.step():
                    want.setdefault(rid, []).append(o.token_id)
        return order, got, want, ex

    order, got, want, ex = asyncio.run(main())
    # w2 (two streams) arrived first: w1 (one stream) did not overtake it
    assert order.index("w2") < order.index("w1")
    assert sorted(o.token_id for o in got[2]) == sorted(want["w2"])
    assert [o.token_id for o in got[3]] == want["w1"]
    assert ex.idle and ex.free_slots == 2
