"""SlotTable: staged writes, complete resets, the padding slot."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.sampling.tensors import SamplingTensors
from graphexec.slot_writes import PackedUpload, layout, pack, unpack
from graphexec.state import SlotTable, min_id_words

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


# --- flush: one packed upload, checked against a plain-indexing reference --------------

STATE = ["positions", "last_token", "prompt_lens", "bitmask", "min_tokens", "min_words",
         "min_bits"]  # fmt: skip
TABLE = COLUMNS + ["log_min_p", "inv_repetition_penalty", "token_counts", "prompt_mask"]


def snapshot(st: SlotTable) -> dict[str, torch.Tensor]:
    out = {n: getattr(st, n).clone() for n in STATE}
    for n in TABLE:
        t = getattr(st.tensors, n)
        if t is not None:
            out[n] = t.clone()
    return out


def reference_flush(st: SlotTable, before: dict[str, torch.Tensor],
                    writes: dict[int, tuple | None]) -> dict[str, torch.Tensor]:  # fmt: skip
    """What a flush must leave: `before`, with each written slot set by plain indexing
    (None = released: plain parameters, empty prompt)."""
    exp = {n: t.clone() for n, t in before.items()}
    nb, m = st.tensors.bias_ids.shape[1], st.min_words.shape[1]
    for s, w in writes.items():
        p, prompt, min_ids = (P(seed=0), (), ()) if w is None else w
        one = SamplingTensors.allocate(1, V, "cpu", max_bias=nb)
        one.write_rows(torch.tensor([0]), [p], V)  # the per-column path, not the packed one
        for n in TABLE[:-2]:
            exp[n][s] = getattr(one, n)[0]
        exp["positions"][s] = 0
        exp["last_token"][s] = prompt[-1] if prompt else 0
        exp["prompt_lens"][s] = len(prompt)
        exp["bitmask"][s] = -1
        exp["min_tokens"][s] = p.min_tokens
        words = min_id_words(min_ids if p.min_tokens else ())
        padded = words + words[:1] * (m - len(words))  # padding repeats the first pair
        exp["min_words"][s] = torch.tensor([w_ for w_, _ in padded] or [0] * m)
        exp["min_bits"][s] = torch.tensor([b_ for _, b_ in padded] or [0] * m)
        if "token_counts" in exp:
            exp["token_counts"][s] = 0
            exp["prompt_mask"][s] = False
            exp["prompt_mask"][s, list(prompt)] = True
    return exp


def scribble(st: SlotTable) -> None:
    """What steps would have written into every slot since the last flush."""
    st.positions.add_(5)
    st.last_token.fill_(7)
    st.bitmask.fill_(3)
    if st.tensors.token_counts is not None:
        st.tensors.token_counts.add_(2)
        st.tensors.prompt_mask[:, 1] = True


def assert_state(st: SlotTable, exp: dict[str, torch.Tensor]) -> None:
    got = snapshot(st)
    assert got.keys() == exp.keys()
    for n, t in exp.items():
        assert torch.equal(got[n], t), n


MIX = [
    (P(temperature=0.0, seed=1), [3, 4, 5], ()),
    (P(temperature=0.7, top_k=5, top_p=0.9, seed=2**40, logprobs=3), [9], ()),
    (P(min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25,
       seed=3, logprobs=0, logprobs_mode="processed"), [], ()),
    (P(logit_bias={2: -100.0, 40: 3.5, 7: 0.25}, seed=4, min_tokens=3), [1, 1, 2],
     [0, 33, 35, 49]),
    (P(temperature=1e-30, top_k=V, seed=5, min_tokens=2), [49, 0], [48]),
]  # fmt: skip


@pytest.mark.parametrize("penalties, offsets", [(True, 1), (False, 3)])
def test_flush_matches_the_reference_through_releases_and_reassignments(
    penalties: bool, offsets: int
) -> None:
    st = SlotTable(6, V, "cpu", penalties=penalties, offsets=offsets, max_min_ids=3)
    writes: dict[int, tuple | None] = {}
    for p, prompt, min_ids in MIX:
        writes[st.assign(p, prompt, min_ids)] = (p, tuple(prompt), tuple(min_ids))
    before = snapshot(st)
    st.flush()
    assert_state(st, reference_flush(st, before, writes))
    assert st.last_token[:5].tolist() == [5, 9, 0, 2, 0]

    scribble(st)
    before = snapshot(st)
    for s in (1, 3, 4):
        st.release(s)
    late = st.assign(P(seed=6), [8, 8])  # staged, then released before any flush
    assert late == 1
    st.release(late)
    q = (P(top_p=0.5, seed=7, logprobs=1, logprobs_mode="processed"), (11, 12, 13), ())
    r = (P(temperature=0.0, seed=8, min_tokens=1, logit_bias={5: 1.0}), (20,), (40, 41))
    writes = {4: None}  # released for good
    writes[st.assign(*q)] = q  # slots 1 and 3: released and reassigned within the flush
    writes[st.assign(*r)] = r
    assert sorted(writes) == [1, 3, 4]
    st.flush()
    assert_state(st, reference_flush(st, before, writes))  # slots 0, 2, 5 untouched
    assert st.last_token.tolist() == [7, 13, 7, 20, 0, 7, 7]


def test_flush_without_changes_writes_nothing() -> None:
    st = SlotTable(2, V, "cpu")
    st.assign(P(seed=1), [4])
    st.flush()
    scribble(st)
    before = snapshot(st)
    st.flush()
    assert_state(st, before)


def test_scalar_columns_share_one_block_per_dtype() -> None:
    st = SlotTable(5, V, "cpu")
    f32 = st.tensors.temperature
    for col in (st.tensors.top_p, st.tensors.log_min_p, st.tensors.frequency_penalty):
        assert col.untyped_storage().data_ptr() == f32.untyped_storage().data_ptr()
    for col in (st.positions, st.last_token, st.prompt_lens, st.min_tokens, st.tensors.seed):
        assert col.is_contiguous() and col.shape == (6,)
        assert col.untyped_storage().data_ptr() == st.positions.untyped_storage().data_ptr()
        assert col.storage_offset() % 16 == 0
    # initial values are allocate's: plain sampling
    assert st.tensors.log_min_p.eq(-torch.inf).all() and st.tensors.logprobs.eq(-1).all()
    assert st.tensors.temperature.eq(1).all() and not st.tensors.logprobs_processed.any()


# --- the packing itself ----------------------------------------------------------------


def test_pack_round_trips_every_dtype_bit_exactly() -> None:
    f = torch.tensor([0.0, -0.0, 1.5, -torch.inf, torch.inf, torch.nan, 1e-45, 3.4e38])
    pieces = {
        "idx": torch.tensor([4, 0, 2]),
        "flags": torch.tensor([True, False, True]),
        "f": f,
        "f2": torch.tensor([[1.0, -2.0], [0.5, torch.nan]]),
        "i32": torch.tensor([[-(2**31), 2**31 - 1, -1]], dtype=torch.int32),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "empty": torch.zeros(0, dtype=torch.int64),
    }
    lay = layout(pieces)
    assert lay.size == sum(t.numel() for t in pieces.values())
    # grouped: int64 first, then the int32-range ones, then bool (one conversion each)
    assert [e[0] for e in lay.entries] == ["idx", "i64", "empty", "f", "f2", "i32", "flags"]
    buf = torch.full((lay.size + 5,), 123, dtype=torch.int64)
    packed = pack(pieces, lay, buf)
    assert packed.data_ptr() == buf.data_ptr() and buf[lay.size :].eq(123).all()
    back = unpack(packed.clone(), lay)
    for name, t in pieces.items():
        got = back[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        if t.is_floating_point():
            assert torch.equal(got.view(torch.int32), t.view(torch.int32)), name
        else:
            assert torch.equal(got, t), name
    with pytest.raises(TypeError, match="float64"):
        layout({"x": torch.zeros(2, dtype=torch.float64)})


def test_packed_upload_reuses_its_buffer_and_grows_when_needed() -> None:
    up = PackedUpload("cpu")
    a = up.upload({"x": torch.arange(10), "y": torch.ones(3)})
    assert torch.equal(a["x"], torch.arange(10)) and torch.equal(a["y"], torch.ones(3))
    ptr, cap = up._buf.data_ptr(), up._buf.numel()
    up.upload({"x": torch.arange(4)})
    assert up._buf.data_ptr() == ptr  # reused
    b = up.upload({"x": torch.arange(cap + 1)})
    assert up._buf.numel() >= cap + 1 and torch.equal(b["x"], torch.arange(cap + 1))
    assert not up._buf.is_pinned()  # pinned only for CUDA


@pytest.mark.gpu
def test_cuda_flush_is_one_pinned_copy_without_sync_and_matches_the_cpu() -> None:
    from torch.profiler import ProfilerActivity, profile

    tables = [SlotTable(6, V, d, max_min_ids=3) for d in ("cpu", "cuda")]
    for st in tables:
        for p, prompt, min_ids in MIX:
            st.assign(p, prompt, min_ids)
        st.flush()
        st.release(1)
        st.assign(MIX[0][0], [30, 31])
    torch.cuda.set_sync_debug_mode("error")  # .item(), pageable copies, ... would raise
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tables[1].flush()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tables[0].flush()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    h2d = [n for n in names if "HtoD" in n]
    print(f"\nflush on CUDA: {len(names)} device ops: {sorted(set(names))}")
    assert len(h2d) == 1 and "Pinned" in h2d[0], h2d
    cpu, gpu = snapshot(tables[0]), snapshot(tables[1])
    for n, t in cpu.items():
        assert torch.equal(gpu[n].cpu(), t), n
