"""`verify_drafts` in rejection mode on the CPU: the emitted tokens are distributed exactly
as the processed, filtered target (checked against distributions computed here
independently in float64, by chi-square at ALPHA), with one-hot drafts and with draft
probabilities, at every offset, and never leave the filtered set."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import dataclasses

import numpy as np
import pytest
import scipy.stats
import torch

import graphexec as gx
from graphexec.rng import Stream, gumbel, uniform
from tests.speculative.verify_cases import (
    ALPHA,
    METHODS,
    P,
    assert_follows,
    assert_rate,
    filtered_dist,
    rejects,
    verify,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------- 4. rejection mode is distribution-exact

SV = 12  # vocabulary of the statistical tests: enough draws per bin
N_FAST, N_SLOW = 20_000, 100_000


def stat_row(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SV, generator=g) * scale


TARGETS = {
    "top_k": (dict(temperature=0.8, top_k=6), 1),
    "top_p": (dict(temperature=1.3, top_p=0.8), 2),
    "min_p": (dict(temperature=0.9, min_p=0.08), 3),
    "plain": (dict(temperature=1.0), 4),
}


def target_case(name: str):
    """(params kwargs, logits row [SV], p [SV]) of a named target."""
    kw, seed = TARGETS[name]
    row = stat_row(seed)
    return kw, row, filtered_dist(row.numpy(), **kw)


def batch_of(kw: dict, n: int, seed0: int = 0, **extra) -> list:
    base = P(seed=0, **kw, **extra)
    return [dataclasses.replace(base, seed=seed0 + i) for i in range(n)]


def draft_choice(p: np.ndarray, which: str) -> int:
    order = np.argsort(-p, kind="stable")
    if which == "likely":
        return int(order[0])
    if which == "unlikely":
        return int(order[np.count_nonzero(p) - 1])
    return int(np.flatnonzero(p == 0)[0])  # "outside"


def one_hot_case(target: str, which: str, n: int, method: str = "rejection"):
    kw, row, p = target_case(target)
    d = draft_choice(p, which)
    logits = row.view(1, 1, SV).expand(n, 2, SV).contiguous()
    drafts = torch.full((n, 1), d)
    out = verify(logits, drafts, batch_of(kw, n, seed0=1000), [7] * n, method=method)
    return out, p, d


def check_one_hot(out, p: np.ndarray, d: int) -> None:
    n = out.token_ids.shape[0]
    assert out.valid.all()
    assert set(out.num_accepted.unique().tolist()) <= {0, 1}
    acc = out.num_accepted == 1
    # accepted rows emit the draft, rejected ones anything but it
    assert (out.token_ids[acc, 0] == d).all()
    assert (out.token_ids[~acc, 0] != d).all()
    if p[d] == 0:
        assert not acc.any()
    else:
        assert_rate(int(acc.sum()), n, float(p[d]), "acceptance of the draft")
    assert_follows(out.token_ids[:, 0].numpy(), p, "first token")


@pytest.mark.parametrize("which", ["likely", "unlikely", "outside"])
@pytest.mark.parametrize("target", ["top_k", "top_p"])
def test_rejection_one_hot_drafts_exact(target: str, which: str) -> None:
    out, p, d = one_hot_case(target, which, N_FAST)
    check_one_hot(out, p, d)
    # power: the histogram tells p apart from the unfiltered softmax
    _, row, _ = target_case(target)
    assert rejects(out.token_ids[:, 0].numpy(), filtered_dist(row.numpy(), temperature=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["likely", "unlikely", "outside"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_rejection_one_hot_drafts_exact_slow(target: str, which: str) -> None:
    if target == "plain" and which == "outside":
        pytest.skip("an unfiltered target has no token outside")
    out, p, d = one_hot_case(target, which, N_SLOW)
    check_one_hot(out, p, d)


@pytest.mark.parametrize("target", ["top_k", "top_p"])
def test_strict_acceptance_is_p_of_the_draft(target: str) -> None:
    """DESIGN.md: deterministic drafts in strict mode are accepted with probability p(d)."""
    out, p, d = one_hot_case(target, "likely", N_FAST, method="strict")
    check_one_hot(out, p, d)


def draft_dist(seed: int, outside: float = 0.3, p: np.ndarray | None = None) -> np.ndarray:
    """A draft distribution q unlike p: random weights, some tokens at 0."""
    g = np.random.default_rng(seed)
    q = g.gamma(0.7, size=SV)
    q[g.permutation(SV)[:2]] = 0.0
    if p is not None:  # put a given share of q where p is 0
        out_ids = p == 0
        if out_ids.any():
            q = np.where(out_ids, q / q[out_ids].sum() * outside, q / q[~out_ids].sum() *
                         (1 - outside))  # fmt: skip
    return q / q.sum()


def sample_from(q: np.ndarray, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    qt = torch.as_tensor(q, dtype=torch.float64)
    n = int(np.prod(shape))
    return torch.multinomial(qt, n, replacement=True, generator=g).view(shape)


def q_case(target: str, n: int, seed: int):
    kw, row, p = target_case(target)
    q = draft_dist(seed, p=p)
    drafts = sample_from(q, (n, 1), seed)
    logits = row.view(1, 1, SV).expand(n, 2, SV).contiguous()
    probs = torch.as_tensor(q, dtype=torch.float32).view(1, 1, SV).expand(n, 1, SV).contiguous()
    out = verify(logits, drafts, batch_of(kw, n, seed0=5000), [3] * n, draft_probs=probs,
                 method="rejection")  # fmt: skip
    return out, drafts, p, probs[0, 0].double().numpy()


def check_q(out, drafts, p: np.ndarray, q: np.ndarray) -> None:
    n = drafts.shape[0]
    assert out.valid.all()
    acc = out.num_accepted == 1
    assert torch.equal(out.token_ids[acc, 0], drafts[acc, 0])
    assert_rate(int(acc.sum()), n, float(np.minimum(p, q).sum()), "acceptance")
    assert_follows(out.token_ids[:, 0].numpy(), p, "first token")
    # recovered tokens follow normalise(max(0, p - q))
    r = np.maximum(p - q, 0.0)
    assert_follows(out.token_ids[~acc, 0].numpy(), r / r.sum(), "recovered token")


@pytest.mark.parametrize("target", ["top_k", "top_p", "plain"])
def test_rejection_with_draft_probs_exact(target: str) -> None:
    out, drafts, p, q = q_case(target, N_FAST, seed=1)
    check_q(out, drafts, p, q)
    assert rejects(out.token_ids[:, 0].numpy(), q)  # power: p and q are told apart


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("target", list(TARGETS))
def test_rejection_with_draft_probs_exact_slow(target: str, seed: int) -> None:
    out, drafts, p, q = q_case(target, N_SLOW, seed=seed)
    check_q(out, drafts, p, q)


def later_offset_case(K: int, penalised: bool, n: int):
    """Each offset its own logits row under top-k 7 + top-p 0.9, so its own p_j. Drafts from
    q_j (q_0 near p_0, so that most rows reach offset 1); penalised: a fixed one-hot draft
    at offset 0 that the presence / frequency penalties count at offset 1."""
    kw = dict(temperature=0.9, top_k=7, top_p=0.9)
    extra = dict(presence_penalty=0.8, frequency_penalty=0.4) if penalised else {}
    rows = torch.stack([stat_row(40 + j, scale=1.2) for j in range(K + 1)])
    ps = [filtered_dist(rows[j].numpy(), **kw) for j in range(K + 1)]
    if penalised:
        d0 = draft_choice(ps[0], "likely")
        drafts = torch.full((n, K), d0)
        if K > 1:
            drafts[:, 1:] = sample_from(draft_dist(9), (n, K - 1), seed=9)
        q = torch.zeros(n, K, SV)
        q[:, 0, d0] = 1.0
        q[:, 1:] = torch.as_tensor(draft_dist(9), dtype=torch.float32)
        x1 = rows[1].double().numpy().copy()
        x1[d0] -= extra["frequency_penalty"] + extra["presence_penalty"]
        ps[1] = filtered_dist(x1, **kw)
    else:
        qs = [0.5 * ps[0] + 0.5 / SV] + [draft_dist(20 + j) for j in range(1, K)]
        drafts = torch.cat([sample_from(qs[j], (n, 1), seed=60 + j) for j in range(K)], dim=1)
        q = torch.stack([torch.as_tensor(qj, dtype=torch.float32) for qj in qs])
        q = q.unsqueeze(0).expand(n, K, SV).contiguous()
    logits = rows.unsqueeze(0).expand(n, K + 1, SV).contiguous()
    params = batch_of(kw, n, seed0=70_000, **extra)
    out = verify(logits, drafts, params, [11] * n, draft_probs=q, method="rejection")
    return out, drafts, ps, q[0].double().numpy()


def check_later_offset(out, drafts, ps, q, K: int) -> None:
    assert out.valid.all()
    reached = out.num_accepted >= 1  # offset 0 accepted: offset 1 emits a token
    assert int(reached.sum()) > 2000
    assert (out.num_tokens[reached] >= 2).all()
    assert torch.equal(out.token_ids[reached, 0], drafts[reached, 0])
    assert_follows(out.token_ids[reached, 1].numpy(), ps[1], "offset 1 after acceptance")
    if K >= 2:
        # the acceptance rate at offset 1 given offset 0's is sum(min(p_1, q_1))
        acc1 = int((out.num_accepted[reached] >= 2).sum())
        assert_rate(acc1, int(reached.sum()), float(np.minimum(ps[1], q[1]).sum()),
                    "acceptance at offset 1")  # fmt: skip


@pytest.mark.parametrize("penalised", [False, True], ids=["plain", "penalised"])
@pytest.mark.parametrize("K", [1, 2], ids=["bonus", "drafted"])
def test_rejection_later_offset_exact(K: int, penalised: bool) -> None:
    out, drafts, ps, q = later_offset_case(K, penalised, N_FAST)
    check_later_offset(out, drafts, ps, q, K)
    # power: offset 1's histogram tells p_1 apart from p_0
    reached = out.num_accepted >= 1
    assert rejects(out.token_ids[reached, 1].numpy(), ps[0])


@pytest.mark.slow
@pytest.mark.parametrize("penalised", [False, True], ids=["plain", "penalised"])
@pytest.mark.parametrize("K", [2, 3])
def test_rejection_later_offsets_exact_slow(K: int, penalised: bool) -> None:
    out, drafts, ps, q = later_offset_case(K, penalised, N_SLOW)
    check_later_offset(out, drafts, ps, q, K)
    if not penalised:  # the bonus after K accepted drafts follows p_K
        full = out.num_accepted == K
        assert_follows(out.token_ids[full, K].numpy(), ps[K], "bonus token")


def test_rejection_coins_of_successive_offsets_are_independent() -> None:
    """The same draft at two offsets of one row: each offset has its own coin (keyed on
    pos + j), so both are accepted with probability a**2, not a."""
    n, K = N_FAST, 2
    kw, row, p = target_case("top_k")
    d = int(np.argmin(np.abs(p - 0.5)))
    a = float(p[d])
    assert 0.2 < a < 0.8
    logits = row.view(1, 1, SV).expand(n, K + 1, SV).contiguous()
    drafts = torch.full((n, K), d)
    out = verify(logits, drafts, batch_of(kw, n, seed0=9000), [0] * n, method="rejection")
    counts = np.bincount(out.num_accepted.numpy(), minlength=K + 1)
    expected = np.array([1 - a, a * (1 - a), a * a]) * n
    pval = scipy.stats.chisquare(counts, expected).pvalue
    assert pval > ALPHA, (counts, expected)


def rejection_by_definition(logits, drafts, q, params, positions, ps):
    """reference.py's definition, row by row, from `graphexec.rng` and the distributions
    ps [T][V] computed here: ([n, T] tokens, [n] bool rows whose every decision lies at
    least 1e-5 from its threshold, the ones compared)."""
    n, K = drafts.shape
    V = logits.shape[2]
    seed = torch.tensor([p.seed for p in params])
    pos = torch.as_tensor(positions)
    bonus = gx.sample_logits(logits[:, K], params, pos + K, backend="torch").token_ids
    tokens = torch.full((n, K + 1), -1)
    clear = torch.ones(n, dtype=torch.bool)
    done = torch.zeros(n, dtype=torch.bool)
    ids = torch.arange(V)
    for j in range(K):
        pj = torch.as_tensor(ps[j])
        d = drafts[:, j]
        u = uniform(seed, pos + j, d, Stream.SPEC_ACCEPT).double()
        qd, pd = q[:, j].double().gather(1, d.view(-1, 1)).squeeze(1), pj[d]
        acc = u * qd < pd
        r = (pj.unsqueeze(0) - q[:, j].double()).clamp(min=0)
        g = gumbel(seed.view(-1, 1), (pos + j).view(-1, 1), ids.view(1, -1), Stream.SPEC_RECOVER)
        score = torch.where(r > 0, torch.log(r) + g.double(), -torch.inf)
        top2 = score.topk(2, dim=1).values
        rec = score.argmax(dim=1)
        live = ~done
        clear &= done | ((u * qd - pd).abs() > 1e-5)
        clear &= done | acc | (top2[:, 0] - top2[:, 1] > 1e-5)
        tokens[live, j] = torch.where(acc, d, rec)[live]
        done |= ~acc
    tokens[~done, K] = bonus[~done]
    return tokens, clear


def test_rejection_follows_its_definition() -> None:
    """Each row's decisions are the documented ones: accept d iff u * q(d) < p(d) with u the
    SPEC_ACCEPT coin of (seed, pos + j, d); recover the argmax of log r + SPEC_RECOVER
    Gumbel noise over r = max(0, p - q) > 0; the bonus is the ordinary token at pos + K."""
    n, K = 4000, 2
    kw = dict(temperature=0.9, top_k=7)
    rows = torch.stack([stat_row(80 + j, scale=1.2) for j in range(K + 1)])
    ps = [filtered_dist(rows[j].numpy(), **kw) for j in range(K + 1)]
    qs = [0.5 * ps[0] + 0.5 / SV, draft_dist(81)]
    drafts = torch.cat([sample_from(qs[j], (n, 1), seed=82 + j) for j in range(K)], dim=1)
    q = torch.stack([torch.as_tensor(qj, dtype=torch.float32) for qj in qs])
    q = q.unsqueeze(0).expand(n, K, SV).contiguous()
    logits = rows.unsqueeze(0).expand(n, K + 1, SV).contiguous()
    params = batch_of(kw, n, seed0=123)
    positions = torch.arange(n) % 97 * 1000
    out = verify(logits, drafts, params, positions, draft_probs=q, method="rejection")
    want, clear = rejection_by_definition(logits, drafts, q, params, positions, ps)
    assert clear.float().mean() > 0.99
    assert torch.equal(out.token_ids[clear], want[clear])
    assert len(set(out.num_accepted.tolist())) == K + 1


def test_rejection_logprobs_are_the_emitted_tokens() -> None:
    """Rejection mode may emit a token the ordinary draw did not: its logprob, rank and the
    top-N are those of the emitted token (raw mode: log_softmax of the logits)."""
    V, K, n = 40, 3, 64
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(n, K + 1, V, generator=g) * 1.5
    params = [P(seed=i, temperature=1.1, top_k=12, logprobs=3) for i in range(n)]
    drafts = torch.randint(0, V, (n, K), generator=g)
    out = verify(logits, drafts, params, torch.arange(n), method="rejection")
    ordinary = out.sampled.token_ids.view(n, K + 1)
    emitted = out.token_ids >= 0
    assert (out.token_ids[emitted] != ordinary[emitted]).any()  # recovered tokens occur
    lsm = torch.log_softmax(logits.double(), dim=2)
    tok = out.token_ids.clamp(min=0)
    want = lsm.gather(2, tok.unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(out.logprobs[emitted].double(), want[emitted], rtol=0, atol=1e-5)
    rank = (logits > logits.gather(2, tok.unsqueeze(2))).sum(dim=2) + 1
    assert torch.equal(out.ranks[emitted], rank[emitted])
    top = torch.sort(logits, dim=2, descending=True, stable=True).indices[..., :3]
    assert torch.equal(out.top_token_ids[emitted], top[emitted])


@pytest.mark.parametrize("method", METHODS)
def test_offsets_past_the_position_range_are_refused(method: str) -> None:
    logits = torch.randn(1, 3, 30)
    with pytest.raises(ValueError, match="positions"):
        verify(logits, torch.tensor([[1, 2]]), [P(seed=1)], [2**32 - 2], method=method)


# -------------------------------------------------- 5. filtered targets stay in their set


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=8, top_p=0.6, min_p=0.2)],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_rejection_never_leaves_the_filtered_set(kw: dict) -> None:
    V, K, n = 64, 3, 3000
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(K + 1, V, generator=g) * 0.8
    kept = torch.stack([torch.as_tensor(filtered_dist(rows[j].numpy(), **kw) > 0)
                        for j in range(K + 1)])  # fmt: skip
    assert (kept.sum(dim=1) < V // 2).all()
    logits = rows.unsqueeze(0).expand(n, K + 1, V).contiguous()
    params = batch_of(kw, n, seed0=300)
    positions = torch.arange(n) % 50
    # adversarial drafts: outside the kept set, except where a coin lets a kept one through
    outside = [torch.nonzero(~kept[j]).flatten() for j in range(K)]
    inside = [torch.nonzero(kept[j]).flatten() for j in range(K)]
    pick = lambda ids: ids[torch.randint(0, len(ids), (n,), generator=g)]
    drafts = torch.stack([torch.where(torch.rand(n, generator=g) < 0.8, pick(outside[j]),
                                      pick(inside[j])) for j in range(K)], dim=1)  # fmt: skip
    # draft_probs with 99% of their mass outside the kept set
    q = torch.rand(n, K, V, generator=g) + 1e-3
    mass_in = (q * kept[:K]).sum(dim=2, keepdim=True)
    mass_out = (q * ~kept[:K]).sum(dim=2, keepdim=True)
    q = torch.where(kept[:K], 0.01 * q / mass_in, 0.99 * q / mass_out)
    for draft_probs in (None, q):
        out = verify(logits, drafts, params, positions, draft_probs=draft_probs,
                     method="rejection")  # fmt: skip
        assert out.valid.all()
        j = torch.arange(K + 1).unsqueeze(0)
        emitted = j < out.num_tokens.unsqueeze(1)
        tok = out.token_ids.clamp(min=0)
        in_set = kept.unsqueeze(0).expand(n, K + 1, V).gather(2, tok.unsqueeze(2)).squeeze(2)
        assert in_set[emitted].all()
        # the runs do get past offset 0 (kept drafts accepted) and stop at outside ones
        assert (out.num_accepted > 0).any()
        first_out = (~kept[:K].gather(1, drafts.T)).T  # [n, K]: draft outside its set
        stop = torch.where(first_out.any(dim=1), first_out.int().argmax(dim=1), K)
        assert (out.num_accepted <= stop).all()
