"""TableModel: logits depend on (position, last token, seed) only."""

from __future__ import annotations

import pytest
import torch

from graphexec.models import DecodeModel, TableModel

V = 300


def test_is_a_decode_model() -> None:
    assert isinstance(TableModel(V), DecodeModel)


def test_rows_depend_on_position_and_last_token_not_slot_or_batch() -> None:
    m = TableModel(V, seed=3)
    ids = torch.tensor([5, 7, 5, 9])
    pos = torch.tensor([2, 2, 4, 2])
    full = m.decode(ids, pos, torch.tensor([0, 1, 2, 3]))
    assert full.shape == (4, V) and full.dtype == torch.float32
    for r in range(4):
        alone = m.decode(ids[r : r + 1], pos[r : r + 1], torch.tensor([17]))
        assert torch.equal(alone[0], full[r])
    assert not torch.equal(full[0], full[1])  # other last token
    assert not torch.equal(full[0], full[2])  # other position
    assert not torch.equal(full[0], TableModel(V, seed=4).decode(ids[:1], pos[:1], ids[:1])[0])


def test_prefill_matches_decode_of_the_last_prompt_token() -> None:
    m = TableModel(V, seed=1)
    prompt = torch.tensor([11, 12, 13])
    d = m.decode(torch.tensor([13]), torch.tensor([2]), torch.tensor([0]))[0]
    assert torch.equal(m.prefill(0, prompt), d)
    with pytest.raises(ValueError, match="prompt length"):
        m.prefill(0, torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="prompt length"):
        TableModel(V, max_seq_len=2).prefill(0, prompt)


def test_rows_have_a_peaked_spread() -> None:
    x = TableModel(V, seed=2).decode(torch.arange(8), torch.arange(8), torch.arange(8))
    p = torch.softmax(x, dim=-1)
    top = p.max(dim=-1).values
    assert (top > 5.0 / V).all() and (top < 0.5).all()
