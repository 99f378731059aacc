"""Model outputs are checked (shape, dtype), padded vocabularies are never sampled past
V, and +inf logits are reported as the model's fault."""

from __future__ import annotations

import re

import pytest
import torch

import graphexec as gx
from tests.engine.scripted import drain, tokens

P = gx.SamplingParams
V = 200


class Wrong(gx.models.TableModel):
    """decode returns `how` (a wrong width, 1-D, float64 or int logits)."""

    def __init__(self, how: str) -> None:
        super().__init__(V, seed=0)
        self.how = how

    def decode(self, input_ids, positions, slot_ids):
        x = super().decode(input_ids, positions, slot_ids)
        if self.how == "width":
            return torch.cat([x, torch.zeros(x.shape[0], 10)], dim=1)
        if self.how == "1d":
            return x[:, 0]
        return x.to(torch.float64 if self.how == "float64" else torch.int64)


EXPECT = {"width": r"Wrong.decode returned logits of shape \[\d+, 210\]; expected \[\d+, 200\]",
          "1d": r"shape \[\d+\]; expected \[\d+, 200\]", "float64": "torch.float64",
          "int": "torch.int64"}  # fmt: skip


@pytest.mark.parametrize("how", list(EXPECT))
@pytest.mark.parametrize("graphs", [True, False])
def test_a_wrong_model_output_ends_its_requests_with_error(how: str, graphs: bool) -> None:
    ex = gx.DecodeExecutor(Wrong(how), max_batch_size=4, device="cpu", cuda_graphs=graphs)
    if graphs:
        ex.capture(progress=False)
        assert not ex.graph_keys and len(ex.stats.failed) == 3 * 3 * 2  # buckets 1, 2, 4
        assert all(re.search(EXPECT[how].replace(r"\d+", "1"), e) for e in ex.stats.failed.values())
    ex.add_request("a", [1], P(seed=1, max_tokens=5))
    ex.add_request("b", [2], P(seed=2, max_tokens=5))
    outs = drain(ex)  # ends: the executor is not wedged
    for rid in "ab":
        (last,) = outs[rid]  # the first token is the decode row's: it fails
        assert last.finish_reason == "error" and last.token_id is None and last.position == 0
        assert re.search(EXPECT[how], last.message), last.message
    ex.add_request("a", [1], P(seed=1, max_tokens=1))  # not wedged: it ends again
    assert drain(ex)["a"][-1].finish_reason == "error" and ex.idle and ex.free_slots == 4


class WrongPrefill(gx.models.TableModel):
    """prefill_batch returns logits one column too wide, and raises on token 13."""

    def prefill_batch(self, batch):
        if (batch.token_ids == 13).any():
            raise RuntimeError("token 13")
        x = super().prefill_batch(batch)
        return None if x is None else torch.zeros(x.shape[0], V + 1)


def test_a_wrong_or_failing_prefill_ends_those_requests_only() -> None:
    ex = gx.DecodeExecutor(WrongPrefill(V, seed=0), max_batch_size=4, device="cpu")
    ex.add_request("ok", [1, 2], P(seed=1, max_tokens=4))
    first = list(ex.step())  # "ok" decodes when the others arrive
    ex.add_request("lp", [1, 2, 3], P(seed=1, prompt_logprobs=1))  # its logits are checked
    ex.add_request("raises", [13, 2], P(seed=1))
    outs = drain(ex)
    outs["ok"] = first + outs["ok"]
    for rid, msg in (("lp", "WrongPrefill.prefill_batch returned logits of shape"),
                     ("raises", "prefill failed: RuntimeError: token 13")):  # fmt: skip
        (o,) = outs[rid]
        assert o.finish_reason == "error" and msg in o.message and o.position == 0
    assert len(tokens(outs["ok"])) == 4 and outs["ok"][-1].finish_reason == "length"
    assert ex.idle and ex.free_slots == 4


class Padded(gx.models.TableModel):
    """vocab_size V + 12 whose last 12 columns outscore every real token."""

    def __init__(self) -> None:
        super().__init__(V + 12, seed=0)
        self.inner = gx.models.TableModel(V, seed=0)

    def bind(self, num_slots, device):
        super().bind(num_slots, device)
        self.inner.bind(num_slots, device)

    def prefill(self, slot, token_ids, all_logits=False):
        x = self.inner.prefill(slot, token_ids, all_logits)
        return torch.cat([x, torch.full((*x.shape[:-1], 12), 1e4)], dim=-1)

    def decode(self, input_ids, positions, slot_ids):
        x = self.inner.decode(input_ids, positions, slot_ids)
        return torch.cat([x, torch.full((x.shape[0], 12), 1e4)], dim=1)


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    ex = gx.DecodeExecutor(Padded(), max_batch_size=4, device="cpu", vocab_size=V)
    ex.capture(progress=False)
    ref = gx.DecodeExecutor(gx.models.TableModel(V, seed=0), max_batch_size=4, device="cpu")
    ref.capture(progress=False)
    for e in (ex, ref):
        e.add_request("g", [3], P(temperature=0.0, max_tokens=6))
        e.add_request("s", [3], P(seed=4, max_tokens=6, top_k=10))
    got, want = drain(ex), drain(ref)
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in want.items()}
    with pytest.raises(ValueError, match="vocab_size"):
        gx.DecodeExecutor(gx.models.TableModel(V, seed=0), device="cpu", vocab_size=V + 1)


class InfAt(gx.models.TableModel):
    """Rows at model position 3 are +inf everywhere."""

    def decode(self, input_ids, positions, slot_ids):
        x = super().decode(input_ids, positions, slot_ids)
        return torch.where((positions == 3)[:, None], float("inf"), x)


def test_inf_rows_are_reported_as_the_models_fault() -> None:
    ex = gx.DecodeExecutor(InfAt(V, seed=0), max_batch_size=4, device="cpu")
    ex.capture(progress=False)
    ex.add_request("bad", [1, 2], P(seed=1, max_tokens=10))  # model position 3 at token 2
    ex.add_request("good", [1, 2, 3, 4, 5], P(seed=2, max_tokens=10, logit_bias={7: 100}))
    outs = drain(ex)
    assert outs["bad"][-1].finish_reason == "error" and "+inf" in outs["bad"][-1].message
    assert len(tokens(outs["bad"])) == 2
    assert outs["good"][-1].finish_reason == "length"  # a +100 bias is no fault


def test_constructor_arguments_are_checked_up_front() -> None:
    m = gx.models.TableModel(V, seed=0)
    with pytest.raises(ValueError, match="backend"):
        gx.DecodeExecutor(m, device="cpu", backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            gx.DecodeExecutor(m, device="cuda")
    with pytest.raises(ValueError, match="device"):
        gx.DecodeExecutor(m, device="gpu0")
    with pytest.raises(ValueError, match="not a DecodeModel"):
        gx.DecodeExecutor(object(), device="cpu")
