"""The decode step's bookkeeping kernels against their torch references, value for value."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

import graphexec as gx  # noqa: E402
from graphexec.engine import step_kernels as sk  # noqa: E402
from graphexec.engine import step_state as ss  # noqa: E402
from graphexec.engine.slots import SlotTable  # noqa: E402
from graphexec.sampling.flags import INF_TOKEN  # noqa: E402

V = 200
# the CPU under the interpreter in CI; CUDA with `pytest -m gpu`
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                        reason="kernels compile for CUDA")),
           pytest.param("cuda", marks=pytest.mark.gpu)]  # fmt: skip


def table(penalties: bool, offsets: int, seed: int, device: str) -> SlotTable:
    """6 slots with prompts, min_tokens holding back ids in several words (and in one
    word twice over), random positions, last tokens, masks and counts."""
    g = torch.Generator().manual_seed(seed)
    st = SlotTable(6, V, device, penalties=penalties, offsets=offsets, max_min_ids=4)
    min_ids = [(0, 1, 199), (37, 38, 70), (), (5,), (150, 151, 152, 190), (64,)]
    for i, ids in enumerate(min_ids):
        p = gx.SamplingParams(seed=i, min_tokens=3 if ids else 0)
        st.assign(p, prompt_token_ids=list(range(i + 1)), min_ids=ids)
    st.flush()
    st.positions[:6] = torch.randint(0, 6, (6,), generator=g).to(device)
    st.last_token[:6] = torch.randint(0, V, (6,), generator=g).to(device)
    st.bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, st.bitmask.shape, generator=g,
                                   dtype=torch.int32))  # fmt: skip
    if penalties:
        st.tensors.token_counts.copy_(torch.randint(0, 4, (7, V), generator=g, dtype=torch.int32))
    return st


def state(st: SlotTable) -> list[torch.Tensor]:
    out = [st.positions.clone(), st.last_token.clone(), st.bitmask.clone()]
    if st.tensors.token_counts is not None:
        out.append(st.tensors.token_counts.clone())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offsets, t", [(1, None), (3, None), (3, 1), (3, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gather_inputs_is_the_reference(offsets, t, seed, device) -> None:
    """Positions before, at and past min_tokens (3); every slot, the padding slot, and a
    slot twice: the same positions, model positions, inputs and masks (and the table
    untouched); a decode's masks (t None) and a speculative step's per offset, whose
    min_tokens counts the offset (pos + j)."""
    st = table(True, offsets, seed, device)
    slot_ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 2], device=device)
    before = state(st)
    got = sk.gather_inputs(st, slot_ids, t)
    want = ss.gather_inputs_reference(st, slot_ids, t)
    for name in ("pos", "model_pos", "last", "masks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert all(torch.equal(a, b) for a, b in zip(state(st), before, strict=True))
    masks = want.masks if t is None else want.masks[:, 0]
    assert masks.shape == (9, st.bitmask.shape[-1]) and want.masks.dim() == (2 if t is None else 3)
    active = want.pos < st.min_tokens[slot_ids]
    raw = st.bitmask[slot_ids, 0] if offsets > 1 else st.bitmask[slot_ids]
    assert active.any() and not torch.equal(masks[active], raw[active])
    if t == 3:  # the last offset holds back fewer rows (pos + 2 reaches min_tokens sooner)
        late = want.pos + 2 < st.min_tokens[slot_ids]
        assert torch.equal(want.masks[~late, 2], st.bitmask[slot_ids, 2][~late])
        assert (active & ~late).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("penalties", [True, False])
@pytest.mark.parametrize("flag", [True, False])
def test_advance_decode_is_the_reference(penalties, flag, device) -> None:
    """Real rows, padding rows, an invalid row (-1), a row that drew a +inf token and a
    +inf logit at column 0 of an invalid row: the same tokens, validity, positions,
    last tokens and counts as the torch reference."""
    st = table(penalties, 1, 3, device)
    slot_ids = torch.tensor([0, 1, 2, 3, 6, 6, 4], device=device)
    logits = torch.randn(7, V + 8, device=device)  # wider than V, as a padded model's
    tokens = torch.tensor([5, 17, -1, 199, 3, 0, 42], device=device)
    valid = torch.tensor([True, True, False, True, True, False, True], device=device)
    logits[1, 17] = float("inf")  # drew a +inf token: flagged
    logits[2, 0] = float("inf")  # invalid row reading column 0: flagged too
    results = []
    for fn in (sk.advance_decode, ss.advance_decode_reference):
        s2 = table(penalties, 1, 3, device)
        t, v = tokens.clone(), valid.clone()
        fn(s2, slot_ids, logits, t, v, flag)
        results.append((t, v, state(s2)))
    (t1, v1, s1), (t2, v2, s2) = results
    assert torch.equal(t1, t2) and torch.equal(v1, v2)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
    assert (t1[1] == INF_TOKEN) == flag and (st.positions[1] != s1[0][1]) != flag
    assert torch.equal(s1[0][6], st.positions[6])  # the padding slot never moves


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("penalties", [True, False])
@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("t", [1, 4])
def test_advance_runs_is_the_reference(penalties, history, t, device) -> None:
    """A speculative step's runs: full, short and empty runs, a run repeating a token
    (its count + 2), padding rows, an invalid row, and a run with a +inf token inside it
    (flagged) beside one whose +inf lies past its end (not flagged): the same runs,
    counts, validity, positions, last tokens, token counts and n-gram histories as the
    torch reference."""
    from graphexec.speculative.ngram_device import NgramHistory
    from graphexec.speculative.verify import VerifyOutput

    g = torch.Generator().manual_seed(t)
    slot_ids = torch.tensor([0, 1, 2, 3, 6, 6, 4, 5], device=device)
    b = slot_ids.shape[0]
    toks = torch.randint(0, V, (b, t), generator=g).to(device)
    n = torch.tensor([t, 1, 0, t, t, 1, max(t - 1, 1), t], device=device)
    toks[torch.arange(t, device=device).unsqueeze(0) >= n.unsqueeze(1)] = -1
    if t > 1:
        toks[0, 1] = toks[0, 0]  # a repeated token
    valid = n > 0
    values = torch.randn(b, t, generator=g).to(device)
    values[3, t - 1] = float("inf")  # inside row 3's run: flagged
    values[6, t - 1] = float("inf")  # past row 6's run (t > 1): not flagged
    # the last row's run passes the history's end (30): those writes go to its dump column
    model_pos = torch.tensor([3, 0, 5, 9, -1, -1, 20, 28], device=device)
    stale = torch.randint(0, V, (7, 31), generator=g, dtype=torch.int32)
    results = []
    for fn in (sk.advance_runs, ss.advance_runs_reference):
        st = table(penalties, 1, 5, device)
        out = VerifyOutput.allocate(b, t - 1, torch.device(device), None)
        out.token_ids.copy_(toks)
        out.num_tokens.copy_(n)
        out.num_accepted.copy_((n - 1).clamp(min=0))
        out.valid.copy_(valid)
        hist = None
        if history:
            hist = NgramHistory(7, 30, torch.device(device), 3, 1, 16)
            hist.tokens.copy_(stale)
        fn(st, slot_ids, values, out, hist, model_pos)
        results.append((out, state(st), hist))
    (o1, s1, h1), (o2, s2, h2) = results
    for f in ("token_ids", "num_tokens", "num_accepted", "valid"):
        assert torch.equal(getattr(o1, f), getattr(o2, f)), f
    assert all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
    if history:  # (the reference also writes the tokens past a run to the dump column)
        assert torch.equal(h1.tokens[:, :-1], h2.tokens[:, :-1])
    assert o1.token_ids[3, 0] == INF_TOKEN and not o1.valid[3]
    assert o1.valid[6] == (t > 1)
