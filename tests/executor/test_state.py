"""SlotTable: staged writes, complete resets, the padding slot."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.sampling.tensors import SamplingTensors
from graphexec.state import SlotTable

P = gx.SamplingParams
V = 50
COLUMNS = ["temperature", "inv_temperature", "top_k", "top_p", "min_p", "seed",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
           "logprobs_processed", "bias_ids", "bias_values"]  # fmt: skip


def row(table: SamplingTensors, slot: int) -> dict[str, torch.Tensor]:
    return {c: getattr(table, c)[slot].clone() for c in COLUMNS}


def test_assign_takes_lowest_free_slot_and_never_the_padding_slot() -> None:
    st = SlotTable(3, V, "cpu")
    slots = [st.assign(P(seed=i)) for i in range(3)]
    assert slots == [0, 1, 2] and st.free_slots == 0 and st.padding_slot == 3
    with pytest.raises(RuntimeError, match="slots"):
        st.assign(P(seed=9))
    st.release(1)
    assert st.assign(P(seed=10)) == 1


def test_writes_are_staged_until_flush() -> None:
    st = SlotTable(2, V, "cpu")
    p = P(temperature=0.5, top_k=7, top_p=0.8, seed=42, logit_bias={3: 1.5}, logprobs=2)
    s = st.assign(p, prompt_token_ids=[4, 9])
    assert st.tensors.seed[s] == 0 and not st.tensors.prompt_mask[s].any()
    st.flush()
    expect = SamplingTensors.allocate(1, V, "cpu", max_bias=16)
    expect.write_rows(torch.tensor([0]), [p], V)
    for name, value in row(st.tensors, s).items():
        assert torch.equal(value, getattr(expect, name)[0]), name
    assert st.tensors.prompt_mask[s].nonzero().flatten().tolist() == [4, 9]


def test_release_resets_the_slot_completely() -> None:
    st = SlotTable(2, V, "cpu")
    fresh = row(st.tensors, 0)
    s = st.assign(P(temperature=0.3, min_p=0.2, seed=5, presence_penalty=1.0,
                    logit_bias={1: 2.0}), prompt_token_ids=[2])  # fmt: skip
    st.flush()
    st.tensors.token_counts[s, 7] = 3  # what the captured step would have written
    st.positions[s] = 11
    st.release(s)
    st.flush()
    for name, value in row(st.tensors, s).items():
        assert torch.equal(value, fresh[name]), name
    assert not st.tensors.token_counts[s].any() and not st.tensors.prompt_mask[s].any()
    assert st.positions[s] == 0


def test_bad_uses_raise_clear_errors() -> None:
    st = SlotTable(2, V, "cpu", max_bias=1)
    with pytest.raises(ValueError, match="seed"):
        st.assign(P())
    with pytest.raises(ValueError, match="logit_bias"):
        st.assign(P(seed=1, logit_bias={1: 1.0, 2: 1.0}))
    with pytest.raises(ValueError, match="top_k"):
        st.assign(P(seed=1, top_k=V + 1))
    with pytest.raises(ValueError, match="slot 1"):
        st.release(1)
    with pytest.raises(ValueError, match="max_slots"):
        SlotTable(0, V, "cpu")
