"""The messages between API servers and engine processes (msgpack over ZeroMQ).

    API server -> engine   [ADD, server, request_id, prompt ids, pickled SamplingParams]
                           [ABORT, request_id]
    engine -> API server   [OUTPUTS, engine, stats, rows]   one per step and server
                                                            (stats None: unchanged)
                           [ADMITTED, engine, request_id, seconds waited]
                           [REJECTED, engine, request_id, kind, message]
                           [STATS, engine, stats]           when the engine goes idle

A row is one `RequestOutput`: (request_id, token_id, position, seed, text,
finish_reason, extra), with `extra` None unless the output carries logprobs, a message, a
stop reason or prompt logprobs, so the common token costs seven small fields. Its graph
key stays in the engine. SamplingParams travel pickled: both ends are this package, and
a grammar's spec rides along.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import zmq

from graphexec.params import SamplingParams
from graphexec.request import PromptLogprob, RequestOutput

ADD, ABORT, OUTPUTS, ADMITTED, REJECTED, STATS = range(6)
# REJECTED kinds: the API server raises ValueError, ExecutorFullError, QueueFullError,
# RuntimeError (a 500)
BAD_REQUEST, NEVER_FITS, QUEUE_FULL, INTERNAL = (
    "bad_request",
    "never_fits",
    "queue_full",
    "internal",
)


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A bound receiving end (a `zmq.asyncio.Context` gives an awaitable one); never drops
    or blocks a sender: the loops drain it."""
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 0)
    s.bind(addr)
    return s


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A connected sending end, unbounded, that drops what is unsent at close."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def pack(msg: list[Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def add(server: int, request_id: str, prompt: list[int], params: SamplingParams) -> bytes:
    return pack([ADD, server, request_id, prompt, pickle.dumps(params)])


def params_of(blob: bytes) -> SamplingParams:
    return pickle.loads(blob)


def _extra(o: RequestOutput) -> list | None:
    if o.logprob is None and o.message is None and o.stop_reason is None \
            and o.prompt_logprobs is None:  # fmt: skip
        return None
    plp = o.prompt_logprobs
    if plp is not None:
        plp = [None if e is None else [e.token_id, e.logprob, e.rank, e.top_logprobs]
               for e in plp]  # fmt: skip
    return [o.logprob, o.rank, o.top_logprobs, o.message, o.stop_reason, plp]


def row(o: RequestOutput) -> list:
    reason = o.finish_reason if o.finished else None
    return [o.request_id, o.token_id, o.position, o.seed, o.text, reason, _extra(o)]


def output(r: list) -> RequestOutput:
    rid, token, position, seed, text, reason, extra = r
    o = RequestOutput(rid, token, position, seed, finished=reason is not None,
                      finish_reason=reason, text=text)  # fmt: skip
    if extra is not None:
        o.logprob, o.rank, top, o.message, o.stop_reason, plp = extra
        o.top_logprobs = None if top is None else [(i, lp) for i, lp in top]
        if plp is not None:
            o.prompt_logprobs = [None if e is None else
                                 PromptLogprob(e[0], e[1], e[2], [(i, lp) for i, lp in e[3]])
                                 for e in plp]  # fmt: skip
    return o
