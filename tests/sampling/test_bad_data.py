"""Bad data and bad arguments (DESIGN.md): NaN is never sampled, +inf rows sample uniformly
among their +inf entries, rows with nothing to sample get valid=False without touching the
other rows, and bad arguments to sample_logits raise a ValueError naming the argument."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.stats
import torch

import graphexec as gx
from graphexec import SamplingParams

P = SamplingParams
V = 70
NAN, INF = float("nan"), float("inf")


def rows(b: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 2


def sample(logits, params, positions, **kw) -> gx.SamplerOutput:
    return gx.sample_logits(logits, params, positions, backend="torch", **kw)


# ------------------------------------------------------------------------------ NaN / inf


@pytest.mark.parametrize(
    "params",
    [
        P(seed=1),
        P(seed=2, temperature=0.4),
        P(seed=3, top_k=5),
        P(seed=4, top_p=0.5),
        P(seed=5, min_p=0.3),
        P(seed=6, temperature=0.0),
        P(seed=7, logprobs=3),
    ],
    ids=["plain", "t0.4", "top_k", "top_p", "min_p", "greedy", "logprobs"],
)
def test_nan_is_never_sampled(params: SamplingParams) -> None:
    n = 3000
    row = rows(1, 0)[0] * 0.3
    nan_ids = [0, 3, 4, 20, 21, 22, 50, 69]
    row[nan_ids] = NAN
    out = sample(row.expand(n, -1), [params] * n, list(range(n)))
    assert out.valid.all()
    toks = out.token_ids.numpy()
    assert not np.isin(toks, nan_ids).any()
    if not params.greedy:
        assert len(set(toks.tolist())) >= 3
    if params.logprobs is not None:
        assert torch.isfinite(out.logprobs).all()


def test_nan_treated_as_absent_token() -> None:
    # NaN where the row's max would be: the tokens equal those of the row with -inf there
    n = 500
    row = rows(1, 1)[0]
    top = int(torch.argmax(row))
    with_nan, with_ninf = row.clone(), row.clone()
    with_nan[[top, 7]] = NAN
    with_ninf[[top, 7]] = -INF
    for params in (P(seed=9), P(seed=9, top_p=0.6), P(seed=9, temperature=0.0)):
        a = sample(with_nan.expand(n, -1), [params] * n, list(range(n)))
        b = sample(with_ninf.expand(n, -1), [params] * n, list(range(n)))
        assert torch.equal(a.token_ids, b.token_ids)
        assert not torch.isin(a.token_ids, torch.tensor([top, 7])).any()


@pytest.mark.parametrize("params", [P(seed=21), P(seed=22, temperature=3.0, top_p=0.999)])
def test_plus_inf_row_samples_uniformly_among_inf_entries(params: SamplingParams) -> None:
    n = 30_000
    row = rows(1, 2)[0] * 5
    inf_ids = [2, 9, 10, 41, 68]
    row[inf_ids] = INF
    row[[0, 1]] = NAN
    row[3] = 1e30
    out = sample(row.expand(n, -1), [params] * n, list(range(n)))
    assert out.valid.all()
    toks = out.token_ids.numpy()
    assert np.isin(toks, inf_ids).all()
    counts = np.bincount(toks, minlength=V)[inf_ids]
    assert scipy.stats.chisquare(counts).pvalue > 1e-6


def test_plus_inf_greedy_and_top_k_one_pick_lowest_inf_id() -> None:
    row = rows(1, 3)[0]
    row[[44, 12, 60]] = INF
    row[5] = 1e38
    for params in (P(seed=1, temperature=0.0), P(seed=1, top_k=1)):
        out = sample(row.expand(64, -1), [params] * 64, list(range(64)))
        assert out.token_ids.tolist() == [12] * 64


def test_plus_inf_with_bias_and_penalty_still_uniform_over_inf() -> None:
    # processors do not turn +inf into NaN or lose it; a bitmask can still remove it
    n = 4000
    row = rows(1, 4)[0]
    row[[6, 7, 8]] = INF
    allowed = torch.ones(V, dtype=torch.bool)
    allowed[8] = False
    words = (
        torch.nn.functional.pad(allowed.long(), (0, 96 - V)).view(3, 32) << torch.arange(32)
    ).sum(1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    counts = torch.zeros(V, dtype=torch.int32)
    counts[[6, 30]] = 2
    params = P(
        seed=5,
        logit_bias={7: -5.0},
        presence_penalty=2.0,
        frequency_penalty=2.0,
        repetition_penalty=1.5,
        temperature=0.5,
    )
    out = sample(
        row.expand(n, -1),
        [params] * n,
        list(range(n)),
        bitmask=bitmask.expand(n, -1).contiguous(),
        token_counts=counts.expand(n, -1).contiguous(),
    )
    toks = out.token_ids.numpy()
    assert np.isin(toks, [6, 7]).all()
    assert scipy.stats.chisquare(np.bincount(toks, minlength=V)[[6, 7]]).pvalue > 1e-6


# ----------------------------------------------------------------- rows with nothing to draw


def _bitmask_rows(allowed: torch.Tensor) -> torch.Tensor:
    b = allowed.shape[0]
    padded = torch.zeros(b, (V + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(b, -1, 32) << torch.arange(32)).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_unsamplable_rows_are_invalid_and_do_not_leak() -> None:
    B = 9
    logits = rows(B, 5)
    logits[1] = -INF  # all -inf
    logits[3] = NAN  # all NaN
    logits[5, ::2] = NAN
    logits[5, 1::2] = -INF  # NaN and -inf
    allowed = torch.ones(B, V, dtype=torch.bool)
    allowed[7] = False  # a grammar that allows nothing
    allowed[8, 40:] = False  # a grammar that allows something
    params = [
        P(seed=10),
        P(seed=11, logprobs=2),
        P(seed=12, top_k=4, logprobs=2),
        P(seed=13, temperature=0.0),
        P(seed=14, min_p=0.2, presence_penalty=1.0),
        P(seed=15, top_p=0.5),
        P(seed=16, logit_bias={3: 5.0}),
        P(seed=17, logit_bias={3: 5.0}, temperature=0.0),
        P(seed=18, top_k=3, logprobs=0),
    ]
    positions = [4, 1, 2, 3, 0, 5, 6, 7, 8]
    counts = torch.ones(B, V, dtype=torch.int32)
    bitmask = _bitmask_rows(allowed)
    out = sample(logits, params, positions, bitmask=bitmask, token_counts=counts)
    bad = [1, 3, 5, 7]
    assert out.valid.tolist() == [b not in bad for b in range(B)]
    assert out.token_ids[bad].tolist() == [-1] * len(bad)
    good = [b for b in range(B) if b not in bad]
    assert ((out.token_ids[good] >= 0) & (out.token_ids[good] < V)).all()
    assert int(out.token_ids[8]) < 40
    for b in good:
        alone = sample(
            logits[b : b + 1],
            [params[b]],
            [positions[b]],
            bitmask=bitmask[b : b + 1],
            token_counts=counts[b : b + 1],
        )
        assert bool(alone.valid[0])
        assert int(alone.token_ids[0]) == int(out.token_ids[b]), b
        if alone.logprobs is not None:
            torch.testing.assert_close(alone.logprobs[0], out.logprobs[b], rtol=1e-6, atol=0)
    # the same good rows sampled without the bad ones
    clean = sample(
        logits[good],
        [params[b] for b in good],
        [positions[b] for b in good],
        bitmask=bitmask[good],
        token_counts=counts[good],
    )
    assert torch.equal(clean.token_ids, out.token_ids[good])


@pytest.mark.parametrize("variant", ["no_filter", "top_k_top_p", "default"])
def test_invalid_rows_in_every_variant(variant: str) -> None:
    logits = rows(3, 6)
    logits[0] = -INF
    logits[2] = NAN
    params = [P(seed=1, temperature=t) for t in (1.0, 0.5, 0.0)]
    out = sample(logits, params, [0, 0, 0], variant=variant)
    assert out.valid.tolist() == [False, True, False]
    assert out.token_ids.tolist()[0::2] == [-1, -1]


def test_single_finite_token_is_always_drawn() -> None:
    row = torch.full((V,), -INF)
    row[33] = -1e30
    row[[1, 2]] = NAN
    for params in (P(seed=1), P(seed=1, top_p=0.1, min_p=1.0), P(seed=1, temperature=0.0)):
        out = sample(row.expand(50, -1), [params] * 50, list(range(50)))
        assert out.valid.all() and out.token_ids.tolist() == [33] * 50


@pytest.mark.parametrize(
    "temperature,row",
    [
        # x / T overflows fp32 for x > ~3.4e38 * T; the exact distribution is still a point
        # mass on the argmax (p(4) / p(5) = exp(-1e38)), not a uniform draw over the tokens
        # that overflowed to +inf, and 0 / T is 0, not NaN
        (1e-38, [5.0, 4.0, 0.0, -1.0]),
        (1e-40, [0.0, -1.0, -2.0, -3.0]),
        (1e-40, [-1.0, -2.0, 0.5, -3.0]),
    ],
)
def test_tiny_temperature_does_not_overflow(temperature: float, row: list) -> None:
    n = 200
    logits = torch.tensor(row).expand(n, -1)
    out = sample(logits, [P(seed=3, temperature=temperature)] * n, list(range(n)))
    assert out.valid.all()
    assert set(out.token_ids.tolist()) == {int(np.argmax(row))}


@pytest.mark.parametrize("temperature", [1e-5, 1e-6, 1e-37])
def test_low_temperature_ties_stay_uniform(temperature: float) -> None:
    # tokens 0 and 1 tie at the max; every other token has probability exp(-1/T) ~ 0.
    # Exact sampling draws 0 and 1 half the time each; the noise must not be lost to the
    # rounding of x / T + g when x / T is large (ulp(3e7) = 2 in fp32).
    n = 20_000
    logits = torch.tensor([30.0, 30.0, 29.0, 0.0]).expand(n, -1)
    out = sample(logits, [P(seed=4, temperature=temperature)] * n, list(range(n)))
    counts = np.bincount(out.token_ids.numpy(), minlength=4)
    assert counts[2:].sum() == 0
    assert scipy.stats.binomtest(int(counts[0]), n, 0.5).pvalue > 1e-6, counts.tolist()


# ------------------------------------------------------------------------ argument errors


def _ok(b: int = 2) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    return rows(b, 7), [P(seed=i) for i in range(b)], list(range(b))


def raises_naming(name: str):
    return pytest.raises(ValueError, match=rf"(?<![A-Za-z0-9_]){re.escape(name)}")


@pytest.mark.parametrize(
    "logits",
    [
        rows(2, 0)[0],  # 1-D
        rows(2, 0).unsqueeze(0),  # 3-D
        rows(2, 0).double(),
        (rows(2, 0) * 10).to(torch.int32),
        rows(2, 0) > 0,
        torch.zeros(2, 0),
        rows(2, 0).tolist(),
    ],
    ids=["1d", "3d", "float64", "int32", "bool", "V=0", "list"],
)
def test_bad_logits(logits) -> None:
    with raises_naming("logits"):
        gx.sample_logits(logits, [P(seed=1), P(seed=2)], [0, 1], backend="torch")


@pytest.mark.parametrize(
    "positions",
    [[0], [0, 1, 2], [[0, 1]], [-1, 0], [0, 2**32], torch.tensor([0.5, 1.0])],
    ids=["short", "long", "2d", "negative", "too_big", "float"],
)
def test_bad_positions(positions) -> None:
    logits, params, _ = _ok()
    with raises_naming("positions"):
        sample(logits, params, positions)


def test_positions_accept_int_tensors_and_lists_alike() -> None:
    logits, params, _ = _ok()
    a = sample(logits, params, [5, 2**32 - 1])
    for pos in (torch.tensor([5, 2**32 - 1]), np.array([5, 2**32 - 1]), (5, 2**32 - 1)):
        assert torch.equal(sample(logits, params, pos).token_ids, a.token_ids)


@pytest.mark.parametrize(
    "name,value",
    [
        ("bitmask", torch.zeros(2, 2, dtype=torch.int32)),  # ceil(70/32) = 3 words
        ("bitmask", torch.zeros(1, 3, dtype=torch.int32)),
        ("bitmask", torch.zeros(2, 3, dtype=torch.int64)),
        ("bitmask", torch.zeros(2, 3, dtype=torch.bool)),
        ("bitmask", torch.zeros(2, V, dtype=torch.bool)),
        ("token_counts", torch.zeros(2, V - 1, dtype=torch.int32)),
        ("token_counts", torch.zeros(V, dtype=torch.int32)),
        ("token_counts", torch.zeros(2, V, dtype=torch.float32)),
        ("token_counts", np.zeros((2, V), dtype=np.int32)),
        ("prompt_mask", torch.zeros(3, V, dtype=torch.bool)),
        ("prompt_mask", torch.zeros(2, V, dtype=torch.float32)),
        ("prompt_mask", [[False] * V] * 2),
        ("token_counts", torch.zeros(2, V, dtype=torch.int32, device="meta")),
    ],
    ids=[
        "bitmask_words",
        "bitmask_rows",
        "bitmask_int64",
        "bitmask_bool",
        "bitmask_unpacked",
        "counts_short",
        "counts_1d",
        "counts_float",
        "counts_numpy",
        "mask_rows",
        "mask_float",
        "mask_list",
        "counts_device",
    ],
)
def test_bad_optional_tensors(name: str, value) -> None:
    logits, _, positions = _ok()
    params = [P(seed=1, presence_penalty=0.5, repetition_penalty=1.2)] * 2
    with raises_naming(name):
        sample(logits, params, positions, **{name: value})


def test_int64_counts_and_bool_mask_are_accepted() -> None:
    logits, _, positions = _ok()
    params = [P(seed=1, frequency_penalty=1.0, repetition_penalty=1.5)] * 2
    counts = torch.randint(0, 3, (2, V), generator=torch.Generator().manual_seed(0))
    mask = counts == 1
    a = sample(logits, params, positions, token_counts=counts.int(), prompt_mask=mask)
    b = sample(logits, params, positions, token_counts=counts.long(), prompt_mask=mask)
    assert torch.equal(a.token_ids, b.token_ids)


def test_params_errors() -> None:
    logits, params, positions = _ok()
    with raises_naming("params"):
        sample(logits, params[:1], positions)
    with raises_naming("params"):
        sample(logits, params + [P(seed=9)], positions)
    with raises_naming("params"):
        sample(logits, [params[0], {"seed": 1}], positions)
    with pytest.raises(ValueError, match=r"seed"):
        sample(logits, [params[0], P()], positions)
    with raises_naming("top_k"):
        sample(logits, [params[0], P(seed=1, top_k=V + 1)], positions)
    with raises_naming("logit_bias"):
        sample(logits, [params[0], P(seed=1, logit_bias={V: 1.0})], positions)
    sample(logits, [params[0], P(seed=1, top_k=V, logit_bias={V - 1: 1.0})], positions)


def test_backend_errors() -> None:
    logits, params, positions = _ok()
    for bad in ("cuda", "Torch", "numpy"):
        with raises_naming("backend"):
            gx.sample_logits(logits, params, positions, backend=bad)
    with raises_naming("backend"):
        gx.sample_logits(logits, params, positions, backend="flashinfer")
    # None and "torch" on CPU are the same backend
    a = gx.sample_logits(logits, params, positions)
    b = gx.sample_logits(logits, params, positions, backend="torch")
    assert torch.equal(a.token_ids, b.token_ids)


def test_variant_errors() -> None:
    logits, _, positions = _ok()
    params = [P(seed=1), P(seed=2, top_k=5)]
    with raises_naming("variant"):
        sample(logits, params, positions, variant="no_filter")
    with raises_naming("variant"):
        sample(logits, params, positions, variant=gx.SamplerVariant.NO_FILTER)
    with raises_naming("variant"):
        sample(logits, [P(seed=1), P(seed=2, min_p=0.1)], positions, variant="top_k_top_p")
    with raises_naming("variant"):
        sample(logits, params, positions, variant="fast")
    for ok in ("top_k_top_p", "default", gx.SamplerVariant.DEFAULT):
        sample(logits, params, positions, variant=ok)


def test_empty_batch() -> None:
    out = sample(torch.zeros(0, V), [], [])
    assert out.token_ids.shape == (0,) and out.valid.shape == (0,)
