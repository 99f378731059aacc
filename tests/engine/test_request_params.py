"""The OpenAI / vLLM request parameters in the executor: stop strings, min_tokens,
ignore_eos, allowed_token_ids, bad_words, n, prompt_logprobs, and per-token text."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphexec as gx
from graphexec.params import stream_seed
from tests.engine.scripted import EOS, ScriptModel, byte_tokenizer, drain, tokens

P = gx.SamplingParams
V = 300


def text_of(outs: list[gx.RequestOutput]) -> str:
    return "".join(o.text or "" for o in outs)


def script_executor(text: str, **kw) -> gx.DecodeExecutor:
    tok = byte_tokenizer()
    model = ScriptModel(
        tok.vocab_size, list(text.encode()) + [EOS], runner_up=kw.pop("runner_up", None)
    )
    ex = gx.DecodeExecutor(model, max_batch_size=4, device="cpu", tokenizer=tok, seed=1, **kw)
    ex.capture(progress=False)
    return ex


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries_cuts_the_text(include: bool) -> None:
    ex = script_executor("ab STOP cd")
    ex.add_request("r", [65], P(temperature=0.0, stop=["STOP", "zzz"], max_tokens=30,
                                include_stop_str_in_output=include))  # fmt: skip
    outs = drain(ex)["r"]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "STOP"
    assert len(outs) == len("ab STOP")  # one output per token up to the match
    assert text_of(outs) == ("ab STOP" if include else "ab ")
    # text that may start a stop string is held back, never reported then taken back
    assert all("S" not in (o.text or "") for o in outs[:-1])


def test_text_never_holds_a_partial_utf8_character_and_eos_adds_none() -> None:
    ex = script_executor("né 世界!")
    ex.add_request("r", [65], P(temperature=0.0, max_tokens=40))
    outs = drain(ex)["r"]
    assert outs[-1].token_id == EOS and outs[-1].finish_reason == "stop"
    assert all("\ufffd" not in o.text for o in outs)
    assert text_of(outs) == "né 世界!"
    assert sum(o.text == "" for o in outs) >= 5  # continuation bytes and EOS add nothing


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    # the script wants EOS first; the runner-up (token 7) is what min_tokens leaves
    for mode in (None, "eager"):
        ex = script_executor("", runner_up=7)
        ex.add_request("a", [65], P(temperature=0.0, max_tokens=20))
        ex.add_request("b", [65], P(temperature=0.0, max_tokens=20, min_tokens=4))
        ex.add_request("c", [65], P(temperature=0.0, max_tokens=20, min_tokens=3, ignore_eos=True,
                                    stop_token_ids=(7,)))  # fmt: skip
        outs = drain(ex, mode)
        assert tokens(outs["a"]) == [EOS]
        assert tokens(outs["b"]) == [7, 7, 7, 7, EOS] and outs["b"][-1].finish_reason == "stop"
        # c: EOS does not stop it, and the stop id 7 is held back for 3 tokens
        assert tokens(outs["c"])[:4] == [EOS, EOS, EOS, EOS]


def test_ignore_eos_runs_to_max_tokens() -> None:
    ex = script_executor("")
    ex.add_request("r", [65], P(temperature=0.0, max_tokens=5, ignore_eos=True))
    outs = drain(ex)["r"]
    assert tokens(outs) == [EOS] * 5 and outs[-1].finish_reason == "length"


def table_executor(**kw) -> gx.DecodeExecutor:
    model = kw.pop("model", None) or gx.models.TableModel(V, seed=0)
    ex = gx.DecodeExecutor(model, max_batch_size=8, device="cpu", seed=3, **kw)
    if ex.cuda_graphs:
        ex.capture(progress=False)
    return ex


MASKED = {
    "allowed": P(seed=1, max_tokens=12, allowed_token_ids=[3, 7, 11, 200]),
    "bad": P(seed=2, max_tokens=12, temperature=0.3, bad_words=[(5,), (9, 12)]),
    "min": P(seed=3, max_tokens=12, min_tokens=6, stop_token_ids=(17, 40, 41, 299)),
    "plain": P(seed=4, max_tokens=12, top_k=20),
}


def test_allowed_ids_and_bad_words_hold_in_every_token() -> None:
    outs = drain_masked(table_executor())
    assert set(tokens(outs["allowed"])) <= {3, 7, 11, 200}
    bad = tokens(outs["bad"])
    assert 5 not in bad and not any(a == 9 and b == 12 for a, b in zip(bad, bad[1:], strict=False))
    assert len(tokens(outs["min"])) >= 6


def drain_masked(ex, mode=None, params=MASKED):
    for name, p in params.items():
        ex.add_request(name, [1, 2], p)
    return drain(ex, mode)


def test_bad_word_bans_only_the_completing_token() -> None:
    # the script alternates 9, 12: with (9, 12) banned, 12 never follows 9, yet 12 may
    # start the output (nothing precedes it)
    tok = byte_tokenizer()
    model = ScriptModel(tok.vocab_size, [12, 9, 12, 9, 12], runner_up=30)
    ex = gx.DecodeExecutor(model, max_batch_size=2, device="cpu", seed=1)
    ex.add_request("r", [65], P(temperature=0.0, max_tokens=5, bad_words=[(9, 12)]))
    assert tokens(drain(ex)["r"]) == [12, 9, 30, 9, 30]


def test_masked_parameters_replay_equals_eager() -> None:
    replay = drain_masked(table_executor())
    eager = drain_masked(table_executor(), "eager")
    assert {k: tokens(v) for k, v in replay.items()} == {k: tokens(v) for k, v in eager.items()}


def test_masked_parameters_with_speculation_equal_without() -> None:
    plain = drain_masked(table_executor())
    spec = gx.SpeculativeConfig(num_draft_tokens=2, drafter="ngram")
    with_spec = drain_masked(table_executor(speculative=spec))
    assert {k: tokens(v) for k, v in with_spec.items()} == {k: tokens(v) for k, v in plain.items()}


class CountingTable(gx.models.TableModel):
    prefills = 0

    def prefill_batch(self, batch):
        self.prefills += 1
        return super().prefill_batch(batch)


def test_n_streams_share_one_prefill_and_equal_separate_requests() -> None:
    model = CountingTable(V, seed=0)
    ex = table_executor(model=model)
    p = P(seed=5, max_tokens=6, top_p=0.9, n=3)
    ex.add_request("r", [4, 5, 6], p)
    assert ex.free_slots == 5
    outs = drain(ex)
    assert model.prefills == 1 and sorted(outs) == ["r/0", "r/1", "r/2"]
    ref = table_executor()
    for i in range(3):
        ref.add_request(f"s{i}", [4, 5, 6], dataclasses.replace(p, n=1, seed=stream_seed(5, i)))
    solo = drain(ref)
    for i in range(3):
        assert tokens(outs[f"r/{i}"]) == tokens(solo[f"s{i}"])
        assert outs[f"r/{i}"][0].seed == stream_seed(5, i)
    assert len({tuple(tokens(outs[f"r/{i}"])) for i in range(3)}) > 1


def test_abort_of_an_n_request_aborts_every_stream() -> None:
    ex = table_executor()
    ex.add_request("r", [4], P(seed=5, max_tokens=50, n=2))
    ex.step()
    ex.abort("r")
    outs = list(ex.step())
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        ("r/0", "abort"),
        ("r/1", "abort"),
    ]
    assert ex.abort("r") is False  # every stream ended and was reported: a no-op
    assert ex.abort("r/0") is False
    ex.add_request("r", [4], P(seed=5, max_tokens=2))  # the id is free again


def test_prompt_logprobs_equal_log_softmax_of_the_prefill() -> None:
    model = gx.models.TableModel(V, seed=0)
    ex = table_executor(model=model)
    prompt = [4, 250, 6, 6, 19]
    ex.add_request("r", prompt, P(seed=1, max_tokens=2, prompt_logprobs=3))
    first = drain(ex)["r"][0]
    lp = torch.log_softmax(model.prefill(0, torch.tensor(prompt), all_logits=True), dim=-1)
    got = first.prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for i, e in enumerate(got[1:]):
        row = lp[i]
        assert e.token_id == prompt[i + 1]
        assert e.logprob == pytest.approx(float(row[prompt[i + 1]]), rel=1e-6)
        assert e.rank == int((row > row[prompt[i + 1]]).sum()) + 1
        top = torch.topk(row, 3)
        assert [t for t, _ in e.top_logprobs] == top.indices.tolist()
        assert [v for _, v in e.top_logprobs] == pytest.approx(top.values.tolist(), rel=1e-6)


def test_parameters_that_need_a_tokenizer_say_so() -> None:
    ex = table_executor()
    with pytest.raises(ValueError, match="stop needs a tokenizer"):
        ex.add_request("r", [1], P(stop="x"))
    with pytest.raises(ValueError, match="bad_words"):
        ex.add_request("r", [1], P(bad_words=["word"]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        ex.add_request("r", [1], P(allowed_token_ids=[V]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        ex.add_request("r", [1.0, 2.0], P())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        ex.add_request("r", torch.tensor([1.5]), P())
    ex.add_request("r", torch.tensor([1, 2]), P(seed=1, max_tokens=1))  # int tensors are fine


def test_a_length_cut_inside_a_character_drops_its_bytes_not_a_replacement_char() -> None:
    """The byte tokenizer spells "é" (C3 A9) and "😀" (F0 9F 98 80) over several tokens:
    max_tokens ending inside one gives the text before it, never U+FFFD; with room for
    every byte the character comes out whole, from the token that completes it."""
    tok = byte_tokenizer()
    script = [0x61, 0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80, 0x62]
    for max_tokens, want in ((2, "a"), (3, "aé"), (5, "aé"), (6, "aé"), (7, "aé😀"), (8, "aé😀b")):
        model = ScriptModel(tok.vocab_size, script)
        ex = gx.DecodeExecutor(model, max_batch_size=1, device="cpu", seed=1, tokenizer=tok)
        ex.add_request("r", [65], P(temperature=0.0, max_tokens=max_tokens))
        outs = drain(ex)["r"]
        text = "".join(o.text or "" for o in outs)
        assert text == want and "\ufffd" not in text, (max_tokens, text)
        assert outs[-1].finish_reason == "length"
