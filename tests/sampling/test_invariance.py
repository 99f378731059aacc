"""Token-for-token invariance of the torch backend (DESIGN.md, "The invariant"): a row's
token depends only on (its logits row, its params, its seed, its position), not on its
batch position, its neighbours, the variant, logprobs on/off or the input dtype."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import graphexec as gx
from graphexec import SamplerVariant, SamplingParams

V = 203  # not a multiple of 4 (Philox lanes) nor of 32 (bitmask words)
NPOS = 24  # positions drawn per request in each comparison
P = SamplingParams


@dataclasses.dataclass
class Req:
    params: SamplingParams
    logits: torch.Tensor  # [V] fp32
    counts: torch.Tensor | None = None  # [V] int32
    prompt: torch.Tensor | None = None  # [V] bool
    allowed: torch.Tensor | None = None  # [V] bool (bitmask)
    pos0: int = 0


def _row(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(V, generator=g) * scale
    row[[3, 50]] = float(row.max())  # a tie at the max
    row[[11, 12, 199]] = float(row[40])  # a tie in the body
    row[[0, 77, 202]] = -torch.inf
    return row


def _counts(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 4, (V,), generator=g, dtype=torch.int32)
    return torch.where(torch.rand(V, generator=g) < 0.8, 0, c)


def _mask(seed: int, frac: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(V, generator=g) < frac


def make_requests() -> list[Req]:
    big_bias = {i * 13: (-1) ** i * 1.5 for i in range(12)}
    top = lambda r, n: torch.argsort(r, descending=True, stable=True)[:n].tolist()
    rows = [_row(100 + i) for i in range(16)]
    grammar = _mask(7, 0.4)
    grammar[top(rows[9], 1)] = False  # the grammar disallows the row's best token
    return [
        Req(P(temperature=0.0, seed=1), rows[0], pos0=0),
        Req(P(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5, seed=2), rows[1], pos0=5),
        Req(P(temperature=0.9, seed=3), rows[2], pos0=17),
        Req(P(top_k=8, seed=4), rows[3], pos0=1000),
        Req(P(top_p=0.85, temperature=1.2, seed=5), rows[4], pos0=3),
        Req(P(top_k=30, top_p=0.7, seed=6), rows[5], pos0=2**31),
        Req(P(min_p=0.1, temperature=1.3, seed=7), rows[6], pos0=9),
        Req(
            P(repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.4, seed=8),
            rows[7],
            counts=_counts(8),
            prompt=_mask(8, 0.2),
            pos0=40,
        ),
        Req(P(logit_bias=big_bias, temperature=0.7, seed=9), rows[8], pos0=2),
        Req(P(seed=10, top_k=50), rows[9], allowed=grammar, pos0=0),
        Req(
            P(
                temperature=0.8,
                top_k=40,
                top_p=0.9,
                min_p=0.05,
                seed=2**62 + 11,
                logit_bias={top(rows[10], 20)[-1]: 3.0},
                presence_penalty=-0.5,
                repetition_penalty=0.8,
            ),
            rows[10],
            counts=_counts(10),
            prompt=_mask(10, 0.1),
            allowed=_mask(10, 0.7),
            pos0=123,
        ),
        Req(P(seed=12, logprobs=3, logprobs_mode="processed", temperature=0.6), rows[11]),
        Req(P(seed=13, top_k=V), rows[12], pos0=77),
        Req(P(temperature=0.0, seed=14), rows[13], allowed=_mask(14, 0.3), pos0=4),
        Req(P(temperature=0.0, seed=15, frequency_penalty=2.0), rows[14], counts=_counts(15)),
        Req(P(seed=16, temperature=2.0, logit_bias={5: 4.0}), rows[15], pos0=1),
    ]


REQS = make_requests()


def _bits(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V/32)] int32 xgrammar bitmask words."""
    padded = torch.zeros((V + 31) // 32 * 32, dtype=torch.int64)
    padded[:V] = allowed.to(torch.int64)
    words = (padded.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def run(
    items: list[tuple[Req, int]],
    variant: str | None = None,
    dtype: torch.dtype = torch.float32,
    params_fn=lambda p: p,
    logits_fn=lambda x: x,
) -> gx.SamplerOutput:
    """Sample a batch of (request, position) items; optional tensors only when needed."""
    kw = {}
    if any(r.counts is not None for r, _ in items):
        z = torch.zeros(V, dtype=torch.int32)
        kw["token_counts"] = torch.stack([z if r.counts is None else r.counts for r, _ in items])
    if any(r.prompt is not None for r, _ in items):
        z = torch.zeros(V, dtype=torch.bool)
        kw["prompt_mask"] = torch.stack([z if r.prompt is None else r.prompt for r, _ in items])
    if any(r.allowed is not None for r, _ in items):
        ones = torch.ones(V, dtype=torch.bool)
        kw["bitmask"] = torch.stack(
            [_bits(ones if r.allowed is None else r.allowed) for r, _ in items]
        )
    logits = logits_fn(torch.stack([r.logits for r, _ in items]).to(dtype))
    return gx.sample_logits(
        logits,
        [params_fn(r.params) for r, _ in items],
        [pos for _, pos in items],
        variant=variant,
        backend="torch",
        **kw,
    )


def alone(req: Req, pos: int, **kw) -> int:
    out = run([(req, pos)], **kw)
    assert bool(out.valid[0])
    return int(out.token_ids[0])


@pytest.fixture(scope="module")
def alone_tokens() -> dict[tuple[int, int], int]:
    return {(i, r.pos0 + j): alone(r, r.pos0 + j) for i, r in enumerate(REQS) for j in range(NPOS)}


def test_requests_sample_varied_tokens(alone_tokens) -> None:
    # sanity: sampled requests do vary over positions, greedy ones do not
    for i, r in enumerate(REQS):
        toks = {alone_tokens[i, r.pos0 + j] for j in range(NPOS)}
        if r.params.greedy:
            assert len(toks) == 1
        else:
            assert len(toks) >= 2, i


def test_batch_position_and_neighbours(alone_tokens) -> None:
    rnd = random.Random(0)
    items = [(i, REQS[i].pos0 + j) for i in range(len(REQS)) for j in range(NPOS)]
    batches = [items, items[::-1]]
    for _ in range(6):
        shuffled = items[:]
        rnd.shuffle(shuffled)
        batches.append(shuffled[: rnd.randint(1, len(items))])
    # the same request several times in one batch, and each request beside one other
    batches.append([items[0], items[0], items[NPOS * 10], items[0]])
    for i in range(len(REQS)):
        batches.append([(i, REQS[i].pos0), ((i + 5) % len(REQS), REQS[(i + 5) % len(REQS)].pos0)])
    for batch in batches:
        out = run([(REQS[i], pos) for i, pos in batch])
        assert out.valid.all()
        got = out.token_ids.tolist()
        assert got == [alone_tokens[key] for key in batch]


def test_forced_variants_give_default_token() -> None:
    served_by_all = 0
    for i, r in enumerate(REQS):
        items = [(r, r.pos0 + j) for j in range(NPOS * 4)]
        default = run(items, variant="default").token_ids
        for v in SamplerVariant:
            if v.serves(r.params):
                assert torch.equal(run(items, variant=v.value).token_ids, default), (i, v)
        assert torch.equal(run(items).token_ids, default), i  # chosen variant
        served_by_all += SamplerVariant.NO_FILTER.serves(r.params)
    assert served_by_all >= 5
    # a whole batch of no_filter-servable rows, in each variant
    plain = [
        (r, r.pos0 + j)
        for r in REQS
        if SamplerVariant.NO_FILTER.serves(r.params)
        for j in range(NPOS)
    ]
    ref = run(plain, variant="default").token_ids
    for v in ("no_filter", "top_k_top_p", None):
        assert torch.equal(run(plain, variant=v).token_ids, ref)


@pytest.mark.parametrize(
    "off,variant",
    [
        (dict(top_k=-1), "default"),
        (dict(top_k=0), "default"),
        (dict(top_k=0), "top_k_top_p"),
        (dict(top_k=V), None),
        (dict(top_k=V), "default"),
        (dict(top_p=1.0), "default"),
        (dict(top_p=1.0), "top_k_top_p"),
        (dict(min_p=0.0), "default"),
        (dict(top_k=V, top_p=1.0, min_p=0.0), "default"),
    ],
)
def test_off_values_filter_nothing(off: dict, variant: str | None) -> None:
    # a flat row: many tokens carry mass, so a filter that removes any would show
    row = _row(5, scale=0.7)
    for temperature in (1.0, 0.5):
        base = Req(P(seed=99, temperature=temperature), row)
        items = [(base, j) for j in range(512)]
        ref = run(items, variant="no_filter").token_ids
        assert len(set(ref.tolist())) > 60
        offp = lambda p: dataclasses.replace(p, **off)  # noqa: B023
        assert torch.equal(run(items, variant=variant, params_fn=offp).token_ids, ref)


def test_active_filter_changes_tokens() -> None:
    # the control for test_off_values_filter_nothing
    row = _row(5, scale=0.7)
    items = [(Req(P(seed=99), row), j) for j in range(512)]
    ref = run(items).token_ids
    for on in (dict(top_k=V - 40), dict(top_p=0.95), dict(min_p=0.05)):
        got = run(items, params_fn=lambda p: dataclasses.replace(p, **on)).token_ids  # noqa: B023
        assert not torch.equal(got, ref), on


def test_greedy_is_argmax_with_ties_to_lower_id() -> None:
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, V, generator=g)
    rows[0, [150, 17, 90]] = 9.0  # tie at the max: 17
    rows[1, [202, 201]] = 5.0  # tie at the end of the row: 201
    rows[2, :] = 1.0  # all equal: 0
    rows[3, 0] = -torch.inf  # the max elsewhere
    rows[4, [0, 1]] = 7.0  # the first ids
    rows[5, :100] = -torch.inf
    expect = [int(np.flatnonzero(r == r.max())[0]) for r in rows.numpy()]
    assert expect[:3] == [17, 201, 0] and expect[4] == 0
    for params in (
        P(temperature=0.0, seed=0),
        P(temperature=0.0, seed=2**63 - 1, top_k=1, top_p=0.1, min_p=1.0),
    ):
        for pos in (0, 1, 999, 2**32 - 1):
            out = gx.sample_logits(rows, [params] * 6, [pos] * 6, backend="torch")
            assert out.token_ids.tolist() == expect


def test_greedy_tie_created_by_bias() -> None:
    row = torch.zeros(1, V)
    row[0, 100] = 3.0
    row[0, 30] = 1.0
    params = P(temperature=0.0, seed=4, logit_bias={30: 2.0})
    out = gx.sample_logits(row, [params], [0], backend="torch")
    assert out.token_ids.tolist() == [30]
    params = P(temperature=0.0, seed=4, logit_bias={30: 1.75})
    assert gx.sample_logits(row, [params], [0], backend="torch").token_ids.tolist() == [100]


def test_seeds_and_positions_change_tokens() -> None:
    row = torch.zeros(64)
    items = lambda seed: [(Req(P(seed=seed), row), j) for j in range(256)]
    a = run(items(1)).token_ids
    assert len(set(a.tolist())) > 40
    assert torch.equal(a, run(items(1)).token_ids)  # a pure function
    for other in (2, 1 + 2**32, 2**63 - 1):
        b = run(items(other)).token_ids
        assert (a != b).float().mean() > 0.8, other


def test_logprobs_do_not_change_tokens(alone_tokens) -> None:
    items = [(r, r.pos0 + j) for r in REQS for j in range(NPOS)]
    ref = run(items, params_fn=lambda p: dataclasses.replace(p, logprobs=None))
    assert ref.logprobs is None
    for lp, mode in ((0, "raw"), (5, "raw"), (20, "processed"), (None, "processed")):
        fn = lambda p: dataclasses.replace(p, logprobs=lp, logprobs_mode=mode)  # noqa: B023
        out = run(items, params_fn=fn)
        assert torch.equal(out.token_ids, ref.token_ids), (lp, mode)
    # only some rows asking
    mixed = lambda p: dataclasses.replace(p, logprobs=7 if p.seed % 2 else None)
    assert torch.equal(run(items, params_fn=mixed).token_ids, ref.token_ids)
    assert ref.token_ids.tolist() == [alone_tokens[REQS.index(r), pos] for r, pos in items]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_equal_their_fp32_upcast(dtype: torch.dtype) -> None:
    items = [(r, r.pos0 + j) for r in REQS for j in range(NPOS)]
    half = run(items, dtype=dtype)
    upcast = run(items, dtype=dtype, logits_fn=lambda x: x.to(torch.float32))
    assert half.valid.all()
    assert torch.equal(half.token_ids, upcast.token_ids)
    # with logprobs on as well: same tokens, same logprob values
    lp = lambda p: dataclasses.replace(p, logprobs=4)
    a = run(items, dtype=dtype, params_fn=lp)
    b = run(items, dtype=dtype, params_fn=lp, logits_fn=lambda x: x.to(torch.float32))
    assert torch.equal(a.token_ids, half.token_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
    assert torch.equal(a.top_token_ids, b.top_token_ids)


@pytest.mark.parametrize(
    "dtype,values",
    [(torch.bfloat16, [3.001, 2.999, 3.002]), (torch.float16, [3.0004, 2.9996, 3.0007])],
)
def test_half_rounding_ties_follow_the_rounded_values(dtype: torch.dtype, values: list) -> None:
    # distinct in fp32 (argmax id 90), equal after rounding (greedy: the lowest id, 10)
    row = torch.zeros(1, V)
    row[0, [40, 10, 90]] = torch.tensor(values)
    assert int(torch.argmax(row)) == 90
    half = row.to(dtype)
    assert bool((half[0, [40, 10, 90]] == half[0, 10]).all())
    greedy = P(temperature=0.0, seed=0)
    assert gx.sample_logits(half, [greedy], [0], backend="torch").token_ids.tolist() == [10]
    # and sampled: the three tied tokens share the mass equally, in bf16 and its upcast
    items = [P(seed=3, temperature=0.05)] * 3000
    a = gx.sample_logits(half.expand(3000, -1), items, list(range(3000)), backend="torch")
    b = gx.sample_logits(half.float().expand(3000, -1), items, list(range(3000)), backend="torch")
    assert torch.equal(a.token_ids, b.token_ids)
    counts = np.bincount(a.token_ids.numpy(), minlength=V)
    assert counts.sum() == counts[[10, 40, 90]].sum()
    assert counts[[10, 40, 90]].min() > 850


@pytest.mark.parametrize("variant", ["no_filter", "top_k_top_p", "default"])
def test_long_rows_logprobs_do_not_depend_on_batch_or_threads(variant, restore_threads) -> None:
    """Rows of a real vocabulary with two threads: torch splits a lone row's sum across
    threads and gives each thread whole rows in a batch, so the log-sum-exp is summed in
    fixed blocks (`reference.block_ordered_sum`); logprobs and top logprobs of a row are
    the same bits alone and in a batch of 32 (the plain sum differed in a few of them)."""
    torch.set_num_threads(2)
    Vr, B = 100_352, 32
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, Vr, generator=g) * 3
    params = [P(temperature=0.7, top_k=40 if variant != "no_filter" else 0,
                top_p=0.9 if variant != "no_filter" else 1.0, seed=i, logprobs=4)
              for i in range(B)]  # fmt: skip
    pos = torch.arange(B)
    full = gx.sample_logits(logits, params, pos, variant=variant)
    for lo, hi in [(i, i + 1) for i in range(B)] + [(3, 6)]:
        part = gx.sample_logits(logits[lo:hi], params[lo:hi], pos[lo:hi], variant=variant)
        assert torch.equal(part.token_ids, full.token_ids[lo:hi])
        assert torch.equal(part.logprobs, full.logprobs[lo:hi])
        assert torch.equal(part.top_logprobs, full.top_logprobs[lo:hi])
