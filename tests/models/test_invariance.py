"""The batch-invariant forward, model by model (CPU route): a row's logits are the same bits
alone and in a batch, verify is one forward equal to K + 1 decodes, and a prompt
prefilled in chunks writes the cache of the whole prompt."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.models import PrefillBatch
from graphexec.models.hf_random import random_state_dict

V, SLOTS, T = 300, 6, 96
CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=128, vocab_size=V, max_position_embeddings=T,
           initializer_range=0.2)  # fmt: skip


def model(kind: str, dtype=torch.float32):
    if kind == "tiny":
        m = gx.models.TinyLM(V, seed=3, dim=32, heads=2, max_seq_len=T, dtype=dtype)
    else:
        state = random_state_dict(CFG, seed=0, dtype=dtype)
        m = gx.models.HFTransformer(CFG, state, dtype=dtype, max_seq_len=T)
    m.bind(SLOTS, "cpu")
    return m


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


KINDS = ["hf", "tiny"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_verify_is_one_forward_equal_to_k_plus_1_decodes(kind, dtype) -> None:
    a, b = model(kind, dtype), model(kind, dtype)
    for m in (a, b):
        m.prefill_batch(PrefillBatch.build([(0, 0, prompt(9, 0)), (1, 0, prompt(4, 1)),
                                            (3, 0, prompt(20, 2))], "cpu"))  # fmt: skip
    ids = torch.tensor([prompt(4, 5), prompt(4, 6), prompt(4, 7)])
    pos, slots = torch.tensor([9, 4, 20]), torch.tensor([0, 1, 3])
    got = a.verify(ids, pos, slots)
    for t in range(4):
        assert torch.equal(got[:, t], b.decode(ids[:, t], pos + t, slots)), t
    assert torch.equal(a.kv_cache, b.kv_cache)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_past_the_cache_writes_only_the_padding_slot(kind) -> None:
    """A row whose drafts run past max_seq_len: its real rows are decode's bits, and the
    rows past the end write the padding slot, never the last position of its own."""
    a, b = model(kind), model(kind)
    for m in (a, b):
        m.prefill(2, torch.tensor(prompt(T - 2, 8)))
    ids, pos, slots = torch.tensor([prompt(4, 9)]), torch.tensor([T - 2]), torch.tensor([2])
    got = a.verify(ids, pos, slots)
    for t in range(2):
        assert torch.equal(got[:, t], b.decode(ids[:, t], pos + t, slots))
    assert torch.equal(a.kv_cache[:, :, 2], b.kv_cache[:, :, 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_writes_the_whole_prompts_cache(kind, dtype) -> None:
    p, q = prompt(70, 10), prompt(33, 11)
    whole, chunked = model(kind, dtype), model(kind, dtype)
    want = whole.prefill_batch(PrefillBatch.build([(1, 0, p), (4, 0, q)], "cpu", [69, 102]))
    chunks = [[(1, 0, p[:8]), (4, 0, q[:5])], [(4, 5, q[5:]), (1, 8, p[8:40])], [(1, 40, p[40:])]]
    got = []
    for c in chunks:
        last = [sum(len(s[2]) for s in c) - 1] if c[-1][0] == 1 and c[-1][1] == 40 else None
        out = chunked.prefill_batch(PrefillBatch.build(c, "cpu", last))
        if out is not None:
            got.append(out[0])
    assert torch.equal(got[0], want[0])
    for s in (1, 4):
        assert torch.equal(chunked.kv_cache[:, :, s], whole.kv_cache[:, :, s]), s


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_bits_alone_and_in_a_batch(kind) -> None:
    m = model(kind)
    for s in range(4):
        m.prefill(s, torch.tensor(prompt(5 + 7 * s, 20 + s)))
    ids, pos, slots = torch.tensor([3, 7, 11, 13]), torch.tensor([5, 12, 19, 26]), torch.arange(4)
    batch = m.decode(ids, pos, slots)
    for r in range(4):
        alone = m.decode(ids[r : r + 1], pos[r : r + 1], slots[r : r + 1])
        assert torch.equal(alone[0], batch[r]), r
    swapped = m.decode(ids.flip(0), pos.flip(0), slots.flip(0))
    assert torch.equal(swapped.flip(0), batch)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_bits_beside_rows_that_reach_further(kind) -> None:
    """The CPU route reads key blocks up to the furthest position in the call: a short
    row beside rows several blocks further on gets its bits alone."""
    long_t = 700  # CPU_BLOCK = 256: positions below reach blocks 0, 1 and 2
    if kind == "tiny":
        m = gx.models.TinyLM(V, seed=3, dim=32, heads=2, max_seq_len=long_t)
    else:
        cfg = dict(CFG, max_position_embeddings=long_t)
        m = gx.models.HFTransformer(cfg, random_state_dict(cfg, seed=0, dtype=torch.float32),
                                    dtype=torch.float32, max_seq_len=long_t)  # fmt: skip
    m.bind(SLOTS, "cpu")
    m.prefill(0, torch.tensor(prompt(9, 30)))
    ids, pos, slots = torch.tensor([3, 7, 11]), torch.tensor([9, 300, 650]), torch.arange(3)
    alone = m.decode(ids[:1], pos[:1], slots[:1])
    for n in (2, 3):  # row 0 rewrites its own key 9 with the same bits each call
        assert torch.equal(m.decode(ids[:n], pos[:n], slots[:n])[0], alone[0]), n
