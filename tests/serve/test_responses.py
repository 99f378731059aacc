"""The SSE token event's fast path and the tokens-per-second ring of /metrics."""

from __future__ import annotations

import json

import pytest

from graphexec.request import RequestOutput
from graphexec.serve import metrics as metrics_mod
from graphexec.serve.metrics import ServerMetrics
from graphexec.serve.responses import Choice, Shape


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_token_event_fast_path_equals_the_built_event(chat: bool, usage: bool) -> None:
    shape = Shape(chat, "cmpl-x", 'm"odel', logprobs=False, include_usage=usage)
    for index, seed in ((0, 7), (3, 2**62)):
        c = Choice(index)
        for piece in ("hello", ' "quoted"\n', "été ☃", "", None, "\\", "\x01"):
            c.add(RequestOutput("r", 5, 0, seed, text=piece), str)
            fast = shape.chunk(c, piece)
            assert fast == shape._chunk(c, piece, None, None, False)
            body = json.loads(fast.removeprefix("data: "))
            got = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
            assert got == (piece or "") and body["choices"][0]["seed"] == seed


def test_tokens_per_second_ring_is_bounded_and_forgets_old_seconds(monkeypatch) -> None:
    now = [1000.2]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    m = ServerMetrics()
    for t in range(20):  # 20 seconds of 100 tokens each
        now[0] = 1000.2 + t
        for _ in range(100):
            m.token()
    assert m.tokens == 2000 and len(m._per_s) == int(metrics_mod.RATE_WINDOW_S) + 1
    assert m.tokens_per_s() == pytest.approx(100.0)  # the last 10 whole seconds
    now[0] += 5  # seconds 1014..1023 count: 1014..1019 had 100 each, then 4 quiet ones
    assert m.tokens_per_s() == pytest.approx(60.0)
    now[0] += 100
    assert m.tokens_per_s() == 0.0


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_end_with_the_last_token_the_text_shows(chat: bool) -> None:
    """The end-of-turn token (EOS, a stop token id, a grammar's end) that finishes a
    request adds no text: the logprobs do not list it and no event carries it, as
    OpenAI's answers end with the text's last token. A stop string's token stays."""
    shape = Shape(chat, "x", "m", logprobs=True, include_usage=False)
    entries = "content" if chat else "tokens"
    for why in (None, 7):  # EOS; a stop token id
        c = Choice(0)
        c.add(RequestOutput("r", 5, 0, 1, logprob=-0.5, top_logprobs=[], text="Hi"), str)
        end = RequestOutput("r", 9, 1, 1, logprob=-0.1, top_logprobs=[], text="", finished=True,
                            finish_reason="stop", stop_reason=why)  # fmt: skip
        assert c.add(end, str) == "" and not c.shows(end)
        full = shape.full([c], 1)["choices"][0]
        assert len(full["logprobs"][entries]) == 1 and full["finish_reason"] == "stop"
    c = Choice(0)
    cut = RequestOutput("r", 5, 0, 1, logprob=-0.5, top_logprobs=[], text="", finished=True,
                        finish_reason="stop", stop_reason="\n")  # fmt: skip
    c.add(cut, str)
    assert c.shows(cut) and len(shape.full([c], 1)["choices"][0]["logprobs"][entries]) == 1
