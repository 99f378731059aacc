"""Logprobs of the torch backend: raw (log_softmax of the logits) and processed (after
grammar, bias, penalties and temperature), ranks, the top-N and the output shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphexec as gx
from graphexec import SamplingParams

P = SamplingParams
V = 100
RTOL = 1e-6
ATOL = 1e-6  # a few fp32 ulps at |logprob| ~ 10


def dyadic_rows(b: int, seed: int) -> torch.Tensor:
    """Multiples of 1/8 in [-8, 8): exact in fp32 under the dyadic processing below, and
    full of ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 64, (b, V), generator=g).float() / 8


def order(values: np.ndarray) -> list[int]:
    """Token ids by (value desc, id asc)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def check_row(out: gx.SamplerOutput, b: int, values: np.ndarray, asked: int) -> None:
    """Row b's logprob, rank and first `asked` top entries against float64 `values`."""
    lp = log_softmax64(values)
    tok = int(out.token_ids[b])
    assert tok >= 0
    np.testing.assert_allclose(float(out.logprobs[b]), lp[tok], rtol=RTOL, atol=ATOL)
    assert int(out.ranks[b]) == 1 + int((values > values[tok]).sum())
    ids = order(values)[:asked]
    assert out.top_token_ids[b, :asked].tolist() == ids
    np.testing.assert_allclose(
        out.top_logprobs[b, :asked].double().numpy(), lp[ids], rtol=RTOL, atol=ATOL
    )


def test_raw_logprobs_are_log_softmax_of_the_raw_row() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g) * 3
    logits[2, 10:20] = -torch.inf
    logits[3, [4, 9, 60]] = logits[3].max()  # tied max
    counts = torch.randint(0, 3, (8, V), generator=g, dtype=torch.int32)
    params = [
        P(seed=1, logprobs=5),
        P(seed=2, logprobs=5, temperature=0.3),
        P(seed=3, logprobs=5, top_k=3),
        P(seed=4, logprobs=5, temperature=0.0),
        P(seed=5, logprobs=5, logit_bias={7: 6.0, 8: -3.0}),
        P(seed=6, logprobs=5, presence_penalty=1.5, frequency_penalty=0.5),
        P(seed=7, logprobs=5, repetition_penalty=1.7, min_p=0.2),
        P(seed=8, logprobs=5, top_p=0.5, temperature=1.9),
    ]
    out = gx.sample_logits(logits, params, list(range(8)), token_counts=counts, backend="torch")
    assert out.logprobs.dtype == torch.float32 and out.ranks.dtype == torch.int64
    assert out.top_logprobs.shape == (8, 5) and out.top_token_ids.dtype == torch.int64
    ref = torch.log_softmax(logits.double(), dim=-1)
    for b in range(8):
        check_row(out, b, logits[b].double().numpy(), 5)
        torch.testing.assert_close(
            out.top_logprobs[b].double(),
            ref[b].sort(descending=True).values[:5],
            rtol=RTOL,
            atol=ATOL,
        )
    # the greedy row with a tied max: token = lowest tied id, rank 1
    assert int(out.token_ids[3]) == 4 and int(out.ranks[3]) == 1
    assert out.top_token_ids[3, :3].tolist() == [4, 9, 60]


def processed64(
    row: torch.Tensor,
    p: SamplingParams,
    counts: np.ndarray,
    prompt: np.ndarray,
    allowed: np.ndarray,
) -> np.ndarray:
    """DESIGN.md processing order in float64: grammar, bias, penalties, temperature."""
    y = row.double().numpy().copy()
    y[~allowed] = -np.inf
    for tok, bias in (p.logit_bias or {}).items():
        y[tok] += bias
    seen = (counts > 0) | prompt
    y = np.where(seen, np.where(y > 0, y / p.repetition_penalty, y * p.repetition_penalty), y)
    y = y - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if p.temperature > 0:
        y = y / p.temperature
    return y


def _bitmask(allowed: np.ndarray) -> torch.Tensor:
    b = allowed.shape[0]
    padded = np.zeros((b, (V + 31) // 32 * 32), dtype=np.int64)
    padded[:, :V] = allowed
    words = (padded.reshape(b, -1, 32) << np.arange(32)).sum(axis=2)
    return torch.from_numpy(np.where(words >= 2**31, words - 2**32, words).astype(np.int32))


@pytest.mark.parametrize("pos", [0, 7])
def test_processed_logprobs_are_log_softmax_of_the_processed_row(pos: int) -> None:
    B = 9
    logits = dyadic_rows(B, seed=1 + pos)
    g = np.random.default_rng(5 + pos)
    counts = np.where(g.random((B, V)) < 0.15, g.integers(1, 4, (B, V)), 0)
    prompt = g.random((B, V)) < 0.1
    allowed = g.random((B, V)) < 0.8
    allowed[:4] = True
    kw = dict(logprobs=6, logprobs_mode="processed")
    params = [
        P(seed=1, temperature=0.5, **kw),
        P(seed=2, temperature=2.0, logit_bias={3: 1.5, 50: -2.25}, **kw),
        P(seed=3, temperature=0.25, presence_penalty=0.5, frequency_penalty=0.25, **kw),
        P(seed=4, repetition_penalty=2.0, **kw),
        P(seed=5, temperature=0.0, logit_bias={9: 4.0}, presence_penalty=1.0, **kw),  # greedy
        P(seed=6, temperature=0.0, top_k=2, **kw),  # greedy: filters and temperature unused
        P(seed=7, temperature=0.5, top_k=10, top_p=0.8, min_p=0.1, **kw),  # not filtered
        P(
            seed=8,
            temperature=2.0,
            repetition_penalty=0.5,
            frequency_penalty=-1.0,
            logit_bias={0: 0.125},
            **kw,
        ),
        P(seed=9, logprobs=6),  # raw, beside processed rows
    ]
    out = gx.sample_logits(
        logits,
        params,
        [pos] * B,
        token_counts=torch.from_numpy(counts.astype(np.int32)),
        prompt_mask=torch.from_numpy(prompt),
        bitmask=_bitmask(allowed),
        backend="torch",
    )
    assert out.valid.all()
    for b, p in enumerate(params):
        if p.logprobs_mode == "processed":
            values = processed64(logits[b], p, counts[b], prompt[b], allowed[b])
            assert not np.allclose(
                np.where(np.isfinite(values), values, 0), logits[b].double().numpy()
            )
        else:
            values = logits[b].double().numpy()
        check_row(out, b, values, 6)
        if p.greedy:
            assert int(out.ranks[b]) == 1  # the argmax of the processed row
    # the processed logprob of a grammar-disallowed token is -inf
    blocked = [b for b in range(4, 8) if not allowed[b].all()]
    assert blocked
    for b in blocked:
        lp_all = out.top_logprobs[b]
        assert torch.isfinite(lp_all).all()  # the top-6 lies inside the allowed set
        assert set(out.top_token_ids[b].tolist()) <= set(np.flatnonzero(allowed[b]).tolist())


def test_rank_counts_strictly_greater_values() -> None:
    # a row of few distinct values: most sampled tokens share their value with others
    row = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 0.5, 0.0, 2.0] * 8)  # V = 64
    n = 400
    params = [P(seed=11, logprobs=0)] * n
    out = gx.sample_logits(row.expand(n, -1), params, list(range(n)), backend="torch")
    vals = row.numpy()
    expected_rank = {2.0: 1, 1.0: 9, 0.5: 33, 0.0: 49}
    seen = set()
    for tok, rank in zip(out.token_ids.tolist(), out.ranks.tolist(), strict=True):
        assert rank == expected_rank[float(vals[tok])]
        seen.add(rank)
    assert seen == {1, 9, 33, 49}


def test_top_n_ties_go_to_the_lower_id() -> None:
    row = torch.zeros(1, V)
    row[0, [70, 5, 33]] = 4.0
    row[0, [99, 1]] = 3.0
    row[0, [50, 20, 80]] = 2.0
    out = gx.sample_logits(row, [P(seed=1, logprobs=7)], [0], backend="torch")
    assert out.top_token_ids[0].tolist() == [5, 33, 70, 1, 99, 20, 50]
    lp = log_softmax64(row[0].numpy())
    np.testing.assert_allclose(
        out.top_logprobs[0].double().numpy(), lp[[5, 33, 70, 1, 99, 20, 50]], rtol=RTOL
    )
    assert (out.top_logprobs[0, :-1] >= out.top_logprobs[0, 1:]).all()


def test_width_is_the_largest_asked() -> None:
    logits = dyadic_rows(5, seed=3)
    asked = [None, 0, 3, 7, 1]
    params = [P(seed=i, logprobs=n) for i, n in enumerate(asked)]
    out = gx.sample_logits(logits, params, [0] * 5, backend="torch")
    assert out.top_logprobs.shape == (5, 7) and out.top_token_ids.shape == (5, 7)
    assert out.logprobs.shape == (5,) and out.ranks.shape == (5,)
    for b, n in enumerate(asked):
        if n is not None:
            check_row(out, b, logits[b].double().numpy(), n)


def test_logprobs_zero_gives_token_logprob_and_rank_only() -> None:
    logits = dyadic_rows(4, seed=4)
    params = [P(seed=i, logprobs=0, temperature=0.0 if i == 2 else 1.0) for i in range(4)]
    out = gx.sample_logits(logits, params, [3] * 4, backend="torch")
    assert out.top_logprobs.shape == (4, 0) and out.top_token_ids.shape == (4, 0)
    assert out.top_logprobs.dtype == torch.float32 and out.top_token_ids.dtype == torch.int64
    for b in range(4):
        check_row(out, b, logits[b].double().numpy(), 0)


def test_logprobs_off_gives_none() -> None:
    out = gx.sample_logits(dyadic_rows(3, seed=5), [P(seed=1)] * 3, [0, 1, 2], backend="torch")
    assert out.logprobs is None and out.ranks is None
    assert out.top_logprobs is None and out.top_token_ids is None


def test_logprobs_agree_across_batch_compositions() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 1000, generator=g) * 4
    params = [
        P(seed=i, logprobs=5, logprobs_mode="processed" if i % 2 else "raw", temperature=0.7)
        for i in range(6)
    ]
    batch = gx.sample_logits(logits, params, [10] * 6, backend="torch")
    for b in range(6):
        alone = gx.sample_logits(logits[b : b + 1], [params[b]], [10], backend="torch")
        assert int(alone.token_ids[0]) == int(batch.token_ids[b])
        assert int(alone.ranks[0]) == int(batch.ranks[b])
        torch.testing.assert_close(alone.logprobs[0], batch.logprobs[b], rtol=1e-6, atol=0)
        torch.testing.assert_close(alone.top_logprobs[0], batch.top_logprobs[b], rtol=1e-6, atol=0)
        assert torch.equal(alone.top_token_ids[0], batch.top_token_ids[b])
    # temperature shows in processed rows only
    raw = torch.log_softmax(logits.double(), dim=-1)
    proc = torch.log_softmax(logits.double() / 0.7, dim=-1)
    for b in range(6):
        ref = proc if b % 2 else raw
        tok = int(batch.token_ids[b])
        torch.testing.assert_close(batch.logprobs[b].double(), ref[b, tok], rtol=1e-5, atol=1e-5)


def test_plus_inf_row_logprobs() -> None:
    row = torch.randn(1, V)
    row[0, [8, 31, 64]] = torch.inf
    out = gx.sample_logits(row, [P(seed=2, logprobs=4)], [0], backend="torch")
    assert int(out.token_ids[0]) in (8, 31, 64)
    np.testing.assert_allclose(float(out.logprobs[0]), -np.log(3), rtol=1e-6)
    assert int(out.ranks[0]) == 1
    assert out.top_token_ids[0, :3].tolist() == [8, 31, 64]
    assert out.top_logprobs[0, 3] == -torch.inf


def test_invalid_rows_logprob_nan_rank_zero() -> None:
    logits = dyadic_rows(3, seed=6)
    logits[1] = -torch.inf
    params = [P(seed=1, logprobs=2)] * 3
    out = gx.sample_logits(logits, params, [0, 0, 0], backend="torch")
    assert out.valid.tolist() == [True, False, True]
    assert torch.isnan(out.logprobs[1]) and int(out.ranks[1]) == 0
    for b in (0, 2):
        check_row(out, b, logits[b].double().numpy(), 2)


def test_logprobs_wider_than_the_vocabulary() -> None:
    """logprobs=20 on V=10: either a ValueError naming logprobs, or all V tokens in order
    (never a crash of another kind)."""
    logits = dyadic_rows(2, seed=7)[:, :10].contiguous()
    params = [P(seed=1, logprobs=20), P(seed=2)]
    try:
        out = gx.sample_logits(logits, params, [0, 0], backend="torch")
    except ValueError as e:
        assert "logprobs" in str(e)
        return
    vals = logits[0].double().numpy()
    assert out.top_token_ids[0, :10].tolist() == order(vals)
    lp = log_softmax64(vals)
    np.testing.assert_allclose(
        out.top_logprobs[0, :10].double().numpy(), lp[order(vals)], rtol=RTOL
    )
