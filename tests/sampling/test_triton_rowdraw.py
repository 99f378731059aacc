"""The Triton row draw (`graphexec.sampling.triton.rowdraw`, CPU interpreter) against the
torch reference, token for token, on rows built to take each of its routes: the top-k
bound from the block maxes, k above the live blocks, top-p guesses checked in one round or
several, min-p's bound, a biased token inside a gathered block, the three sort widths,
top-p / min-p over more candidates than the small sort (`band`), and the exact path
(too many candidates, +inf, flat top-p).

Blocks are 16 tokens (V = 320: 20 blocks), so a handful of tokens already spans blocks;
every row is drawn at several positions so the draw itself is compared, not one token.
"""

from __future__ import annotations

from tests.triton_env import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

import graphexec as gx  # noqa: E402
from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import reference  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402

P = gx.SamplingParams
V = 320
DB = 16
NPOS = 6  # positions per row
KW = dict(tile_v=16, rows=2, cap=32, small=8, mid=16, draw_block=DB)


def row(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


def allowed_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V/32)] int32 xgrammar bitmask."""
    bits = torch.zeros(((V + 31) // 32) * 32, dtype=torch.int64)
    bits[:V] = allowed.long()
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def case_rows():
    """(name, logits row, params, allowed or None)."""
    few = torch.zeros(V, dtype=torch.bool)
    few[[3, 7, 100, 101, 250, 251]] = True  # 6 tokens in 3 blocks
    peaked = row(3, 4.0)
    low = torch.argsort(peaked)[:3].tolist()  # the three lowest tokens, in other blocks
    inf_row = row(8, 2.0)
    inf_row[[17, 200]] = float("inf")
    ties = torch.full((V,), -40.0)
    ties[torch.arange(20) * 15] = 0.0  # 20 equal tokens: no value band splits them
    return [
        ("top_k_block_bound", row(1, 3.0), P(top_k=5, temperature=0.9), None),
        ("top_k_above_live_blocks", row(2, 3.0), P(top_k=10), few),
        ("top_p_one_round", row(4, 4.0), P(top_p=0.5, temperature=0.8), None),
        ("top_p_rounds", row(5, 1.5), P(top_p=0.9), None),
        ("top_p_flat_exact", row(6, 0.2), P(top_p=0.95), None),
        ("min_p_bound", row(7, 3.0), P(min_p=0.1, temperature=1.2), None),
        ("bias_in_gathered_block", peaked, P(top_k=3, logit_bias=dict.fromkeys(low, 30.0)), None),
        ("top_p_band", row(14, 2.0), P(top_p=0.7), None),
        ("min_p_band", row(15, 2.5), P(min_p=0.05, temperature=0.9), None),
        ("top_p_min_p_band", row(16, 2.0), P(top_p=0.7, min_p=0.05), None),
        ("top_p_ties_band_too_wide", ties, P(top_p=0.5), None),
        ("mid_width_sort", row(9, 0.7), P(top_k=12), None),
        ("cap_width_sort", row(10, 0.7), P(top_k=24), None),
        ("over_cap_exact", row(11, 0.7), P(top_k=60), None),
        ("top_k_top_p_min_p", row(12, 3.0), P(top_k=30, top_p=0.8, min_p=0.01), None),
        ("plus_inf_exact", inf_row, P(top_k=4), None),
        ("greedy_bias", peaked, P(temperature=0.0, logit_bias={low[0]: 50.0}), None),
        (
            "penalties_top_k",
            row(13, 3.0),
            P(top_k=7, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
            None,
        ),  # fmt: skip
    ]


CASES = case_rows()


def draw_case(case) -> None:
    name, logits_row, base, allowed = case
    params = [base.__class__(**{**base.__dict__, "seed": 50 + i}) for i in range(NPOS)]
    logits = logits_row.expand(NPOS, -1).contiguous()
    g = torch.Generator().manual_seed(len(name))
    counts = torch.randint(0, 3, (NPOS, V), generator=g, dtype=torch.int32)
    prompt = torch.rand(NPOS, V, generator=g) < 0.1
    bitmask = None if allowed is None else allowed_bits(allowed).expand(NPOS, -1).contiguous()
    table = SamplingTensors.from_params(params, V, "cpu", counts, prompt)
    slots = torch.arange(NPOS)
    pos = torch.arange(NPOS) * 3 + 1
    ref = SamplerOutput.allocate(NPOS, "cpu", None)
    tri = SamplerOutput.allocate(NPOS, "cpu", None)
    reference.sample(logits, slots, pos, table, ref, bitmask, SamplerVariant.DEFAULT,
                     draw_block=DB)  # fmt: skip
    launch.sample(logits, slots, pos, table, tri, bitmask, SamplerVariant.DEFAULT, **KW)
    assert torch.equal(tri.token_ids, ref.token_ids), name
    assert torch.equal(tri.valid, ref.valid)
    if allowed is not None:
        assert bool(allowed[ref.token_ids].all())
    if name == "bias_in_gathered_block":  # the biased tokens are the only ones kept
        assert set(ref.token_ids.tolist()) <= set(torch.argsort(logits_row)[:3].tolist())


def ref_and_triton(logits, params, pos=None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the torch reference and of the Triton launcher (KW, updated by kw) for
    logits [n, V] in slots 0..n-1 at positions pos (default 0..n-1)."""
    n = logits.shape[0]
    table = SamplingTensors.from_params(params, V, "cpu")
    slots = torch.arange(n)
    pos = torch.arange(n) if pos is None else pos
    ref = SamplerOutput.allocate(n, "cpu", None)
    tri = SamplerOutput.allocate(n, "cpu", None)
    reference.sample(logits, slots, pos, table, ref, None, SamplerVariant.DEFAULT, draw_block=DB)
    launch.sample(logits, slots, pos, table, tri, None, SamplerVariant.DEFAULT, **{**KW, **kw})
    return ref.token_ids, tri.token_ids


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_route_equals_reference(case) -> None:
    draw_case(case)


TOP_P_CASES = [c for c in CASES if c[0].startswith("top_p")]


@pytest.mark.parametrize("case", TOP_P_CASES, ids=[c[0] for c in TOP_P_CASES])
def test_top_p_routes_with_a_narrow_first_round(case, monkeypatch) -> None:
    """The same top-p rows with the first gather one nat below the guess instead of
    launch.TOP_P_STEP: fewer candidates per round, more rounds; the same tokens."""
    assert launch.TOP_P_STEP != 1
    monkeypatch.setattr(launch, "TOP_P_STEP", 1)
    draw_case(case)


def test_split_of_the_block_pass_changes_no_token() -> None:
    """The block pass's split follows B in the library; any split gives the same tokens."""
    name, logits_row, base, _ = CASES[3]
    params = [base.__class__(**{**base.__dict__, "seed": 70 + i}) for i in range(4)]
    logits = torch.stack([row(20 + i, 1.5) for i in range(4)])
    table = SamplingTensors.from_params(params, V, "cpu")
    outs = []
    for split in (1, 3, 10):
        out = SamplerOutput.allocate(4, "cpu", None)
        launch.sample(logits, torch.arange(4), torch.arange(4), table, out, None,
                      SamplerVariant.DEFAULT, **{**KW, "split": split, "rows": 1})  # fmt: skip
        outs.append(out.token_ids)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("name", ["top_k_block_bound", "top_p_rounds", "min_p_band"])
def test_gather_order_changes_no_token(name) -> None:
    """A gather reads its blocks from the packed list or in block order (masked): the
    same candidates either way, so the same tokens; each order is forced here."""
    _, logits_row, base, _ = next(c for c in CASES if c[0] == name)
    params = [base.__class__(**{**base.__dict__, "seed": 90 + i}) for i in range(NPOS)]
    logits = logits_row.expand(NPOS, -1).contiguous()
    table = SamplingTensors.from_params(params, V, "cpu")
    slots, pos = torch.arange(NPOS), torch.arange(NPOS) + 5
    ref = SamplerOutput.allocate(NPOS, "cpu", None)
    reference.sample(logits, slots, pos, table, ref, None, SamplerVariant.DEFAULT, draw_block=DB)
    for dense_div, gather_rows in ((0, 2), (1000, 2), (1000, 8)):
        out = SamplerOutput.allocate(NPOS, "cpu", None)
        launch.sample(logits, slots, pos, table, out, None, SamplerVariant.DEFAULT,
                      **{**KW, "dense_div": dense_div, "gather_rows": gather_rows})  # fmt: skip
        assert torch.equal(out.token_ids, ref.token_ids), (dense_div, gather_rows)


def test_min_p_bound_keeps_the_top_k_mass_of_top_p() -> None:
    """top-k 5, top-p 0.8, min-p 0.1: the 5th token is below min-p but in the top-k mass
    that top-p's threshold is taken of, and that mass keeps the 4th token. A candidate
    bound at min-p's (an earlier bug, seen on bf16 rows) dropped the 5th from the total
    and the 4th from the kept set."""
    x = torch.full((V,), -30.0)
    top = [(40, 0.0), (75, -0.375), (130, -0.5), (170, -0.625), (260, -2.3125)]
    for tok, val in top:
        x[tok] = val
    n = 48
    params = [P(top_k=5, top_p=0.8, min_p=0.1, seed=500 + i) for i in range(n)]
    ref, tri = ref_and_triton(x.expand(n, -1).contiguous(), params)
    assert set(ref.tolist()) == {40, 75, 130, 170}
    assert torch.equal(tri, ref)


def test_widths_must_be_powers_of_two() -> None:
    params = [P(seed=1, top_k=3)]
    table = SamplingTensors.from_params(params, V, "cpu")
    out = SamplerOutput.allocate(1, "cpu", None)
    with pytest.raises(ValueError, match="cap must be a power of two"):
        launch.sample(row(1, 1.0)[None], torch.arange(1), torch.arange(1), table, out,
                      **{**KW, "cap": 48})  # fmt: skip


@pytest.mark.parametrize("step", [1, 2])
def test_top_p_guess_checked_over_two_rounds(step, monkeypatch) -> None:
    """A row whose block masses overstate the mass near the top: each block holds one
    token at 0 and four at -1.5 * step (the rest far below). The guess lies just below
    the block maxes (within 1/8), so the first gather (down to the guess less step) leaves the
    -1.5 * step tokens out, while p = 0.99 needs nearly all of them; the exact mass check
    rejects the round and the second (the guess less 2 * step) gathers them."""
    monkeypatch.setattr(launch, "TOP_P_STEP", step)
    tier = -1.5 * step
    x = torch.full((V,), -30.0)
    x[::DB] = 0.0
    for blk in range(V // DB):
        x[blk * DB + 5 : blk * DB + 9] = tier
    n = 64
    params = [P(top_p=0.99, seed=300 + i) for i in range(n)]
    ref, tri = ref_and_triton(x.expand(n, -1).contiguous(), params, cap=128)
    assert torch.equal(tri, ref)
    drawn = x[ref]
    assert bool((drawn == tier).any())  # the second round's tokens are drawn
    assert bool(((drawn == 0.0) | (drawn == tier)).all())


def test_top_p_first_round_past_cap_starts_over_nearer() -> None:
    """Each block holds a token at 0, one at -0.5 and five at -1.5. The guess lies just
    below the block maxes; the first gather (down to the guess less TOP_P_STEP = 2) takes
    140 candidates, past CAP = 64, and the row starts over at the guess less 1: 40
    candidates whose mass (32.1 of 54.4) holds p = 0.55's. Tokens as the reference's."""
    assert launch.TOP_P_STEP == 2
    x = torch.full((V,), -30.0)
    x[::DB] = 0.0
    x[1::DB] = -0.5
    for blk in range(V // DB):
        x[blk * DB + 5 : blk * DB + 10] = -1.5
    n = 48
    params = [P(top_p=0.55, seed=700 + i) for i in range(n)]
    ref, tri = ref_and_triton(x.expand(n, -1).contiguous(), params, cap=64)
    assert torch.equal(tri, ref)
    drawn = x[ref]
    assert bool(((drawn == 0.0) | (drawn == -0.5)).all())
    assert bool((drawn == -0.5).any())


@pytest.mark.parametrize("gather_cap", [32, 128])
@pytest.mark.parametrize(
    "name,base",
    [("top_p", P(top_p=0.9)), ("min_p", P(min_p=0.02)), ("top_k", P(top_k=12))],
)
def test_rows_past_cap_without_top_k_go_to_band(name, base, gather_cap) -> None:
    """Rows whose candidates pass cap (32): top-p's first round gathers 106 and min-p's
    bound 109 (counted with a temporary device_print), within gather_cap = 128, where
    `band` draws over them; top-k 12's bound holds 58, sorted cap wide, so the exact path
    takes it. At gather_cap = cap min-p takes the exact path too and top-p starts over
    nearer its guess (16 candidates). Tokens as the reference's on every route."""
    logits_row = row(21, 2.0)
    params = [base.__class__(**{**base.__dict__, "seed": 800 + i}) for i in range(NPOS)]
    logits = logits_row.expand(NPOS, -1).contiguous()
    pos = torch.arange(NPOS) * 5 + 2
    ref, tri = ref_and_triton(logits, params, pos, gather_cap=gather_cap)
    assert torch.equal(tri, ref), name


def test_gather_cap_below_cap_is_refused() -> None:
    table = SamplingTensors.from_params([P(seed=1, top_p=0.5)], V, "cpu")
    out = SamplerOutput.allocate(1, "cpu", None)
    with pytest.raises(ValueError, match="gather_cap must be at least cap"):
        launch.sample(row(1, 1.0)[None], torch.arange(1), torch.arange(1), table, out,
                      **{**KW, "gather_cap": 16})  # fmt: skip
