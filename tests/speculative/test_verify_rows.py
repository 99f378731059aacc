"""`verify_drafts`, both methods, row by row on the CPU: greedy rows accept exactly the
argmax drafts, rows are independent of batch order and of bad neighbours, and bad
arguments raise a ValueError naming the argument."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import numpy as np
import pytest
import torch

from graphexec.speculative import verify_drafts
from tests.speculative.verify_cases import (
    METHODS,
    MIXED,
    NAN,
    NINF,
    P,
    bits,
    mixed_inputs,
    sequential,
    verify,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


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
