"""The in-graph request parameters on CUDA (Triton sampler, captured graphs): min_tokens,
allowed_token_ids and bad_words equal in replay and eager, with and without speculation;
padded vocabularies and +inf rows."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from tests.engine.scripted import EOS, ScriptModel, byte_tokenizer, drain, tokens

pytestmark = pytest.mark.gpu
P = gx.SamplingParams


@pytest.fixture(scope="module")
def tok() -> gx.Tokenizer:
    return gx.Tokenizer.cl100k()


def params(tok) -> dict[str, gx.SamplingParams]:
    v = tok.vocab_size
    return {
        "allowed": P(seed=1, max_tokens=24, allowed_token_ids=[3, 7, 11, 200, v - 1], logprobs=2),
        "bad": P(seed=2, max_tokens=24, temperature=0.4, bad_words=[(5,), (9, 12), "the"]),
        "min": P(seed=3, max_tokens=24, min_tokens=20, stop_token_ids=(17, 40, 41)),
        "min_topk": P(seed=4, max_tokens=24, min_tokens=10, top_k=5, top_p=0.9),
        "plain": P(seed=5, max_tokens=24, min_p=0.05),
    }


def run(tok, mode=None, spec=None) -> dict[str, list[int]]:
    model = gx.models.TableModel(tok.vocab_size, seed=0)
    ex = gx.DecodeExecutor(model, max_batch_size=8, device="cuda", tokenizer=tok, seed=0,
                           speculative=spec)  # fmt: skip
    ex.capture(progress=False)
    assert ex.stats.failed == {}
    for name, p in params(tok).items():
        ex.add_request(name, [1, 2, 3], p)
    return {k: tokens(v) for k, v in drain(ex, mode).items()}


def test_masked_parameters_replay_eager_and_speculation_agree(tok) -> None:
    replay = run(tok)
    assert run(tok, "eager") == replay
    draft = gx.models.TableModel(tok.vocab_size, seed=0)  # equal to the target
    for drafter, k in (("ngram", 3), (draft, 2)):
        spec = gx.SpeculativeConfig(num_draft_tokens=k, drafter=drafter)
        assert run(tok, spec=spec) == replay
    assert set(replay["allowed"]) <= {3, 7, 11, 200, tok.vocab_size - 1}
    bad = replay["bad"]
    the = set(tok.encode("the")) | set(tok.encode(" the"))
    assert not (set(bad) & ({5} | the)) and (9, 12) not in set(zip(bad, bad[1:], strict=False))
    assert len(replay["min"]) >= 20


def test_min_tokens_holds_eos_back_on_the_gpu() -> None:
    btok = byte_tokenizer()
    model = ScriptModel(btok.vocab_size, [EOS], runner_up=7)
    ex = gx.DecodeExecutor(model, max_batch_size=4, device="cuda", tokenizer=btok, seed=1)
    ex.capture(progress=False)
    ex.add_request("a", [65], P(temperature=0.0, max_tokens=9))
    ex.add_request("b", [65], P(temperature=0.0, max_tokens=9, min_tokens=4))
    ex.add_request("c", [65], P(temperature=0.8, max_tokens=9, min_tokens=6, seed=3))
    outs = drain(ex)
    assert tokens(outs["a"]) == [EOS] and tokens(outs["b"]) == [7, 7, 7, 7, EOS]
    assert EOS not in tokens(outs["c"])[:6]


class Padded(gx.models.TableModel):
    def __init__(self, v: int) -> None:
        super().__init__(v + 64, seed=0)
        self.inner = gx.models.TableModel(v, seed=0)

    def bind(self, num_slots, device):
        super().bind(num_slots, device)
        self.inner.bind(num_slots, device)

    def _pad(self, x):
        return torch.cat([x, torch.full((*x.shape[:-1], 64), 1e4, device=x.device)], dim=-1)

    def prefill(self, slot, token_ids, all_logits=False):
        return self._pad(self.inner.prefill(slot, token_ids, all_logits))

    def decode(self, input_ids, positions, slot_ids):
        x = self.inner.decode(input_ids, positions, slot_ids)
        return self._pad(torch.where((positions == 6)[:, None], float("inf"), x))


def test_padded_vocabulary_and_inf_rows_on_the_gpu(tok) -> None:
    v = tok.vocab_size
    ex = gx.DecodeExecutor(Padded(v), max_batch_size=4, device="cuda", tokenizer=tok, seed=0)
    ex.capture(progress=False)
    assert ex.stats.failed == {}
    ex.add_request("short", [1, 2], P(seed=1, max_tokens=4, top_k=40))  # model pos <= 5
    ex.add_request("long", [1, 2], P(seed=2, max_tokens=12))  # meets +inf at position 6
    outs = drain(ex)
    assert all(0 <= t < v for t in tokens(outs["short"]) + tokens(outs["long"]))
    assert outs["short"][-1].finish_reason == "length"
    assert outs["long"][-1].finish_reason == "error" and "+inf" in outs["long"][-1].message
