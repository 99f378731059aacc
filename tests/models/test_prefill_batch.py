"""prefill_batch: a ragged batch of prompt segments (and chunks of one) into their slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphexec.models import PrefillBatch, TableModel, TinyLM

V, SLOTS, T = 500, 6, 32
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(dtype: torch.dtype = torch.float32) -> TinyLM:
    m = TinyLM(V, seed=7, dim=64, layers=2, heads=4, max_seq_len=T, dtype=dtype)
    m.bind(SLOTS, "cpu")
    return m


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def batch(segments, rows="all") -> PrefillBatch:
    n = sum(len(ids) for _, _, ids in segments)
    return PrefillBatch.build(segments, "cpu", range(n) if rows == "all" else rows)


def reference_prefill(m: TinyLM, slot: int, ids: list[int]) -> torch.Tensor:
    """TinyLM's forward written plainly: one prompt, causal attention over itself."""
    ids_t = torch.tensor(ids)
    n, D = len(ids), m.dim
    x = m.embed[ids_t] + m.pos_embed[:n]

    def norm(t):
        return F.rms_norm(t, (D,))

    for i, layer in enumerate(m.layers):
        q, k, v = (norm(x) @ layer.qkv.T).view(n, 3, m.heads, D // m.heads).unbind(1)
        m.k_cache[i, slot, :n] = k
        m.v_cache[i, slot, :n] = v
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        x = x + a.transpose(0, 1).reshape(n, D) @ layer.out.T
        x = x + F.gelu(norm(x) @ layer.up.T) @ layer.down.T
    return (norm(x) @ m.lm_head.T).float() * (m.logit_scale / D**0.5)


def assert_same_cache(a: TinyLM, b: TinyLM, slots) -> None:
    for s in slots:
        torch.testing.assert_close(a.k_cache[:, s], b.k_cache[:, s], **TOL)
        torch.testing.assert_close(a.v_cache[:, s], b.v_cache[:, s], **TOL)


def test_tiny_lm_ragged_batch_equals_one_prompt_at_a_time() -> None:
    prompts = {3: prompt(5, 0), 0: prompt(1, 1), 4: prompt(11, 2), 1: prompt(3, 3)}
    m, one, ref = tiny(), tiny(), tiny()
    logits = m.prefill_batch(batch([(s, 0, ids) for s, ids in prompts.items()]))
    assert logits.shape == (20, V) and logits.dtype == torch.float32
    at = 0
    for s, ids in prompts.items():
        alone = one.prefill(s, torch.tensor(ids), all_logits=True)
        torch.testing.assert_close(logits[at : at + len(ids)], alone, **TOL)
        torch.testing.assert_close(alone, reference_prefill(ref, s, ids), **TOL)
        torch.testing.assert_close(one.prefill(s, torch.tensor(ids)), alone[-1], **TOL)
        at += len(ids)
    assert_same_cache(m, one, range(SLOTS))  # slots 2 and 5 untouched (zero) in both
    assert_same_cache(m, ref, prompts)
    assert not m.k_cache[:, 2].any() and not m.k_cache[:, 5].any()


def test_tiny_lm_chunked_prefill_equals_unchunked_and_decode_continues_it() -> None:
    p, q, r = prompt(13, 4), prompt(9, 5), prompt(4, 6)  # p in slots 2, q in 0, r in 5
    whole = tiny()
    want = whole.prefill_batch(batch([(2, 0, p), (0, 0, q), (5, 0, r)]))
    want_p, want_q = want[:13], want[13:22]
    m = tiny()
    got1 = m.prefill_batch(batch([(5, 0, r), (2, 0, p[:5])]))  # r whole, p chunk 1
    got2 = m.prefill_batch(batch([(2, 5, p[5:9]), (0, 0, q[:6])]))  # p chunk 2, q chunk 1
    got3 = m.prefill_batch(batch([(0, 6, q[6:]), (2, 9, p[9:])]))  # q chunk 2, p chunk 3
    torch.testing.assert_close(torch.cat([got1[4:], got2[:4], got3[3:]]), want_p, **TOL)
    torch.testing.assert_close(torch.cat([got2[4:], got3[:3]]), want_q, **TOL)
    torch.testing.assert_close(got1[:4], want[22:], **TOL)
    assert_same_cache(m, whole, range(SLOTS))
    both = tiny()  # two chunks of one slot in one batch: every K/V is written before use
    torch.testing.assert_close(both.prefill_batch(batch([(2, 0, p[:6]), (2, 6, p[6:])])), want_p)
    assert_same_cache(both, whole, [2])
    ids, pos, slots = torch.tensor([17, 23]), torch.tensor([13, 9]), torch.tensor([2, 0])
    torch.testing.assert_close(m.decode(ids, pos, slots), whole.decode(ids, pos, slots), **TOL)


def test_tiny_lm_logit_rows_none_fills_the_cache_and_returns_none() -> None:
    segments = [(1, 0, prompt(6, 7)), (3, 0, prompt(2, 8))]
    m, full = tiny(), tiny()
    assert m.prefill_batch(batch(segments, rows=None)) is None
    every = full.prefill_batch(batch(segments))
    assert_same_cache(m, full, range(SLOTS))
    some = m.prefill_batch(batch(segments, rows=[7, 0, 5]))  # any tokens, any order
    torch.testing.assert_close(some, every[[7, 0, 5]], **TOL)


def test_tiny_lm_prefill_batch_checks_and_bf16() -> None:
    m = tiny()
    with pytest.raises(ValueError, match="positions"):
        m.prefill_batch(batch([(0, T - 2, prompt(3, 9))]))
    with pytest.raises(ValueError, match="slots"):
        m.prefill_batch(batch([(SLOTS, 0, prompt(3, 9))]))
    with pytest.raises(RuntimeError, match="bind"):
        TinyLM(V, dim=32, heads=2).prefill_batch(batch([(0, 0, [1])]))
    out = tiny(torch.bfloat16).prefill_batch(batch([(0, 0, prompt(5, 10)), (1, 0, [3])], [5]))
    assert out.shape == (1, V) and out.dtype == torch.float32 and out.isfinite().all()


def test_table_model_prefill_batch_is_logits_of_each_token() -> None:
    m = TableModel(V, seed=5, max_seq_len=T)
    a, b = prompt(7, 11), prompt(3, 12)
    segs = [(4, 0, a[:4]), (1, 0, b), (4, 4, a[4:])]
    b_all = batch(segs)
    got = m.prefill_batch(b_all)
    assert got.shape == (10, V) and got.dtype == torch.float32
    assert torch.equal(got, m.logits(b_all.positions, b_all.token_ids))
    full_a = m.prefill(4, torch.tensor(a), all_logits=True)
    assert torch.equal(torch.cat([got[:4], got[7:]]), full_a)
    assert torch.equal(got[4:7], m.prefill(1, torch.tensor(b), all_logits=True))
    assert torch.equal(m.prefill_batch(batch(segs, rows=[9, 6])), got[[9, 6]])
    assert m.prefill_batch(batch(segs, rows=None)) is None
    with pytest.raises(ValueError, match="positions"):
        m.prefill_batch(batch([(0, T - 1, [1, 2])]))


def test_build_ships_the_padded_layout_in_one_buffer() -> None:
    segs = [(4, 0, [5, 6, 7]), (1, 9, [8]), (4, 3, [9, 10, 11, 12, 13]), (0, 2, [14, 15])]
    b = PrefillBatch.build(segs, "cpu", [7, 0, 3])
    Lmax = 5
    want_tok, want_pos, want_seg, want_pidx = [], [], [], []
    want_ptok, want_ppos = [[0] * Lmax for _ in segs], [[0] * Lmax for _ in segs]
    at = 0
    for r, (_, a, ids) in enumerate(segs):
        for j in range(Lmax):
            want_ptok[r][j] = at + min(j, len(ids) - 1)  # padding repeats the last token
            want_ppos[r][j] = a + j
        for j, t in enumerate(ids):
            want_tok.append(t)
            want_pos.append(a + j)
            want_seg.append(r)
            want_pidx.append(r * Lmax + j)
        at += len(ids)
    assert b.token_ids.tolist() == want_tok and b.positions.tolist() == want_pos
    assert b.segment_ids.tolist() == want_seg and b.padded_index.tolist() == want_pidx
    assert b.token_slots.tolist() == [segs[r][0] for r in want_seg]
    assert b.slot_ids.tolist() == [4, 1, 4, 0]
    assert b.padded_tokens.tolist() == want_ptok and b.padded_positions.tolist() == want_ppos
    assert b.logit_rows.tolist() == [7, 0, 3] and b.logit_padded.tolist() == [13, 0, 5]
    assert (b.slots, b.starts, b.lengths, b.offsets) == ((4, 1, 4, 0), (0, 9, 3, 2),
                                                          (3, 1, 5, 2), (0, 3, 4, 9))  # fmt: skip
    # every tensor is a view of one buffer (one host-to-device copy on CUDA)
    base = b.token_ids.untyped_storage().data_ptr()
    for name in ("positions", "segment_ids", "slot_ids", "logit_rows",
                 "token_slots", "padded_index", "padded_tokens", "padded_positions",
                 "logit_padded"):  # fmt: skip
        assert getattr(b, name).untyped_storage().data_ptr() == base, name
    assert PrefillBatch.build(segs, "cpu").logit_rows is None
    assert PrefillBatch.build(segs, "cpu").logit_padded is None
    # a batch made by hand gets the same layout from its host tuples
    bare = PrefillBatch(token_ids=b.token_ids, positions=b.positions, segment_ids=b.segment_ids,
                        slot_ids=b.slot_ids, slots=b.slots, starts=b.starts, lengths=b.lengths,
                        logit_rows=b.logit_rows)  # fmt: skip
    assert bare.padded_tokens is None
    full = bare.with_layout()
    for name in ("token_slots", "padded_index", "padded_tokens",
                 "padded_positions", "logit_padded"):  # fmt: skip
        assert torch.equal(getattr(full, name), getattr(b, name)), name
    assert full.with_layout() is full


def test_tiny_lm_hand_made_batch_equals_built_batch() -> None:
    segs = [(3, 0, prompt(7, 13)), (1, 0, prompt(4, 14))]
    b = batch(segs)
    bare = PrefillBatch(token_ids=b.token_ids, positions=b.positions, segment_ids=b.segment_ids,
                        slot_ids=b.slot_ids, slots=b.slots, starts=b.starts, lengths=b.lengths,
                        logit_rows=b.logit_rows)  # fmt: skip
    m, hand = tiny(), tiny()
    assert torch.equal(m.prefill_batch(b), hand.prefill_batch(bare))
    assert torch.equal(m.kv_cache, hand.kv_cache)
