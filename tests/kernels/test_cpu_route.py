"""The CPU route (`cpu_route.RowMM`): a row's bits are the same alone, in a batch of 16,
past the largest call size, and as a token of a prefill chunk; at SmolLM2's shapes too."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.kernels import rms_norm
from graphexec.kernels.cpu_route import RowMM
from graphexec.models import PrefillBatch
from graphexec.models.hf_random import random_state_dict

SMOL = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
            num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
            intermediate_size=1536, vocab_size=512, max_position_embeddings=600,
            initializer_range=0.05, tie_word_embeddings=True)  # fmt: skip
SMALL = dict(SMOL, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=300)  # fmt: skip


@pytest.mark.parametrize("plan", ["measured", "calls"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (97, 48), (4352, 576)])
def test_linear_rows_do_not_depend_on_the_call(shape, threads, plan, restore_threads,
                                               monkeypatch) -> None:  # fmt: skip
    """Rows alone, 16 at shuffled places, and 600 (a full call of 512 and a padded rest),
    with the plan `RowMM` measures (rows alone where they agree) and with call sizes (the
    plan where rows cannot run alone). [4352, 576] is past `CHUNK_BYTES`: column chunks."""
    if plan == "calls":
        monkeypatch.setattr(RowMM, "_alone_ok", staticmethod(lambda b: False))
    torch.set_num_threads(threads)
    N, K = shape
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g).t().contiguous().t()  # K-major, as the route binds it
    x, b = torch.randn(600, K, generator=g), torch.randn(N, generator=g)
    rows = RowMM()
    full = rows.linear(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    pick = torch.randperm(600, generator=g)[:16]
    assert torch.equal(rows.linear(x[pick], w, b), full[pick])
    for i in (0, 5, 599):
        assert torch.equal(rows.linear(x[i : i + 1], w, b), full[i : i + 1]), i


@pytest.mark.parametrize("window", [None, 40])
def test_attention_rows_of_one_slot_equal_each_row_alone(window) -> None:
    """A prefill chunk's rows share their slot's keys in one product; each is its bits
    alone (a decode), beside another slot's rows too."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 3, 700, 2, 64, generator=g)
    q = torch.randn(40, 6, 64, generator=g)
    pos = torch.cat([torch.arange(250, 280), torch.tensor([0, 3, 255, 256, 511, 600, 699])])
    pos = torch.cat([pos, torch.tensor([10, 20, 30])])
    slots = torch.tensor([1] * 37 + [0, 2, 0])
    rows = RowMM()
    full = rows.attend(q, kv, slots, pos, 0.125, window).view(torch.int32)
    for i in range(40):
        alone = rows.attend(q[i : i + 1], kv, slots[i : i + 1], pos[i : i + 1], 0.125, window)
        assert torch.equal(alone.view(torch.int32), full[i : i + 1]), i


@pytest.mark.parametrize("cfg", [SMALL, SMOL], ids=["small", "smollm2-shape"])
def test_logits_alone_in_a_batch_and_in_a_prefill_chunk(cfg) -> None:
    """A prompt's rows as one prefill chunk (all logits) equal the same tokens decoded one
    at a time alone, and a decode row alone equals it in a batch of 16."""
    state = random_state_dict(cfg, seed=0, dtype=torch.float32)
    a, b = (gx.models.HFTransformer(cfg, state, max_seq_len=600) for _ in range(2))
    a.bind(17, "cpu"), b.bind(17, "cpu")
    ids = torch.randint(0, cfg["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    chunk = a.prefill_batch(PrefillBatch.build([(0, 0, ids.tolist())], "cpu", range(40)))
    for t in range(40):
        got = b.decode(ids[t : t + 1], torch.tensor([t]), torch.tensor([0]))
        assert torch.equal(got, chunk[t : t + 1]), t
    for s in range(1, 16):  # 15 more slots with other prompts, then one batch of 16
        a.prefill(s, torch.randint(0, 300, (5 + s,), generator=torch.Generator().manual_seed(s)))
    nxt = torch.tensor([7] + [3] * 15)
    pos = torch.tensor([40] + [5 + s for s in range(1, 16)])
    batch = a.decode(nxt, pos, torch.arange(16))
    assert torch.equal(batch[:1], b.decode(nxt[:1], pos[:1], torch.tensor([0])))


def test_rope_kv_is_the_reference_bit_for_bit() -> None:
    """cpu_route.rope_kv (q and k rotated in one pass) writes and returns the reference's bits."""
    from graphexec.kernels import cpu_route, fused

    g = torch.Generator().manual_seed(3)
    qkv, cos, sin = (torch.randn(*s, generator=g) for s in ((7, (4 + 2 * 2) * 16), (50, 16),
                                                             (50, 16)))  # fmt: skip
    pos, slots = torch.tensor([0, 1, 2, 49, 60, 7, 8]), torch.tensor([0, 0, 0, 1, 1, 2, 2])
    a, b = torch.zeros(2, 3, 50, 2, 16), torch.zeros(2, 3, 50, 2, 16)
    qa = cpu_route.rope_kv(qkv, pos, slots, cos, sin, a, 4)
    qb = fused.rope_kv_write_reference(qkv, pos, slots, cos, sin, b, 4)
    assert torch.equal(qa, qb) and torch.equal(a, b)


def test_prefill_over_key_blocks_in_any_chunking() -> None:
    """A 600-token prompt (3 key blocks) as one chunk, beside another slot's prompt, and in
    chunks of 100 that cut blocks: the same logits for every token."""
    state = random_state_dict(SMALL, seed=0, dtype=torch.float32)
    a, b = (gx.models.HFTransformer(SMALL, state, max_seq_len=600) for _ in range(2))
    a.bind(3, "cpu"), b.bind(3, "cpu")
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(4)).tolist()
    other = [(1, 0, ids[:300][::-1])]
    whole = a.prefill_batch(PrefillBatch.build([(0, 0, ids)] + other, "cpu", range(600)))
    for s in range(0, 600, 100):
        part = b.prefill_batch(PrefillBatch.build([(0, s, ids[s : s + 100])], "cpu", range(100)))
        assert torch.equal(part, whole[s : s + 100]), s


@pytest.mark.parametrize("threads", [1, 2])
def test_norm_rows_do_not_depend_on_the_call(threads, restore_threads) -> None:
    """cpu_route.residual_rms_norm: a row alone has its bits among 1000 rows (the mean is
    one row's reduction); and the padded-call buffer serves calls in and out of
    inference_mode."""
    from graphexec.kernels import cpu_route

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(1000, 576, generator=g), torch.randn(1000, 576, generator=g)
    w = torch.randn(576, generator=g)
    full, new = cpu_route.residual_rms_norm(x, r, w, 1e-5)
    ref, _ = rms_norm.residual_rms_norm_reference(x, r, w, 1e-5)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    for i in (0, 1, 517, 999):
        alone = cpu_route.residual_rms_norm(x[i : i + 1], r[i : i + 1], w, 1e-5)
        assert torch.equal(alone[0], full[i : i + 1]) and torch.equal(alone[1], new[i : i + 1])
    rows, wk = RowMM(), torch.randn(64, 576, generator=g).t().contiguous().t()
    with torch.inference_mode():
        inside = rows.linear(x[:1], wk)
    assert torch.equal(rows.linear(x[:1], wk), inside)


def test_calls_cut_rows_into_sizes_of_one_class() -> None:
    """Whole calls while they fit, one padded call for a rest it holds with <= 1/4 padding."""
    from graphexec.kernels.cpu_route import _calls

    sizes = (2, 4, 8, 16, 256, 512)
    assert _calls(1, sizes) == [2] and _calls(320, sizes) == [256, 16, 16, 16, 16]
    assert _calls(1000, sizes) == [512, 512] and _calls(600, sizes)[0] == 512
    for M in range(1, 1100, 7):
        c = _calls(M, sizes)
        assert set(c) <= set(sizes) and sum(c[:-1]) < M <= sum(c), M


def test_attention_keeps_its_key_storage_and_its_bits() -> None:
    """The live keys go to storage kept between calls (no fresh buffer a layer: page
    faults), viewed contiguous at each call's length: a row's bits do not depend on what
    ran before (a long group first, then a short one, equals a fresh RowMM)."""
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(2, 2, 700, 2, 64, generator=g)
    q = torch.randn(3, 6, 64, generator=g)
    pos, slots = torch.tensor([650, 651, 652]), torch.tensor([1, 1, 1])
    used = RowMM()
    used.attend(q, kv, slots, pos, 0.125)
    storage = used._keys[torch.device("cpu")].data_ptr()
    short = used.attend(q[:1], kv, torch.tensor([0]), torch.tensor([30]), 0.125)
    assert used._keys[torch.device("cpu")].data_ptr() == storage
    fresh = RowMM().attend(q[:1], kv, torch.tensor([0]), torch.tensor([30]), 0.125)
    assert torch.equal(short, fresh)


def test_keys_a_longer_call_left_in_storage_are_never_read() -> None:
    """Rows an earlier call of the same length wrote (NaN keys among them) past a later
    call's live keys are zeroed before it reads them: its bits are a fresh RowMM's,
    after a short call, a long one, and the same again (storage written once a shape)."""
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 2, 300, 2, 16, generator=g)
    kv[:, 1, 100:200] = float("nan")  # slot 1's live keys past row 100
    q = torch.randn(1, 6, 16, generator=g)
    used = RowMM()

    def short():
        return used.attend(q, kv, torch.tensor([0]), torch.tensor([20]), 0.25, block=256)

    fresh = RowMM().attend(q, kv, torch.tensor([0]), torch.tensor([20]), 0.25, block=256)
    assert torch.equal(short(), fresh) and fresh.isfinite().all()
    long = used.attend(q, kv, torch.tensor([1]), torch.tensor([199]), 0.25, block=256)
    assert long.isnan().all()  # the NaN keys are live there
    assert torch.equal(short(), fresh) and torch.equal(short(), fresh)


def test_plan_counts_name_each_operands_plan(monkeypatch) -> None:
    """One entry per plan measured: "alone" where rows alone agree, else the call sizes."""
    w = torch.randn(64, 48).t().contiguous().t()
    x = torch.randn(3, 48)
    rows = RowMM()
    rows.linear(x, w)
    alone = rows.plan_counts()
    monkeypatch.setattr(RowMM, "_alone_ok", staticmethod(lambda b: False))
    calls = RowMM()
    calls.linear(x, w)
    got = calls.plan_counts()
    assert sum(alone.values()) == 1 and sum(got.values()) == 1
    (name,) = got
    assert name.startswith("calls ") and "alone" not in got
    assert list(alone) in (["alone"], [name])  # "alone" unless this CPU's rows disagree
