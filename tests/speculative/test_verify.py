"""`verify_drafts` (DESIGN.md, "Speculative decoding") on the CPU.

strict: offset j's token is exactly the token `sample_logits` draws at position pos + j
with the drafts before j counted for the penalties, so drafts are accepted while they
equal the ordinary sequence. rejection: the emitted tokens are distributed exactly as the
processed, filtered target (checked against distributions computed here independently in
float64, by chi-square at ALPHA), and never leave the filtered set. Both: greedy rows
accept exactly the argmax drafts, rows are independent of batch order and of bad
neighbours, bad arguments raise a ValueError naming the argument, and the Triton backend
(interpreter) gives the torch backend's tokens."""

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
from graphexec.sampling.pipeline import sample_step
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.speculative import VerifyOutput, verify_drafts

P = gx.SamplingParams
ALPHA = 1e-6
METHODS = ("strict", "rejection")
NINF, NAN = float("-inf"), float("nan")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ----------------------------------------------------------------------------- helpers


def bits(allowed: torch.Tensor) -> torch.Tensor:
    """[..., V] bool -> [..., ceil(V/32)] int32 xgrammar bitmask words."""
    *lead, V = allowed.shape
    W = (V + 31) // 32
    padded = torch.zeros((*lead, W * 32), dtype=torch.int64)
    padded[..., :V] = allowed.to(torch.int64)
    words = (padded.view(*lead, W, 32) << torch.arange(32)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def sequential(logits, params, positions, token_counts=None, prompt_mask=None, allowed=None,
               backend="torch"):  # fmt: skip
    """Ordinary sampling of the K+1 offsets one after the other: offset j at positions + j,
    with the tokens drawn before j counted. Returns ([B, T] tokens, T `SamplerOutput`s)."""
    B, T, V = logits.shape
    counts = torch.zeros((B, V), dtype=torch.int32) if token_counts is None else token_counts
    counts = counts.clone()
    pos = torch.as_tensor(positions, dtype=torch.int64)
    outs = []
    for j in range(T):
        bm = None if allowed is None else bits(allowed[:, j])
        o = gx.sample_logits(logits[:, j], params, pos + j, token_counts=counts,
                             prompt_mask=prompt_mask, bitmask=bm, backend=backend)  # fmt: skip
        outs.append(o)
        ok = o.token_ids >= 0
        counts[ok.nonzero().flatten(), o.token_ids[ok]] += 1
    return torch.stack([o.token_ids for o in outs], dim=1), outs


def filtered_dist(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=1e-3) -> np.ndarray:
    """float64 probabilities of the processed row x under DESIGN.md's filters: order by
    (value desc, id asc); top-k; top-p on the top-k mass (keep j iff the mass before j is
    below p times the total); min-p relative to the max. Asserts every decision lies at
    least `margin` (relative) from its threshold, so float32 rounding cannot flip it."""
    x = np.asarray(x, dtype=np.float64)
    V = x.shape[0]
    order = np.lexsort((np.arange(V), -x))
    y = (x - x.max()) / temperature
    w = np.exp(y)
    k = top_k if 0 < top_k < V else V
    pref = order[:k]
    if k < V:
        assert x[order[k - 1]] - x[order[k]] > margin
    if top_p < 1.0:
        mass = w[pref]
        before = np.cumsum(mass) - mass
        cut = top_p * mass.sum()
        assert np.abs(before - cut).min() > margin * mass.sum()
        pref = pref[before < cut]
    keep = np.zeros(V, dtype=bool)
    keep[pref] = True
    if min_p > 0.0:
        fin = np.isfinite(y)
        assert np.abs(y[fin] - np.log(min_p)).min() > margin
        keep &= y >= np.log(min_p)
    p = np.where(keep, w, 0.0)
    return p / p.sum()


def assert_follows(tokens, p: np.ndarray, what: str = "tokens") -> float:
    """Chi-square of the token histogram against p (no token where p is 0); the p-value."""
    tokens = np.asarray(tokens)
    assert (tokens >= 0).all()
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"{what}: drawn outside the support {np.flatnonzero(p)}"
    sup = p > 0
    expected = p[sup] * len(tokens)
    assert expected.min() >= 5, "too few samples per bin for a chi-square"
    pval = scipy.stats.chisquare(counts[sup], expected).pvalue
    assert pval > ALPHA, f"{what}: chi-square p = {pval:.3g}\n{counts}\n{expected.round(1)}"
    return pval


def rejects(tokens, p: np.ndarray) -> bool:
    """Whether the chi-square rejects p for these tokens (the power check of a test)."""
    counts = np.bincount(np.asarray(tokens), minlength=len(p))
    if counts[p == 0].sum():
        return True
    sup = p > 0
    return scipy.stats.chisquare(counts[sup], p[sup] * len(tokens)).pvalue < ALPHA


def assert_rate(successes: int, n: int, rate: float, what: str) -> None:
    pval = scipy.stats.binomtest(int(successes), int(n), rate).pvalue
    assert pval > ALPHA, f"{what}: {successes}/{n} vs rate {rate:.5f}, p = {pval:.3g}"


def verify(logits, drafts, params, positions, **kw) -> VerifyOutput:
    kw.setdefault("backend", "torch")
    return verify_drafts(logits, drafts, params, positions, **kw)


def assert_same_output(a, b) -> None:
    """Two VerifyOutputs equal token for token (logprobs of emitted tokens close)."""
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.num_tokens, b.num_tokens)
    assert torch.equal(a.valid, b.valid)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        emitted = a.token_ids >= 0
        torch.testing.assert_close(a.logprobs[emitted], b.logprobs[emitted], rtol=0, atol=1e-6)
        assert torch.equal(a.ranks[emitted], b.ranks[emitted])
        assert torch.equal(a.top_token_ids[emitted], b.top_token_ids[emitted])
        torch.testing.assert_close(a.top_logprobs[emitted], b.top_logprobs[emitted], rtol=0,
                                   atol=1e-6)  # fmt: skip


# ------------------------------------------------------------ a mixed batch (tests 1, 7, 10)

MIXED = [
    P(temperature=0.0, seed=1, logprobs=2),
    P(top_k=10, temperature=0.8, seed=2),
    P(top_p=0.9, seed=3, logprobs=4, logprobs_mode="processed"),
    P(min_p=0.1, temperature=1.2, seed=4),
    P(top_k=20, top_p=0.8, seed=5),
    P(
        temperature=0.9,
        presence_penalty=1.2,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
        seed=6,
        logprobs=3,
        logprobs_mode="processed",
    ),
    P(temperature=0.7, logit_bias={3: 2.5, 40: -1.0, 77: 4.0}, seed=7, logprobs=0),
    P(temperature=0.0, frequency_penalty=2.0, seed=8, logprobs=1, logprobs_mode="processed"),
    P(seed=2**62 + 9),
    P(
        top_k=15,
        top_p=0.9,
        min_p=0.02,
        presence_penalty=-0.5,
        frequency_penalty=0.9,
        logit_bias={5: 1.5},
        temperature=0.6,
        seed=10,
    ),
    P(repetition_penalty=1.8, temperature=0.5, seed=11, logprobs=5),
    P(top_k=3, presence_penalty=2.0, seed=12),
]


def mixed_inputs(B: int, K: int, V: int, seed: int):
    """(logits [B, K+1, V], positions [B], token_counts, prompt_mask): each row's offsets
    share most of their logits, so the same tokens come back and the penalties bite."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, 1, V, generator=g) * 1.5
    logits = (base + 0.3 * torch.randn(B, K + 1, V, generator=g)).contiguous()
    positions = torch.randint(0, 2**31, (B,), generator=g)
    positions[0] = 0
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    counts[torch.rand(B, V, generator=g) < 0.9] = 0
    prompt = torch.rand(B, V, generator=g) < 0.1
    return logits, positions, counts, prompt


# -------------------------------------------------------- 1. strict equals sequential sampling


@pytest.mark.parametrize("K", [1, 4])
def test_strict_equals_sequential_sampling(K: int) -> None:
    V = 150
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=K)
    seq, outs = sequential(logits, params, positions, counts, prompt)
    assert (seq >= 0).all()
    # the control: without the earlier tokens counted, some penalised row draws otherwise
    if K > 1:
        uncounted = torch.stack(
            [gx.sample_logits(logits[:, j], params, positions + j, token_counts=counts,
                              prompt_mask=prompt, backend="torch").token_ids
             for j in range(K + 1)], dim=1)  # fmt: skip
        assert not torch.equal(uncounted, seq)

    # every draft is the ordinary token: all accepted, the bonus is the ordinary one
    out = verify(logits, seq[:, :K].clone(), params, positions, token_counts=counts,
                 prompt_mask=prompt)  # fmt: skip
    assert out.valid.all()
    assert out.num_accepted.tolist() == [K] * B
    assert out.num_tokens.tolist() == [K + 1] * B
    assert torch.equal(out.token_ids, seq)
    asked = [b for b, p in enumerate(params) if p.logprobs is not None]
    for j in range(K + 1):
        o = outs[j]
        torch.testing.assert_close(out.logprobs[asked, j], o.logprobs[asked], rtol=0, atol=1e-6)
        assert torch.equal(out.ranks[asked, j], o.ranks[asked])
        for b in asked:
            n = params[b].logprobs
            assert torch.equal(out.top_token_ids[b, j, :n], o.top_token_ids[b, :n])
            torch.testing.assert_close(out.top_logprobs[b, j, :n], o.top_logprobs[b, :n],
                                       rtol=0, atol=1e-6)  # fmt: skip

    # a wrong draft at offset c_b: accepted up to c_b, the ordinary token there, -1 after
    drafts = seq[:, :K].clone()
    cut = torch.arange(B) % K
    wrong = (seq[torch.arange(B), cut] + 1 + torch.arange(B)) % V
    drafts[torch.arange(B), cut] = wrong
    drafts[B - 1, cut[B - 1] :] = -1  # a row with fewer drafts: the bonus at its first pad
    out = verify(logits, drafts, params, positions, token_counts=counts, prompt_mask=prompt)
    assert out.valid.all()
    assert out.num_accepted.tolist() == cut.tolist()
    assert out.num_tokens.tolist() == (cut + 1).tolist()
    j = torch.arange(K + 1).unsqueeze(0)
    assert torch.equal(out.token_ids, torch.where(j <= cut.unsqueeze(1), seq, -1))
    for b in asked:
        for jj in range(int(cut[b]) + 1):
            o = outs[jj]
            assert abs(float(out.logprobs[b, jj]) - float(o.logprobs[b])) <= 1e-6
            assert int(out.ranks[b, jj]) == int(o.ranks[b])


def test_strict_with_no_token_counts_counts_the_drafts() -> None:
    """token_counts None with penalised rows: the drafts before an offset still count."""
    V, K = 60, 3
    params = [P(temperature=0.0, frequency_penalty=2.0, seed=1),
              P(presence_penalty=2.0, temperature=0.3, seed=2), P(seed=3)]  # fmt: skip
    B = len(params)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, 1, V, generator=g) * 0.5).expand(B, K + 1, V).contiguous()
    seq, _ = sequential(logits, params, [0, 10, 20])
    # the greedy row's penalty moves the argmax off the offset-0 token
    assert seq[0, 1] != seq[0, 0]
    out = verify(logits, seq[:, :K].clone(), params, [0, 10, 20])
    assert torch.equal(out.token_ids, seq)
    assert out.num_accepted.tolist() == [K] * B


# ------------------------------------------------------------- 2. per-offset grammar bitmask


@pytest.mark.parametrize("method", METHODS)
def test_per_offset_bitmask(method: str) -> None:
    V, K = 100, 3
    params = [P(temperature=0.0, seed=1), P(top_k=5, seed=2), P(top_p=0.7, seed=3),
              P(seed=4, temperature=1.5), P(min_p=0.2, seed=5),
              P(presence_penalty=1.5, frequency_penalty=1.0, seed=6, temperature=0.8),
              P(top_k=2, temperature=0.0, logit_bias={9: 5.0}, seed=7)]  # fmt: skip
    B = len(params)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    allowed = torch.rand(B, K + 1, V, generator=g) < 0.25
    allowed[..., 9] |= torch.rand(B, K + 1, generator=g) < 0.5
    # each offset's best token is disallowed there: the mask must take effect
    best = logits.argmax(dim=2)
    allowed.scatter_(2, best.unsqueeze(2), False)
    positions = torch.arange(B) * 5
    seq, _ = sequential(logits, params, positions, allowed=allowed)
    assert torch.gather(allowed, 2, seq.unsqueeze(2)).all()
    unmasked, _ = sequential(logits, params, positions)
    assert not torch.equal(unmasked, seq)

    bm = bits(allowed)
    if method == "strict":
        out = verify(logits, seq[:, :K].clone(), params, positions, bitmask=bm)
        assert torch.equal(out.token_ids, seq)
        assert out.num_accepted.tolist() == [K] * B
    # drafts anywhere, mostly disallowed: emitted tokens lie in their offset's allowed set
    # (rejection: one-hot drafts and draft_probs spread over the whole vocabulary)
    for trial in range(4):
        drafts = seq[:, :K].clone()
        noise = torch.randint(0, V, (B, K), generator=g)
        drafts = torch.where(torch.rand(B, K, generator=g) < 0.5, noise, drafts)
        q = None
        if method == "rejection" and trial % 2:
            q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=2)
        out = verify(logits, drafts, params, positions + trial * 100, bitmask=bm, draft_probs=q,
                     method=method)  # fmt: skip
        assert out.valid.all()
        n = out.num_tokens
        j = torch.arange(K + 1).unsqueeze(0)
        emitted = j < n.unsqueeze(1)
        tok = out.token_ids.clamp(min=0)
        assert torch.gather(allowed, 2, tok.unsqueeze(2)).squeeze(2)[emitted].all()
        assert (out.token_ids[~emitted] == -1).all()
        if method == "strict":
            # the emitted tokens are the sequential ones with that offset's mask (the
            # drafts before the stop are the sequence's, so the counts agree)
            pos_t = positions + trial * 100
            ref, _ = sequential(logits, params, pos_t, allowed=allowed)
            assert torch.equal(out.token_ids, torch.where(emitted, ref, -1))
            lead = torch.cumprod((drafts == ref[:, :K]).to(torch.int64), dim=1).sum(dim=1)
            assert out.num_accepted.tolist() == lead.tolist()


# ---------------------------------------------------------------------- 3. zero drafts


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("K", [0, 1, 3])
def test_zero_drafts_equal_ordinary_sampling(method: str, K: int) -> None:
    V = 120
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=30 + K)
    drafts = torch.full((B, K), -1, dtype=torch.int64)
    q = torch.full((B, K, V), 1.0 / V) if method == "rejection" else None
    out = verify(logits, drafts, params, positions, token_counts=counts, prompt_mask=prompt,
                 draft_probs=q, method=method)  # fmt: skip
    ref = gx.sample_logits(logits[:, 0], params, positions, token_counts=counts,
                           prompt_mask=prompt, backend="torch")  # fmt: skip
    assert out.valid.all()
    assert out.num_tokens.tolist() == [1] * B
    assert out.num_accepted.tolist() == [0] * B
    assert torch.equal(out.token_ids[:, 0], ref.token_ids)
    assert (out.token_ids[:, 1:] == -1).all()
    asked = [b for b, p in enumerate(params) if p.logprobs is not None]
    torch.testing.assert_close(out.logprobs[asked, 0], ref.logprobs[asked], rtol=0, atol=1e-6)
    assert torch.equal(out.ranks[asked, 0], ref.ranks[asked])
    assert torch.equal(out.top_token_ids[asked, 0], ref.top_token_ids[asked])


def test_empty_batch() -> None:
    for method in METHODS:
        out = verify(torch.zeros(0, 3, 10), torch.zeros(0, 2, dtype=torch.int64), [], [],
                     method=method)  # fmt: skip
        assert out.token_ids.shape == (0, 3) and out.num_tokens.shape == (0,)


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


# ------------------------------------------------------------------------ 6. greedy rows


@pytest.mark.parametrize("method", METHODS)
def test_greedy_accepts_exactly_the_argmax(method: str) -> None:
    V, K, B = 50, 4, 64
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(B, K + 1, V, generator=g)
    # ties at the max: the first id is the argmax
    logits[::3, :, 20] = logits[::3].amax(dim=2) + 1.0
    logits[::3, :, 7] = logits[::3, :, 20]
    logits[1::5, :, :] = torch.round(logits[1::5] * 2) / 2  # many ties
    arg = torch.as_tensor(np.array([[np.flatnonzero(r == r.max())[0] for r in rows]
                                    for rows in logits.numpy()]))  # fmt: skip
    assert (arg[::3] == 7).all()
    filters = [dict(), dict(top_k=1), dict(top_p=0.1, min_p=0.9), dict(logprobs=2)]
    params = [P(temperature=0.0, seed=b, **filters[b % 4]) for b in range(B)]
    hit = torch.rand(B, K, generator=g) < 0.7
    other = (arg[:, :K] + torch.randint(1, V, (B, K), generator=g)) % V
    drafts = torch.where(hit, arg[:, :K], other)
    drafts[B - 1] = -1
    drafts[B - 2, 2:] = -1
    lead = torch.cumprod(hit.to(torch.int64), dim=1).sum(dim=1)
    lead[B - 1] = 0
    lead[B - 2] = lead[B - 2].clamp(max=2)
    assert len(set(lead.tolist())) == K + 1  # every run length occurs
    qs = [None]
    if method == "rejection":
        qs.append(torch.softmax(torch.randn(B, K, V, generator=g) * 3, dim=2))
    for q in qs:
        out = verify(logits, drafts, params, torch.arange(B) * 3, draft_probs=q, method=method)
        assert out.num_accepted.tolist() == lead.tolist()
        assert out.num_tokens.tolist() == (lead + 1).tolist()
        j = torch.arange(K + 1).unsqueeze(0)
        # accepted drafts are argmaxes; the token after them is the argmax there
        assert torch.equal(out.token_ids, torch.where(j <= lead.unsqueeze(1), arg, -1))


# --------------------------------------------------------------- 7. batch-order independence


@pytest.mark.parametrize("method", METHODS)
def test_permuting_rows_permutes_outputs(method: str) -> None:
    V, K = 100, 3
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=77)
    g = torch.Generator().manual_seed(78)
    allowed = torch.rand(B, K + 1, V, generator=g) < 0.6
    allowed[:, :, :5] = True
    seq, _ = sequential(logits, params, positions, counts, prompt, allowed)
    noise = torch.randint(0, V, (B, K), generator=g)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, seq[:, :K], noise)
    drafts[2, 1:] = -1
    q = torch.softmax(torch.randn(B, K, V, generator=g), dim=2) if method == "rejection" else None
    kw = lambda perm: dict(
        token_counts=counts[perm], prompt_mask=prompt[perm], bitmask=bits(allowed[perm]),
        draft_probs=None if q is None else q[perm], method=method)  # fmt: skip
    ident = torch.arange(B)
    out = verify(logits, drafts, params, positions, **kw(ident))
    assert len(set(out.num_accepted.tolist())) >= 2
    for s in range(3):
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(s))
        got = verify(logits[perm], drafts[perm], [params[i] for i in perm], positions[perm],
                     **kw(perm))  # fmt: skip
        back = torch.argsort(perm)
        for name in ("token_ids", "num_accepted", "num_tokens", "valid"):
            assert torch.equal(getattr(got, name)[back], getattr(out, name)), name
        em = out.token_ids >= 0
        torch.testing.assert_close(got.logprobs[back][em], out.logprobs[em], rtol=0, atol=1e-6)
        assert torch.equal(got.top_token_ids[back][em], out.top_token_ids[em])
    # a sub-batch: each row alone equals its row in the batch
    for b in (0, 5, 9):
        sub = torch.tensor([b])
        alone = verify(logits[sub], drafts[sub], [params[b]], positions[sub], **kw(sub))
        assert torch.equal(alone.token_ids[0], out.token_ids[b])


# ----------------------------------------------------------------------- 8. bad rows isolated


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", ["nan", "-inf"])
def test_bad_row_at_offset_0_is_isolated(method: str, bad: str) -> None:
    V, K = 80, 3
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=90)
    seq, _ = sequential(logits, params, positions, counts, prompt)
    drafts = seq[:, :K].clone()
    drafts[::2, 1] = (drafts[::2, 1] + 1) % V
    g = torch.Generator().manual_seed(91)
    q = torch.softmax(torch.randn(B, K, V, generator=g), dim=2) if method == "rejection" else None
    kw = dict(method=method)
    good = verify(logits, drafts, params, positions, token_counts=counts, prompt_mask=prompt,
                  draft_probs=q, **kw)  # fmt: skip
    assert good.valid.all()
    for b in (0, 5, B - 1):
        bad_logits = logits.clone()
        bad_logits[b, 0] = NAN if bad == "nan" else NINF
        out = verify(bad_logits, drafts, params, positions, token_counts=counts,
                     prompt_mask=prompt, draft_probs=q, **kw)  # fmt: skip
        assert not bool(out.valid[b])
        assert int(out.num_tokens[b]) == 0 and int(out.num_accepted[b]) == 0
        assert (out.token_ids[b] == -1).all()
        # the other rows: as in the good batch, and as in a batch without row b
        others = torch.arange(B) != b
        keep = others.nonzero().flatten()
        without = verify(logits[keep], drafts[keep], [params[i] for i in keep], positions[keep],
                         token_counts=counts[keep], prompt_mask=prompt[keep],
                         draft_probs=None if q is None else q[keep], **kw)  # fmt: skip
        for name in ("token_ids", "num_accepted", "num_tokens", "valid"):
            assert torch.equal(getattr(out, name)[others], getattr(good, name)[others]), name
            assert torch.equal(getattr(out, name)[others], getattr(without, name)), name
        em = good.token_ids[others] >= 0
        torch.testing.assert_close(out.logprobs[others][em], good.logprobs[others][em], rtol=0,
                                   atol=1e-6)  # fmt: skip
        torch.testing.assert_close(out.logprobs[others][em], without.logprobs[em], rtol=0,
                                   atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_nothing_samplable_at_a_later_offset_ends_the_run(method: str) -> None:
    """Offset 2 all -inf: the run is the accepted drafts up to offset 1, no token after."""
    V, K = 40, 3
    g = torch.Generator().manual_seed(5)
    params = [P(temperature=0.0, seed=1), P(temperature=0.7, top_k=5, seed=2),
              P(seed=3, logprobs=1), P(temperature=0.0, seed=4)]  # fmt: skip
    B = len(params)
    logits = torch.randn(B, K + 1, V, generator=g)
    # peaked at the drafts: p(draft) is 1 in float64, so rejection accepts them surely
    drafts = torch.randint(0, V, (B, K), generator=g)
    logits.scatter_(2, torch.cat([drafts, drafts[:, :1]], 1).unsqueeze(2), 60.0)
    logits[:, 2] = NINF
    logits[1, 2, 7] = NAN
    drafts[3, 2] = -1  # no draft at the empty offset: the bonus is missing too
    drafts[0, 1] = (drafts[0, 1] + 1) % V  # a rejection before the empty offset
    out = verify(logits, drafts, params, [0, 1, 2, 3], method=method)
    assert out.valid.all()
    assert out.num_tokens.tolist() == [2, 2, 2, 2]
    assert out.num_accepted.tolist() == [1, 1, 1, 1]  # num_tokens - 1 (VerifyOutput)
    assert torch.equal(out.token_ids[1:, :2], drafts[1:, :2])
    assert int(out.token_ids[0, 0]) == int(drafts[0, 0])
    assert int(out.token_ids[0, 1]) == int(logits[0, 1].argmax())
    assert (out.token_ids[:, 2:] == -1).all()
    assert torch.isfinite(out.logprobs[2, :2]).all()


# ---------------------------------------------------------------------- 9. invalid arguments


def _good():
    V, K, B = 40, 2, 3
    return dict(
        target_logits=torch.randn(B, K + 1, V),
        draft_token_ids=torch.tensor([[1, 2], [3, -1], [-1, -1]]),
        params=[P(seed=i) for i in range(B)],
        positions=[0, 1, 2],
    )


def _with(**changes):
    kw = _good()
    kw.update(changes)
    return kw


INVALID = {
    "draft below -1": (_with(draft_token_ids=torch.tensor([[1, -2], [0, 0], [0, 0]])),
                       "draft_token_ids"),
    "draft >= V": (_with(draft_token_ids=torch.tensor([[1, 40], [0, 0], [0, 0]])),
                   "draft_token_ids"),
    "pad then draft": (_with(draft_token_ids=torch.tensor([[-1, 3], [0, 0], [0, 0]])),
                       "draft_token_ids"),
    "drafts wrong shape": (_with(draft_token_ids=torch.zeros(3, 3, dtype=torch.int64)),
                           "draft_token_ids"),
    "drafts 1-D": (_with(draft_token_ids=torch.zeros(3, dtype=torch.int64)), "draft_token_ids"),
    "drafts float": (_with(draft_token_ids=torch.zeros(3, 2)), "draft_token_ids"),
    "drafts a list": (_with(draft_token_ids=[[1, 2], [3, -1], [-1, -1]]), "draft_token_ids"),
    "logits 2-D": (_with(target_logits=torch.randn(3, 40)), "target_logits"),
    "logits 4-D": (_with(target_logits=torch.randn(3, 3, 40, 1)), "target_logits"),
    "logits int": (_with(target_logits=torch.zeros(3, 3, 40, dtype=torch.int64)),
                   "target_logits"),
    "bitmask per row": (_with(bitmask=torch.zeros(3, 2, dtype=torch.int32)), "bitmask"),
    "bitmask too few offsets": (_with(bitmask=torch.zeros(3, 2, 2, dtype=torch.int32)),
                                "bitmask"),
    "bitmask int64": (_with(bitmask=torch.zeros(3, 3, 2, dtype=torch.int64)), "bitmask"),
    "draft_probs wrong shape": (_with(draft_probs=torch.ones(3, 3, 40) / 40), "draft_probs"),
    "draft_probs wrong V": (_with(draft_probs=torch.ones(3, 2, 41) / 41), "draft_probs"),
    "draft_probs int": (_with(draft_probs=torch.ones(3, 2, 40, dtype=torch.int64)),
                        "draft_probs"),
    "unknown method": (_with(method="typical"), "method"),
    "params too few": (_with(params=[P(seed=0)] * 2), "params"),
    "params too many": (_with(params=[P(seed=0)] * 4), "params"),
    "params without seed": (_with(params=[P(seed=0), P(), P(seed=1)]), r"params\[1\]"),
    "positions wrong length": (_with(positions=[0, 1]), "positions"),
    "token_counts wrong shape": (_with(token_counts=torch.zeros(3, 39, dtype=torch.int32)),
                                 "token_counts"),
    "backend flashinfer": (_with(backend="flashinfer"), "backend 'flashinfer'"),
    "backend unknown": (_with(backend="cuda"), "backend"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_arguments_raise_value_error(name: str) -> None:
    kw, match = INVALID[name]
    kw.setdefault("backend", "torch")
    with pytest.raises(ValueError, match=match):
        verify_drafts(**kw)


def test_valid_arguments_pass() -> None:
    """The control for the invalid cases: the unchanged arguments verify."""
    for method in METHODS:
        out = verify_drafts(**_good(), backend="torch", method=method)
        assert out.valid.all() and out.num_tokens.min() >= 1


# ---------------------------------------------------------------- 10. Triton (interpreter)


@pytest.mark.parametrize("method", METHODS)
def test_triton_equals_torch(method: str) -> None:
    V, K = 130, 2  # two draw blocks
    params = MIXED
    B = len(params)
    logits, positions, counts, prompt = mixed_inputs(B, K, V, seed=101)
    seq, _ = sequential(logits, params, positions, counts, prompt)
    drafts = seq[:, :K].clone()
    drafts[1::3, 1] = (drafts[1::3, 1] + 3) % V
    drafts[2, 1] = -1
    g = torch.Generator().manual_seed(102)
    q = torch.softmax(torch.randn(B, K, V, generator=g), dim=2) if method == "rejection" else None
    kw = dict(token_counts=counts, prompt_mask=prompt, draft_probs=q, method=method)
    ref = verify(logits, drafts, params, positions, backend="torch", **kw)
    tri = verify(logits, drafts, params, positions, backend="triton", **kw)
    assert_same_output(tri, ref)
    assert torch.equal(tri.sampled.token_ids, ref.sampled.token_ids)
    if method == "strict":
        assert int(ref.num_accepted.sum()) > B  # the drafts do get accepted
        # and the tokens are the ordinary ones at every emitted offset
        j = torch.arange(K + 1).unsqueeze(0)
        assert torch.equal(ref.token_ids, torch.where(j < ref.num_tokens.unsqueeze(1), seq, -1))


def test_triton_single_row_equals_torch() -> None:
    """B = 1: the flattened offsets' slot ids and positions must be real rows for the
    kernels (an expanded view would read out of bounds)."""
    V, K = 130, 3
    for b in (5, 9, 11):  # penalised and biased rows
        logits, positions, counts, prompt = mixed_inputs(len(MIXED), K, V, seed=103)
        sub = torch.tensor([b])
        seq, _ = sequential(logits[sub], [MIXED[b]], positions[sub], counts[sub], prompt[sub])
        kw = dict(token_counts=counts[sub], prompt_mask=prompt[sub])
        args = (logits[sub], seq[:, :K].clone(), [MIXED[b]], positions[sub])
        ref = verify(*args, backend="torch", **kw)
        tri = verify(*args, backend="triton", **kw)
        assert torch.equal(ref.token_ids, seq)
        assert_same_output(tri, ref)


@pytest.mark.parametrize("K", [0, 3])
def test_triton_bad_rows_and_pads_equal_torch(K: int) -> None:
    """The Triton flatten / emit on rows with nothing samplable (at offset 0, at offset 2),
    pads, out-of-range-free drafts of every run length, in both methods."""
    V, B = 40, 6
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(B, K + 1, V, generator=g)
    params = [P(temperature=0.0, seed=1), P(seed=2, top_k=4), P(seed=3, logprobs=2),
              P(temperature=0.0, seed=4, presence_penalty=1.0), P(seed=5, top_p=0.5),
              P(temperature=0.0, seed=6)]  # fmt: skip
    logits[1, 0] = NAN
    positions = torch.arange(B) * 3
    seq, _ = sequential(logits, params, positions)
    drafts = seq[:, :K].clone()
    if K:
        logits[4, 2] = NINF
        drafts[1] = torch.tensor([3, 4, 5])  # row 1 has no sequence: drafts anyway
        drafts[2, 1:] = -1
        drafts[5, 0] = (drafts[5, 0] + 1) % V
    for method in METHODS:
        ref = verify(logits, drafts, params, positions, method=method)
        tri = verify(logits, drafts, params, positions, method=method, backend="triton")
        assert_same_output(tri, ref)
        assert ref.valid.tolist() == [True, False, True, True, True, True]


@pytest.mark.parametrize("layout", ["drafts", "positions"])
def test_triton_strided_inputs_equal_torch(layout: str) -> None:
    """Views are valid arguments: a transposed drafts tensor, every other position."""
    V, K, B = 50, 3, 4
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(B, K + 1, V, generator=g)
    params = [P(seed=i, temperature=0.0 if i % 2 else 1.0) for i in range(B)]
    seq, _ = sequential(logits, params, torch.arange(B) * 10)
    drafts, positions = seq[:, :K].clone(), (torch.arange(2 * B) * 5)[::2]
    if layout == "drafts":
        positions = positions.clone()
        drafts = drafts.T.contiguous().T
        assert drafts.stride(1) != 1
    ref = verify(logits, drafts, params, positions, backend="torch")
    tri = verify(logits, drafts, params, positions, backend="triton")
    assert torch.equal(ref.token_ids, verify(logits, drafts.contiguous(), params,
                                             positions.contiguous()).token_ids)  # fmt: skip
    assert_same_output(tri, ref)


def test_triton_count_ids_equal_torch() -> None:
    """sample_step's count_ids: triton = torch = the same ids added to token_counts."""
    V = 130
    params = [P(temperature=0.0, frequency_penalty=2.0, seed=1),
              P(presence_penalty=2.0, temperature=0.5, seed=2, logprobs=2,
                logprobs_mode="processed"),
              P(repetition_penalty=3.0, frequency_penalty=1.0, top_k=8, seed=3),
              P(seed=4, top_p=0.8, frequency_penalty=-1.5, logit_bias={0: 2.0}),
              P(seed=5, temperature=0.3),  # no penalties: count_ids change nothing
              P(temperature=0.0, presence_penalty=-2.0, min_p=0.1, seed=6)]  # fmt: skip
    B = len(params)
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(B, V, generator=g) * 0.7
    top = logits.argsort(dim=1, descending=True)
    ids = torch.stack([top[:, 0], top[:, 0], top[:, 1], top[:, 2]], dim=1)
    ids[1, 3] = -1
    ids[3, 2:] = -1
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[:, 5] = 1
    prompt = torch.zeros(B, V, dtype=torch.bool)
    prompt[:, 9] = True
    added = counts.clone()
    for b in range(B):
        for i in ids[b].tolist():
            if i >= 0:
                added[b, i] += 1
    pos = torch.arange(B) * 13 + 2

    def run(backend, count_ids, tc):
        table = SamplingTensors.from_params(params, V, "cpu", tc, prompt)
        out = SamplerOutput.allocate(B, "cpu", 2)
        return sample_step(logits, torch.arange(B), pos, table, out, backend=backend,
                           count_ids=count_ids)  # fmt: skip

    ref = run("torch", ids, counts)
    tri = run("triton", ids, counts)
    assert torch.equal(tri.token_ids, ref.token_ids)
    torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(tri.top_token_ids, ref.top_token_ids)
    by_counts = run("torch", None, added)
    assert torch.equal(by_counts.token_ids, ref.token_ids)
    torch.testing.assert_close(by_counts.logprobs, ref.logprobs, rtol=0, atol=1e-6)
    assert torch.equal(run("triton", None, added).token_ids, ref.token_ids)
    # the control: the ids do change the penalised rows (greedy rows leave their argmax)
    plain = run("torch", None, counts)
    assert ref.token_ids[0] != plain.token_ids[0]
    assert ref.token_ids[4] == plain.token_ids[4]
