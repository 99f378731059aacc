"""TinyLM: seeded weights, a KV cache per slot, decode consistent with prefill."""

from __future__ import annotations

import pytest
import torch

from graphexec.models import DecodeModel, TinyLM

V = 500


def model(seed: int = 0, slots: int = 4) -> TinyLM:
    m = TinyLM(V, seed=seed, dim=32, layers=2, heads=2, max_seq_len=16)
    m.bind(slots, "cpu")
    return m


def test_is_a_decode_model_and_seeded() -> None:
    a, b, c = model(0), model(0), model(1)
    assert isinstance(a, DecodeModel)
    p = torch.tensor([3, 4, 5])
    assert torch.equal(a.prefill(0, p), b.prefill(0, p))
    assert not torch.equal(a.prefill(0, p), c.prefill(0, p))


def test_decode_continues_the_prefill_of_its_slot() -> None:
    m = model()
    full = m.prefill(0, torch.tensor([3, 4, 5, 6]))
    m.prefill(1, torch.tensor([3, 4, 5]))
    m.prefill(2, torch.tensor([9, 9, 9]))  # another slot's cache must not matter
    step = m.decode(torch.tensor([6, 7]), torch.tensor([3, 3]), torch.tensor([1, 2]))
    assert step.shape == (2, V) and step.dtype == torch.float32
    torch.testing.assert_close(step[0], full, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(step[1], full, atol=1e-2)


def test_rows_of_a_batch_are_independent() -> None:
    m = model()
    for s in range(3):
        m.prefill(s, torch.tensor([s + 1, s + 2]))
    ids, pos = torch.tensor([4, 5, 6]), torch.tensor([2, 2, 2])
    batch = m.decode(ids, pos, torch.tensor([0, 1, 2]))
    for r in range(3):
        m.prefill(r, torch.tensor([r + 1, r + 2]))  # restore the cache the step wrote
        one = m.decode(ids[r : r + 1], pos[r : r + 1], torch.tensor([r]))
        torch.testing.assert_close(one[0], batch[r], rtol=1e-5, atol=1e-5)


def test_bad_prompts_and_unbound_model() -> None:
    m = model()
    with pytest.raises(ValueError, match="prompt length"):
        m.prefill(0, torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="prompt length"):
        m.prefill(0, torch.arange(17))
    with pytest.raises(RuntimeError, match="bind"):
        TinyLM(V, dim=32, heads=2).prefill(0, torch.tensor([1]))
    with pytest.raises(ValueError, match="multiple of heads"):
        TinyLM(V, dim=30, heads=4)
