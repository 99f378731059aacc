"""Abort semantics, the threading rule (add_request / abort from any thread while one
thread steps) and the asyncio front end."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import graphexec as gx
from tests.engine.scripted import drain, next_outputs, tokens

P = gx.SamplingParams
V = 64


def make(n: int = 4, **kw) -> gx.DecodeExecutor:
    ex = gx.DecodeExecutor(gx.models.TableModel(V, seed=0), max_batch_size=n, device="cpu",
                           seed=5, **kw)  # fmt: skip
    ex.capture(progress=False)
    return ex


def test_abort_before_the_first_token_reports_position_0_and_no_token() -> None:
    ex = make()
    ex.add_request("a", [1], P(seed=1, max_tokens=9))
    assert ex.abort("a") is True
    assert ex.free_slots == 4  # never took a slot
    outs = list(ex.step())
    assert [(o.request_id, o.token_id, o.position, o.finish_reason) for o in outs] == [
        ("a", None, 0, "abort")
    ]
    assert ex.idle


def test_abort_after_the_first_token_reports_the_next_position() -> None:
    ex = make()
    ex.add_request("a", [1], P(seed=1, max_tokens=9))
    (first,) = next_outputs(ex)  # with overlap, its second token is in flight now
    ex.abort("a")
    (end,) = ex.step()
    assert (first.position, first.token_id is not None) == (0, True)
    assert (end.position, end.token_id, end.finish_reason) == (1, None, "abort")


def test_abort_of_a_finished_unreported_request_is_a_no_op() -> None:
    ex = make()
    ex.add_request("a", [1], P(seed=1, max_tokens=2))
    next_outputs(ex)  # its first token: the next step finishes it
    seen = []
    finish = ex._finish

    def finish_then_abort(*args, **kw):  # another thread's abort lands between the two
        outs = finish(*args, **kw)
        seen.append(ex.abort("a"))
        return outs

    ex._finish = finish_then_abort
    outs = list(ex.step())
    assert seen == [False] and [o.finish_reason for o in outs] == ["length"]
    ex._finish = finish
    assert list(ex.step()) == []  # no abort reported afterwards
    assert ex.abort("a") is False  # and after it was reported, still a no-op
    assert list(ex.step()) == []


def test_abort_of_an_unknown_id_is_a_no_op_and_ids_are_checked() -> None:
    ex = make()
    assert ex.abort("nope") is False  # never added: a no-op, as vLLM's abort
    assert list(ex.step()) == []
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty str"):
            ex.abort(bad)


def test_ended_ids_leave_no_record_behind() -> None:
    """abort's False needs no memory of ended ids: after many requests end and are
    reported, the queue holds nothing for them."""
    ex = make(4)
    for i in range(40):
        ex.add_request(f"r{i}", [1], P(seed=i, max_tokens=2, n=1 + i % 2))
        if i % 3 == 0:
            ex.abort(f"r{i}")
        drain(ex)
    q = ex._queue
    assert not q._live and not q._ended and not q._groups and not q._inbox
    assert all(ex.abort(f"r{i}") is False for i in range(40))


def test_duplicate_ids_say_which() -> None:
    ex = make()
    ex.add_request("a", [1], P(seed=1))
    with pytest.raises(ValueError, match="already in use"):
        ex.add_request("a", [1], P(seed=1))  # queued
    ex.step()
    with pytest.raises(ValueError, match="already in use"):
        ex.add_request("a", [1], P(seed=1))  # running


def test_threads_adding_and_aborting_while_one_steps_lose_nothing() -> None:
    ex = make(8)
    outs: dict[str, list[gx.RequestOutput]] = {}
    added: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def stepper() -> None:
        try:
            while not (stop.is_set() and ex.idle):
                for o in ex.step():
                    outs.setdefault(o.request_id, []).append(o)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def client(k: int) -> None:
        rng = random.Random(k)
        try:
            for i in range(25):
                rid = f"c{k}-{i}"
                while True:
                    try:
                        ex.add_request(rid, [1 + i % 7], P(seed=i, max_tokens=rng.randint(1, 12)))
                        break
                    except gx.ExecutorFullError:
                        time.sleep(0.001)
                added.append(rid)
                if rng.random() < 0.4:
                    time.sleep(rng.random() * 0.002)
                    try:
                        ex.abort(rid)
                    except ValueError:
                        pass  # it finished and was reported already
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    t = threading.Thread(target=stepper)
    t.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    stop.set()
    t.join(timeout=60)
    assert not errors and not t.is_alive()
    assert sorted(outs) == sorted(added) and len(added) == 75
    for rid, os_ in outs.items():
        assert [o.finished for o in os_] == [False] * (len(os_) - 1) + [True], rid
        assert [o.position for o in os_ if o.token_id is not None] == list(range(len(tokens(os_))))
    assert any(o[-1].finish_reason == "abort" for o in outs.values())
    assert ex.free_slots == 8 and ex.idle


class Gate(gx.models.TableModel):
    """decode waits for `go` once `hold` is set (to catch a step mid-flight)."""

    hold = False

    def __init__(self) -> None:
        super().__init__(V, seed=0)
        self.inside, self.go = threading.Event(), threading.Event()

    def decode(self, input_ids, positions, slot_ids):
        if self.hold:
            self.inside.set()
            self.go.wait(10)
        return super().decode(input_ids, positions, slot_ids)


def test_a_second_stepping_thread_is_refused_while_adds_are_not() -> None:
    model = Gate()
    ex = gx.DecodeExecutor(model, max_batch_size=4, device="cpu", cuda_graphs=False)
    ex.add_request("a", [1], P(seed=1, max_tokens=3))
    ex.step()
    model.hold = True
    t = threading.Thread(target=ex.step)
    t.start()
    assert model.inside.wait(10)
    with pytest.raises(RuntimeError, match="already running"):
        ex.step()
    ex.add_request("b", [2], P(seed=2, max_tokens=3))  # fine mid-step
    ex.abort("a")
    model.hold = False
    model.go.set()
    t.join()
    rest = drain(ex)
    assert rest["a"][-1].finish_reason == "abort" and rest["b"][-1].finish_reason == "length"


def test_async_streams_equal_the_synchronous_loop_and_cancel_aborts() -> None:
    params = {f"r{i}": P(seed=i, max_tokens=4 + i, top_k=8) for i in range(4)}
    sync = make()
    for rid, p in params.items():
        sync.add_request(rid, [3], p)
    want = {k: tokens(v) for k, v in drain(sync).items()}

    async def main():
        ex = make()
        aex = gx.AsyncDecodeExecutor(ex)

        async def collect(rid):
            return [o async for o in aex.generate(rid, [3], params[rid])]

        got = await asyncio.gather(*(collect(r) for r in params))
        # cancellation: leave a long stream after two tokens; the request is aborted
        stream = aex.generate("long", [3], P(seed=9, max_tokens=500))
        first = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        for _ in range(100):
            if ex.idle:
                break
            await asyncio.sleep(0.01)
        idle = ex.idle
        await aex.close()
        return got, first, idle

    got, first, idle = asyncio.run(main())
    assert {o[0].request_id: tokens(o) for o in got} == want
    assert [o.position for o in first] == [0, 1] and idle
