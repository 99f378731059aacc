"""SlotTable: staged writes, complete resets, the padding slot."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import graphexec as gx
from graphexec.engine import slots as state
from graphexec.engine.slot_writes import PackedUpload, RowFormat
from graphexec.engine.slots import SlotTable, min_id_words
from graphexec.sampling.tensors import HOST_FIELDS, SamplingTensors

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
    # host-owned: one buffer (the flush copies its mirror whole); float32 columns are
    # rows of the int32 block
    t = st.tensors
    owned = [t.top_p, t.log_min_p, t.top_k, t.seed, t.logprobs_processed, t.bias_ids]
    owned += [t.bias_values, st.prompt_lens, st.min_tokens, st.min_words, st.min_bits]
    for col in owned:
        assert col.untyped_storage().data_ptr() == f32.untyped_storage().data_ptr()
        assert col.is_contiguous() and col.shape[0] == 6
    for col in (st.tensors.seed, st.prompt_lens, st.min_tokens, st.positions, st.last_token):
        assert col.dtype == torch.int64 and col.storage_offset() % 16 == 0
    # device-written decode state: its own [2, S'] block
    assert st.last_token.data_ptr() - st.positions.data_ptr() == 16 * 8
    # initial values are allocate's: plain sampling
    assert st.tensors.log_min_p.eq(-torch.inf).all() and st.tensors.logprobs.eq(-1).all()
    assert st.tensors.temperature.eq(1).all() and not st.tensors.logprobs_processed.any()
    assert st.tensors.bias_ids.eq(-1).all() and st.tensors.top_p.eq(1).all()


def test_prompts_past_the_buffer_take_a_second_copy(monkeypatch) -> None:
    monkeypatch.setattr(state, "_FLAT", 3)  # room for 3 prompt tokens past ids and decode
    st = SlotTable(4, V, "cpu", max_min_ids=3)
    writes = {}
    for p, prompt, min_ids in MIX[:4]:
        writes[st.assign(p, prompt, min_ids)] = (p, tuple(prompt), tuple(min_ids))
    before = snapshot(st)
    st.flush()  # 7 prompt tokens: more than fits
    assert_state(st, reference_flush(st, before, writes))
    st.release(0)
    before = snapshot(st)
    st.flush()  # and the buffer serves the next flush as before
    assert_state(st, reference_flush(st, before, {0: None}))


# --- the packing itself ----------------------------------------------------------------


def test_row_format_round_trips_every_dtype_bit_exactly() -> None:
    f = [0.0, -0.0, 1.5, -math.inf, math.inf, math.nan, 1e-45, 3.4e38]
    fmt = RowFormat([("i64", torch.int64, "3q"), ("f", torch.float32, "8f"),
                     ("mixed", torch.int32, "fi"), ("flags", torch.bool, "2?")])  # fmt: skip
    assert fmt.size == 24 + 32 + 8 + 8  # 2 bools padded to 8 bytes
    rows = [(-(2**63), 2**63 - 1, 0, *f, -2.5, -(2**31), True, False),
            (1, 2, 3, *f[::-1], 1.0, 2**31 - 1, False, True)]  # fmt: skip
    buf = np.zeros(8 + 2 * fmt.size, dtype=np.uint8)
    for i, r in enumerate(rows):
        fmt.struct.pack_into(buf, 8 + i * fmt.size, *r)
    got = fmt.views(buf[8:].reshape(2, fmt.size))  # offset rows, as in a flush's scratch
    assert got["i64"].tolist() == [list(r[:3]) for r in rows]
    want = torch.tensor([r[3:11] for r in rows], dtype=torch.float32)
    assert got["f"].dtype == np.float32
    assert np.array_equal(got["f"].view(np.int32), want.view(torch.int32).numpy())
    mixed = got["mixed"]  # one int32 view: the float as its bits
    assert mixed.dtype == np.int32 and mixed[:, 1].tolist() == [-(2**31), 2**31 - 1]
    assert mixed[:, :1].view(np.float32).ravel().tolist() == [-2.5, 1.0]
    assert got["flags"].tolist() == [[True, False], [False, True]]
    with pytest.raises(ValueError, match="element size"):
        RowFormat([("a", torch.int32, "i"), ("b", torch.int64, "q")])
    with pytest.raises(TypeError, match="cannot be read"):
        RowFormat([("a", torch.float32, "i")])


def test_packed_upload_copies_a_prefix_of_its_fixed_buffer() -> None:
    up = PackedUpload("cpu", 64)
    assert up.dev_buf is up.host_buf and not up.host_buf.is_pinned()  # on the CPU: one buffer
    up.host()[:16] = range(16)
    up.send(16)
    assert up.dev_buf[:16].tolist() == list(range(16))
    extra = up.extra(np.arange(5))
    assert extra.dtype == torch.int64 and extra.tolist() == list(range(5))


F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).smallest_normal


def test_host_row_is_host_columns_bit_for_bit() -> None:
    """SlotTable.flush packs host_row's values; they must give host_columns' bits."""
    rng = random.Random(0)
    edge = [0.0, 5e-324, 1e-300, 1e-50, 1e-46, 7e-46, 1.4e-45, 1e-40, F32_TINY, 3e-39,
            1e-30, 0.1, 1 / 3, 1.0, 2.0, 1e30, 1e38, F32_MAX, F32_MAX * (1 + 2**-25),
            F32_MAX * (1 + 2**-23), 1e39, 1e300]  # fmt: skip
    unit = [x for x in edge if x <= 1.0] + [1.0 - 2**-30, 1.0 - 2**-53]
    n = 1000
    temps = edge + [rng.uniform(0, 2) for _ in range(n)] + [10 ** rng.uniform(-50, 50)
                                                           for _ in range(n)]  # fmt: skip
    min_ps = unit + [rng.random() for _ in range(n)] + [10 ** -rng.uniform(0, 330)
                                                       for _ in range(n)]  # fmt: skip
    reps = [1e-30, 1e30, 1.0] + [10 ** rng.uniform(-30, 30) for _ in range(n)]
    params = [
        P(temperature=t, min_p=min_ps[i % len(min_ps)], top_p=max(unit[i % len(unit)], 1e-9),
          repetition_penalty=reps[i % len(reps)], presence_penalty=rng.uniform(-2, 2),
          frequency_penalty=rng.uniform(-2, 2), top_k=rng.choice([-1, 0, 5, V, V + 9]),
          seed=rng.randrange(2**63), logprobs=rng.choice([None, 0, 20]),
          logprobs_mode=rng.choice(["raw", "processed"]))
        for i, t in enumerate(temps)
    ]  # fmt: skip
    cols = SamplingTensors.host_columns(params, V + 10)
    assert tuple(cols) == HOST_FIELDS
    rows = [SamplingTensors.host_row(p, V + 10) for p in params]
    for j, (name, col) in enumerate(cols.items()):
        got = torch.tensor([r[j] for r in rows], dtype=col.dtype)
        if col.is_floating_point():
            col, got = col.view(torch.int32), got.view(torch.int32)
        bad = (got != col).nonzero().flatten().tolist()
        assert not bad, (name, [(params[i], got[i], col[i]) for i in bad[:3]])
    # the clamps were hit: 1/T of a tiny temperature, T rounding to 0 and to inf
    assert cols["inv_temperature"].eq(F32_MAX).any() and cols["temperature"].eq(0).sum() > 1
    assert cols["temperature"].isinf().any() and cols["log_min_p"].isinf().any()


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
